"""Compile sglang's real Triton kernels for sm_120 on a CPU-only machine (no GPU, no torch)
and read the shared memory that Triton will ask the driver for at launch.

`metadata.shared` is exactly what Triton compares with the opt-in limit before it raises
`OutOfResources`, so `shared_bytes(...) <= SM120_SMEM_OPTIN` is the launch condition.
The kernels come from a release's file (bytes), cut down to what compiles without sglang:
see `load_kernels`. sglang's own selection and launch code then runs for a chosen GPU
(`set_gpu`), with FakeTensors for its tensors, and `capture_launches` records what it launches.

Triton is imported by the functions that compile (and by the kernel module `load_kernels`
executes), never when this module is imported.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

SM120_SMEM_OPTIN = 101376  # cudaDevAttrMaxSharedMemoryPerBlockOptin, RTX PRO 6000 / RTX 50xx
SMEM_OPTIN = {(8, 0): 166912, (9, 0): 232448, (10, 0): 232448, (12, 0): SM120_SMEM_OPTIN}
# The config selectors and launchers the loader keeps, with the plain module functions they
# call; names a file lacks are ignored.
HELPERS = (
    "_get_block_sizes_for_extend_attention",
    "_get_num_stages_for_extend_attention",
    "context_attention_fwd",
    "get_default_config",
    "should_enable_swap_ab",
    "invoke_fused_moe_kernel",
)


@dataclass(frozen=True)
class Dtype:  # torch.dtype stand-in: Triton reads str(dtype); sglang compares dtypes
    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


DTYPES = {
    d.name: d
    for d in (
        Dtype("float32", 4),
        Dtype("float16", 2),
        Dtype("bfloat16", 2),
        Dtype("float8_e4m3fn", 1),
        Dtype("int8", 1),
        Dtype("uint8", 1),
        Dtype("int32", 4),
        Dtype("int64", 8),
    )
}


class FakeTensor:
    """A contiguous tensor as launchers and the specializer see it (16-byte aligned, like
    every torch allocation)."""

    def __init__(self, shape, dtype: str = "bfloat16"):
        self.shape, self.ndim, self.dtype = tuple(shape), len(shape), DTYPES[dtype]

    def __repr__(self) -> str:
        return f"FakeTensor({self.shape}, {self.dtype.name})"

    def stride(self, dim: int | None = None):
        strides = tuple(math.prod(self.shape[i + 1 :]) for i in range(self.ndim))
        return strides if dim is None else strides[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def data_ptr(self) -> int:
        return 1 << 20


def set_gpu(module: ModuleType, capability: tuple[int, int] = (12, 0)) -> ModuleType:
    """Set the globals sglang computes at import (and the sglang / torch functions the
    selectors and launchers call) as they are on a CUDA GPU of this capability."""
    major, minor = capability
    props = SimpleNamespace(major=major, minor=minor, shared_memory_per_block_optin=SMEM_OPTIN.get(capability, 101376))
    cuda = SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        get_device_capability=lambda device=None: capability,
        get_device_properties=lambda device=None: props,
    )
    off = SimpleNamespace(enable_deterministic_inference=False)
    vars(module).update(
        _is_cuda=True,
        _is_hip=False,
        _is_npu=False,
        _is_cpu=False,
        _is_gfx95=False,
        _is_gfx1250=False,
        _use_aiter=False,
        CUDA_CAPABILITY=capability,
        padding_size=0,  # get_moe_padding_size(): 0 unless SGLANG_MOE_PADDING=1
        torch=SimpleNamespace(cuda=cuda, Tensor=FakeTensor, float=DTYPES["float32"], **DTYPES),
        is_cuda=lambda: True,
        is_hip=lambda: False,
        get_device_capability=lambda *a, **k: capability,
        is_sm90_supported=lambda *a: major == 9,
        is_sm100_supported=lambda *a: major == 10,
        is_sm120_supported=lambda *a: major == 12,
        is_arch_support_pdl=lambda: major >= 9,  # sglang.kernels.jit.utils (0.5.19+)
        is_batch_invariant_mode_enabled=lambda: False,
        get_global_server_args=lambda: off,
        get_exec=lambda: SimpleNamespace(deterministic=off),
        logger=logging.getLogger(module.__name__),
    )
    return module


def _end(node: ast.stmt | ast.expr) -> int:
    """The node's last line (the parser always sets it)."""
    return node.end_lineno or node.lineno


def _is_jit(node: ast.expr) -> bool:
    node = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(node) in ("triton.jit", "jit")


def _is_literal(node: ast.expr) -> bool:  # `_MIN_BLOCK_KV = 32`, `_CUTOFF = 128 * 1024`
    ok = (ast.Constant, ast.Tuple, ast.List, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load)
    return all(isinstance(n, ok) for n in ast.walk(node))


def load_kernels(source: bytes, tmpdir: Path, helpers=HELPERS) -> ModuleType:
    """Import a kernel file without sglang or torch. Kept: stdlib and triton imports, every
    @triton.jit function, literal constants, and the `helpers` with the module functions they
    call (their other decorators, e.g. lru_cache, dropped so set_gpu takes effect). Every other
    line is blanked, so line numbers in compiler errors still match the release's file."""
    text = source.decode()
    tree = ast.parse(text)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    wanted, todo = set(), [h for h in helpers if h in funcs]
    while todo:  # helpers plus the plain module functions they reach
        name = todo.pop()
        if name not in wanted and not any(_is_jit(d) for d in funcs[name].decorator_list):
            wanted.add(name)
            todo += [n.id for n in ast.walk(funcs[name]) if isinstance(n, ast.Name) and n.id in funcs]
    blank: set[int] = set()
    for node in tree.body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        if isinstance(node, ast.FunctionDef) and (node.name in wanted or any(map(_is_jit, node.decorator_list))):
            blank.update(n for d in node.decorator_list if not _is_jit(d) for n in range(d.lineno, _end(d) + 1))
            continue
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
            roots = {
                ((node.module or "") if isinstance(node, ast.ImportFrom) else a.name).split(".")[0] for a in node.names
            }
            if roots <= set(sys.stdlib_module_names) | {"triton", "__future__"}:
                continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_literal(node.value):
            continue
        blank.update(range(first, _end(node) + 1))
    lines = text.splitlines()
    kept = "\n".join("" if i + 1 in blank else line for i, line in enumerate(lines)) + "\n"
    name = "sglang_aot_" + hashlib.sha256(source + repr(helpers).encode()).hexdigest()[:16]
    path = Path(tmpdir) / f"{name}.py"
    path.write_text(kept)  # @triton.jit reads the source back with inspect.getsource
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file has both
    module = importlib.util.module_from_spec(spec)
    set_gpu(module)  # default args and annotations may name torch at definition time
    spec.loader.exec_module(module)
    return module


@dataclass
class Launch:
    """One `kernel[grid](*args, **kwargs)` as a launcher made it."""

    kernel: object
    args: dict  # parameter name -> value
    num_warps: int = 4  # Triton's CUDA defaults when the launcher passes none
    num_stages: int = 3
    options: dict = field(default_factory=dict)
    grid: object = None

    def shared_bytes(self, arch: int = 120) -> int:
        return shared_bytes(self.kernel, self.args, self.num_warps, self.num_stages, arch, **self.options)

    def compile_key(self, arch: int = 120) -> str:
        return compile_key(self.kernel, self.args, self.num_warps, self.num_stages, arch, **self.options)

    def compile_keys(self, arch: int = 120, vary: tuple[str, ...] = ()) -> tuple[str, str]:
        return compile_keys(self.kernel, self.args, self.num_warps, self.num_stages, arch, vary, **self.options)


def capture_launches(module: ModuleType, kernel_names, entry: str, *args, **kwargs) -> list[Launch]:
    """Call module.<entry>(*args, **kwargs) (e.g. the real invoke_fused_moe_kernel with
    FakeTensors) with each module.<kernel_name> replaced by a recorder; return the launches
    in the order they were made."""
    kernels = {name: getattr(module, name) for name in kernel_names if hasattr(module, name)}
    calls = []

    class Recorder:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, grid, a, kw))

    for name in kernels:
        setattr(module, name, Recorder(name))
    try:
        getattr(module, entry)(*args, **kwargs)
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    launches = []
    for name, grid, positional, keywords in calls:
        kernel = kernels[name]
        names = [p.name for p in kernel.params]
        bound = {**dict(zip(names, positional)), **{k: v for k, v in keywords.items() if k in names}}
        options = {k: v for k, v in keywords.items() if k not in names}  # num_warps, num_stages, launch_pdl...
        launches.append(Launch(kernel, bound, options.pop("num_warps", 4), options.pop("num_stages", 3), options, grid))
    return launches


def capture_launch(module: ModuleType, kernel_name: str, entry: str, *args, **kwargs) -> Launch:
    """capture_launches for a launcher that makes exactly one launch of module.<kernel_name>."""
    launches = capture_launches(module, [kernel_name], entry, *args, **kwargs)
    assert len(launches) == 1, f"{entry} launched {kernel_name} {len(launches)} times"
    return launches[0]


@functools.cache
def _specialize_impl():
    """The specializer the JIT uses at launch (Triton >= 3.6 in C++, 3.5 in Python)."""
    from triton.backends.compiler import BaseBackend

    try:
        from triton._C.libtriton import native_specialize_impl

        return lambda *args: native_specialize_impl(BaseBackend, *args)
    except ImportError:
        from triton.runtime.jit import create_specialize_impl

        return create_specialize_impl(BaseBackend.get_arg_specialization)


def specialize(kernel, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch, as the JIT specialises the arguments at
    launch: 16-byte aligned pointers, ints % 16 == 0, ints == 1, None."""
    from triton.backends.compiler import BaseBackend

    unknown = set(args) - {p.name for p in kernel.params}
    if unknown:
        raise TypeError(f"{kernel.__name__}: no parameter {sorted(unknown)}")
    signature, constexprs, attrs = {}, {}, {}
    for p in kernel.params:
        if p.name not in args and not p.has_default:
            raise TypeError(f"{kernel.__name__}: missing argument {p.name}")
        val = args.get(p.name, p.default)
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", val
            continue
        specialize_on, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
        ty, spec = _specialize_impl()(val, p.is_const, specialize_on, align)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = val
        elif isinstance(spec, str):
            attrs[(p.num,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs


def compile_key(kernel, args: dict, num_warps: int, num_stages: int, arch: int = 120, **options) -> str:
    """What triton.compile's result depends on besides the kernel's source and Triton itself:
    equal keys compile to the same binary (and the same shared memory)."""
    return compile_keys(kernel, args, num_warps, num_stages, arch, **options)[0]


def compile_keys(
    kernel, args: dict, num_warps: int, num_stages: int, arch: int = 120, vary: tuple[str, ...] = (), **options
) -> tuple[str, str]:
    """(compile_key, the key of its family): the same compile inputs less the constexprs
    named in `vary` and num_stages. One specialisation for both."""
    signature, constexprs, attrs = specialize(kernel, args)
    common = (kernel.__name__, signature, sorted(attrs.items()), num_warps, arch, sorted(options.items()))
    family = {name: value for name, value in constexprs.items() if name not in vary}
    return _digest((*common, constexprs, num_stages)), _digest((*common, family))


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def compile_for(kernel, args: dict, num_warps: int, num_stages: int, arch: int = 120, **options):
    """triton.compile for GPUTarget("cuda", arch, 32), with the arguments specialised as the
    JIT does at launch. Without that, Triton cannot prove alignment, does not pipeline, and
    under-reports shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(kernel, args)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages, **options)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def shared_bytes(kernel, args: dict, num_warps: int, num_stages: int, arch: int = 120, **options) -> int:
    return compile_for(kernel, args, num_warps, num_stages, arch, **options).metadata.shared


def triton_version() -> str | None:
    """The Triton that compiles here, without importing it (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None
