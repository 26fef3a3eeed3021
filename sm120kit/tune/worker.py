"""Times candidate fused-MoE configs on one GPU with the installed sglang's own Triton kernel.

This file runs in the TARGET's interpreter (the one with torch, triton and sglang), started by
sm120kit.tune.worker_client (for timing.py) or sm120kit.tune.compare as `<python> worker.py`
with CUDA_VISIBLE_DEVICES set to one GPU. It imports the standard library, torch, triton and
the installed sglang only: never sm120kit, pydantic or libcst, which the target need not have.

Why it is one file of several jobs (the probe, the protocol's reading and writing, building the
inputs, running and timing sglang's kernel, the compile mode): another interpreter runs it as a
script by its path, and that environment need not have sm120kit installed, so it cannot import a
sibling module; split, it would have to put its own directory on sys.path, which the block below
takes off to keep its neighbours from shadowing torch's and sglang's imports, or load each part by
its path, as it loads the one part it shares with the other scripts run in the target (Fatal and
the JSON-lines channel, sm120kit/target_script.py). Its sections are marked below instead.

    python worker.py --probe        one JSON line: versions (from metadata), CUDA, the GPUs (names, memory)
    python worker.py JOB.json       run the job's batch sizes
    python worker.py < JOB          the job is the first line of stdin

The job (JSON):

    {"protocol": 1,
     "shape": {"experts", "hidden", "intermediate", "top_k", "dtype", "block_shape", "per_channel_quant"},
     "candidates": [{"BLOCK_SIZE_M": .., "BLOCK_SIZE_N": .., "BLOCK_SIZE_K": .., "GROUP_SIZE_M": ..,
                     "num_warps": .., "num_stages": ..}, ...],
     "batch_sizes": [1, 2, ...],        # optional: run these first
     "stream": false,                   # true: then read {"batch_size": M, ...} lines from stdin until EOF
     "seed": 0, "graph_runs": 10, "warmup": 3, "repeats": 10,
     "tolerance": null,                 # relative L2 error a candidate may have against the reference
     "interleave": false,               # true: time the default and the chosen candidates turn about,
                                        # replay by replay (a default-vs-tuned comparison in one run)
     "mode": "time"}                    # "compile": only run candidates `indices` once at each of
                                        # `batch_sizes`, filling Triton's on-disk cache (no timing)

A batch request (a "batch_sizes" entry or a stdin line) is an int or {"batch_size": M,
"indices": [only these candidates], "skip": [not these]}.

Output: one JSON object a line on stdout (everything else goes to stderr):

    {"event": "ready", "sglang", "triton", "torch", "device", "capability", "kernel_module",
     "sgl_kernel": "installed" | "stand-in", "pid"}
    {"event": "batch", "batch_size", "default": {config}, "candidates": n}
    {"event": "reference", "batch_size", "config", "us", "source": "default" | "fallback"}
    {"event": "result", "batch_size", "index", "status": "ok" | "failed" | "incorrect",
     "us" (ok/incorrect), "rel_err" (ok/incorrect), "error" (failed/incorrect),
     "compile_s" (the first run, compiles included), "bench_s" (capture and replays),
     "pruned" (true: slower than twice the best so far at its first replay; `us` is that replay)}
    {"event": "done", "batch_size", "default_us", "best_index", "best_us", "elapsed_s",
     "compile_s", "bench_s", "align": "sglang" | "torch" (which moe_align_block_size ran)}
    {"event": "compiled", "batch_size", "index", "error"}      (compile mode)
    {"event": "fatal", "kind": "no-torch" | "no-gpu" | "import" | "bad-job" | "cuda", "error"}

A fatal event ends the worker with exit status 3. A CUDA error that poisons the context (an illegal
address, say) is reported as the candidate's failed result, then as a fatal "cuda" event: the parent
starts a fresh worker and skips that candidate.

What is timed: one MoE forward as sglang's fused_experts_impl runs it on the routed tokens: the up
GEMM (w13, sglang's invoke_fused_moe_kernel), SiLU-and-mul, the down GEMM (w2, the same kernel, the
routing weights applied) and the sum over top-k; graph_runs forwards captured in one CUDA graph, each
over its own seeded routing (top_k distinct experts a token, uniform), replayed `repeats` times after
`warmup` replays, one CUDA event pair a replay, the median taken (a candidate more than PRUNE
times slower than the best so far at its first replay is not replayed further). The alignment of tokens to experts
(moe_align_block_size) depends only on BLOCK_SIZE_M and is done once, before timing.
"""

from __future__ import annotations

import sys

# Run as a script, this file's directory (sm120kit/tune) leads sys.path, and its neighbours'
# names (shape, kernels, timing, ...) would shadow top-level modules that torch or sglang import.
if sys.path and sys.path[0] and __name__ == "__main__":
    import os.path as _p

    if _p.realpath(sys.path[0]) == _p.dirname(_p.realpath(__file__)):
        del sys.path[0]

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import runpy
import statistics
import time
import types
from pathlib import Path

PROTOCOL = 1
EXIT_FATAL = 3
SHARED = Path(__file__).resolve().parent.parent / "target_script.py"

# Where each release keeps the kernel and the config helpers, newest layout first.
KERNEL_MODULES = (
    "sglang.kernels.ops.moe.fused_moe_triton_kernels",  # 0.5.16+
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_kernels",  # 0.5.11-0.5.15.post1
    "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels",  # <= 0.5.10.post1
)
CONFIG_MODULES = (
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",  # 0.5.11+
    "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config",  # <= 0.5.10.post1
)
ALIGN_MODULES = (
    "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size",
    "sglang.srt.layers.moe.fused_moe_triton.moe_align_block_size",
)

# A candidate's output against the reference (||out - ref|| / ||ref||): the kernel accumulates in
# fp32 whatever the tile, so a correct config differs only in summation order and in the rounding
# of the bf16 intermediate (and, quantized, in the 8-bit re-quantization of that intermediate).
TOLERANCE = {None: 1e-2, "fp8_w8a8": 5e-2, "int8_w8a8": 5e-2, "int8_w8a16": 2e-2, "int4_w4a16": 2e-2}
# The reference when the release's default config cannot run here (it may not fit the GPU's
# shared memory): a small tile of the same kernel.
# A candidate whose first warm replay is this many times slower than the fastest so far (the
# reference included) is not timed further: medians move by a few percent, not by this much.
PRUNE = 2.0
FALLBACK_REFERENCE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4}


# Fatal and the JSON-lines channel, shared with the other scripts run in the target: read from
# sm120kit/target_script.py by its path, as this interpreter need not have sm120kit.
_shared = runpy.run_path(str(SHARED))
Fatal, emit, first_line = _shared["Fatal"], _shared["emit"], _shared["first_line"]
keep_stdout_for_protocol = _shared["keep_stdout_for_protocol"]


def log(message: str) -> None:
    print(f"worker: {message}", file=sys.stderr, flush=True)


def version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- probe


def probe() -> dict:
    """What the parent needs before it starts timing workers, cheaply: versions from metadata,
    and whether torch sees CUDA GPUs (with all of the parent's GPUs visible)."""
    info = {
        "protocol": PROTOCOL,
        "python": sys.version.split()[0],
        "sglang": version_of("sglang"),
        "triton": version_of("triton"),
        "torch": version_of("torch"),
        "cuda": False,
        "devices": [],
    }
    try:
        import torch
    except Exception as exc:
        info["error"] = f"torch cannot be imported: {first_line(exc)}"
        return info
    info["torch_cuda"] = torch.version.cuda
    try:
        info["cuda"] = bool(torch.cuda.is_available())
        if info["cuda"]:
            count = torch.cuda.device_count()
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
            info["memory"] = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    except Exception as exc:  # a driver that torch cannot talk to
        info["cuda"] = False
        info["error"] = first_line(exc)
    return info


# ----------------------------------------------------------------------------- sglang


class StandInMissing(NotImplementedError):
    """An sgl_kernel function the stand-in does not provide was called."""


class StandInName:
    """A name of the stand-in sgl_kernel: imports, chains attributes (``scalar_types.uint4b8``), and
    raises StandInMissing only when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandInName(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise StandInMissing(f"{self._name} is not installed here (sm120kit's stand-in sgl_kernel)")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _stand_in_sgl_kernel(triton) -> None:
    """sgl_kernel (sglang's CUDA extension) is imported at module level along the kernel's import
    chain, but the config-dependent work timed here is sglang's Triton kernel, which never calls it.
    Where it is not installed (a bare GPU box used to prove the mechanism), a stand-in package lets
    the chain import: every name in it and its submodules is a StandInName that raises when called,
    except the per-token-group 8-bit quantization that invoke_fused_moe_kernel calls for
    block-quantized activations, which runs the release's own Triton quantization kernel (one
    launch, as sgl_kernel's is). Real nodes have sgl_kernel and never see this."""

    def per_token_group_quant_8bit(x, x_q, x_s, group_size, eps, bit8_min, bit8_max, *rest, **kwargs):
        groups = x.numel() // group_size
        kernel = None
        for name, module in list(sys.modules.items()):
            if name.endswith(".fp8_kernel") and hasattr(module, "_per_token_group_quant_8bit"):
                kernel = module._per_token_group_quant_8bit
                break
        if kernel is not None and x_s.is_contiguous() and x.is_contiguous():
            block = triton.next_power_of_2(group_size)
            kernel[(groups,)](
                x, x_q, x_s, group_size, group_size, eps, bit8_min, bit8_max, BLOCK=block, num_warps=1, num_stages=1
            )
            return
        view = x.reshape(groups, group_size).float()
        scale = view.abs().amax(dim=-1).clamp(min=eps) / bit8_max
        x_q.copy_((view / scale[:, None]).clamp(bit8_min, bit8_max).to(x_q.dtype).view(x_q.shape))
        x_s.copy_(scale.view(x_s.shape))

    provided = {
        "sgl_per_token_group_quant_8bit": per_token_group_quant_8bit,
        "sgl_per_token_group_quant_fp8": per_token_group_quant_8bit,
        "sgl_per_token_group_quant_int8": per_token_group_quant_8bit,
    }

    def make(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__file__ = "<sm120kit stand-in>"
        module.__path__ = []  # a package: `from sgl_kernel.quantization import ...` resolves too

        def attribute(attr: str):
            if attr.startswith("__"):  # the import system's probes (__spec__, __all__, ...)
                raise AttributeError(attr)
            return provided.get(attr) or StandInName(f"{name}.{attr}")

        # (through __dict__: a module's type names neither attribute)
        module.__dict__.update(__version__="0.0.0+stand-in", __getattr__=attribute)
        return module

    class Loader:
        @staticmethod
        def create_module(spec):
            return make(spec.name)

        @staticmethod
        def exec_module(module):
            pass

    class Finder:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
                return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder)


def _sglang_file_exists(module: str) -> bool:
    spec = importlib.util.find_spec("sglang")  # does not run sglang/__init__
    if spec is None or not spec.submodule_search_locations:
        return False
    relative = Path(*module.split(".")[1:]).with_suffix(".py")
    return any((Path(root) / relative).is_file() for root in spec.submodule_search_locations)


def _first_present(candidates: tuple[str, ...]) -> str | None:
    return next((name for name in candidates if _sglang_file_exists(name)), None)


def _ensure_server_args(config_module) -> None:
    """The release's get_default_config reads sglang's process-global server args (0.5.9+), set by
    the scheduler in a server; here they are set to the ServerArgs defaults, without running its
    __post_init__ (which wants a model)."""
    server_args = sys.modules.get("sglang.srt.server_args") or importlib.import_module("sglang.srt.server_args")
    getter = getattr(server_args, "get_global_server_args", None)
    setter = getattr(server_args, "set_global_server_args_for_scheduler", None)
    if getter is None or setter is None:
        return
    try:
        getter()
        return
    except Exception:
        pass
    import dataclasses

    cls = server_args.ServerArgs
    args = object.__new__(cls)
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        object.__setattr__(args, field.name, value)
    setter(args)


class Sglang:
    """The installed release's kernel entry point, default config and alignment."""

    def __init__(self, torch, triton) -> None:
        self.torch = torch
        kernel_module = _first_present(KERNEL_MODULES)
        config_module = _first_present(CONFIG_MODULES)
        if kernel_module is None or config_module is None:
            raise Fatal(
                "import",
                f"sglang {version_of('sglang')}: no fused_moe_triton_kernels.py / fused_moe_triton_config.py "
                f"where sm120kit knows them ({', '.join(KERNEL_MODULES)})",
            )
        try:
            import sgl_kernel  # noqa: F401

            self.sgl_kernel = "installed"
        except Exception as exc:
            log(f"sgl_kernel not importable ({first_line(exc)}): using the stand-in module")
            sys.modules.pop("sgl_kernel", None)
            _stand_in_sgl_kernel(triton)
            self.sgl_kernel = "stand-in"
        try:
            self.kernels = importlib.import_module(kernel_module)
            self.configs = importlib.import_module(config_module)
        except Exception as exc:
            raise Fatal("import", f"importing {kernel_module}: {first_line(exc)}") from exc
        self.kernel_module = kernel_module
        self.invoke = self.kernels.invoke_fused_moe_kernel
        self.parameters = inspect.signature(self.invoke).parameters
        self._align = None
        align_module = _first_present(ALIGN_MODULES)
        if align_module is not None:
            try:
                self._align = importlib.import_module(align_module).moe_align_block_size
            except Exception as exc:
                log(f"sglang's moe_align_block_size is not importable ({first_line(exc)}): aligning in torch")
        self.align_source = "sglang"

    def default_config(self, shape: dict, m: int) -> dict:
        """sglang's own default for this M, called as try_get_optimal_moe_config calls it when no
        config file matches (N = w2.shape[2], K = w1.shape[2])."""
        block_shape = list(shape["block_shape"]) if shape.get("block_shape") else None
        args = dict(
            M=m,
            E=shape["experts"],
            N=shape["intermediate"],
            K=shape["hidden"],
            topk=shape["top_k"],
            dtype=shape.get("dtype"),
            is_marlin=False,
            block_shape=block_shape,
        )
        get_default = self.configs.get_default_config
        params = inspect.signature(get_default).parameters
        call = {k: v for k, v in args.items() if k in params}
        try:
            return dict(get_default(**call))
        except Exception:
            _ensure_server_args(self.configs)
            return dict(get_default(**call))

    def align(self, topk_ids, block_m: int, experts: int):
        if self._align is not None:
            try:
                return self._align(topk_ids, block_m, experts)
            except Exception as exc:  # the stand-in sgl_kernel, a JIT op that cannot build here
                log(f"sglang's moe_align_block_size failed ({first_line(exc)}): aligning in torch")
                self._align = None
        self.align_source = "torch"
        return align_in_torch(self.torch, topk_ids, block_m, experts)

    def call(self, **kwargs) -> None:
        """invoke_fused_moe_kernel by keyword: its parameters change between releases, so pass the
        ones this release has; a required one we do not know is an error worth its own message."""
        missing = [
            name for name, p in self.parameters.items() if p.default is inspect.Parameter.empty and name not in kwargs
        ]
        if missing:
            raise Fatal("import", f"invoke_fused_moe_kernel wants parameters sm120kit does not know: {missing}")
        self.invoke(**{k: v for k, v in kwargs.items() if k in self.parameters})


def align_in_torch(torch, topk_ids, block_m: int, experts: int):
    """Data preparation, not the config-dependent kernel: the (sorted_token_ids, expert_ids,
    num_tokens_post_padded) that sglang's moe_align_block_size returns, for when its CUDA op is not
    installed. Each expert's tokens are padded to a multiple of block_m; padding slots hold
    topk_ids.numel() (the kernel masks them); the buffer sizes follow the release's wrapper."""
    flat = topk_ids.flatten().to(torch.int64)
    numel = flat.numel()
    capacity = numel * block_m if numel < experts + 1 else numel + (experts + 1) * (block_m - 1)
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel, device=flat.device) - first_of_expert[by_expert]
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[by_expert] + rank] = order.to(torch.int32)
    blocks = (capacity + block_m - 1) // block_m
    block_starts = torch.arange(blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp(max=experts - 1).to(torch.int32)
    total = ends[-1:].to(torch.int32)
    return sorted_ids, expert_ids, total


# ----------------------------------------------------------------------------- the problem


class Problem:
    """The weights (once per worker) and, per batch size, the activations, the routings and the
    output buffers: built from the seed, the same for every candidate, as sglang's tuner builds them
    (random weights and scales of the dtype's layout)."""

    def __init__(
        self, torch, triton, sglang: Sglang, shape: dict, seed: int, graph_runs: int, device: str = "cuda"
    ) -> None:
        import triton.language as tl

        self.torch, self.sglang, self.shape, self.seed, self.graph_runs = torch, sglang, shape, seed, graph_runs
        self.device = device
        self.E, self.H, self.I, self.topk = shape["experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
        self.dtype = shape.get("dtype")
        self.block_shape = list(shape["block_shape"]) if shape.get("block_shape") else None
        self.per_channel = bool(shape.get("per_channel_quant"))
        if self.dtype not in TOLERANCE:
            raise Fatal("bad-job", f"dtype {self.dtype!r} is not one sm120kit times ({sorted(map(str, TOLERANCE))})")
        self.act_dtype = torch.bfloat16
        self.compute_type = tl.bfloat16
        self.flags = {
            "use_fp8_w8a8": self.dtype == "fp8_w8a8",
            "use_int8_w8a8": self.dtype == "int8_w8a8",
            "use_int8_w8a16": self.dtype == "int8_w8a16",
            "use_int4_w4a16": self.dtype == "int4_w4a16",
        }
        self.cdiv = triton.cdiv
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.w1, self.w1_scale, self.a1_scale = self._weights(2 * self.I, self.H, gen)
        self.w2, self.w2_scale, self.a2_scale = self._weights(self.H, self.I, gen)
        if self.device == "cuda":
            torch.cuda.empty_cache()  # the temporaries' memory back to the GPU, for its other processes
        self.batch: dict = {}  # start_batch's, before any use

    def _weights(self, n: int, k: int, gen):
        torch, E = self.torch, self.E
        dtype, block = self.dtype, self.block_shape
        scale = a_scale = None

        def rand(*size):
            return torch.rand(*size, generator=gen, device=self.device, dtype=torch.float32) * 0.01 + 0.005

        if dtype is None:
            w = torch.randn(E, n, k, generator=gen, device=self.device, dtype=self.act_dtype).div_(math.sqrt(k))
        elif dtype in ("int8_w8a8", "int8_w8a16"):
            w = torch.randint(-127, 127, (E, n, k), generator=gen, device=self.device, dtype=torch.int8)
            scale = rand(E, self.cdiv(n, block[0]), self.cdiv(k, block[1])) if block is not None else rand(E, n)
        elif dtype == "int4_w4a16":
            group = block[1] if block else k
            w = torch.randint(0, 255, (E, n, k // 2), generator=gen, device=self.device, dtype=torch.uint8)
            scale = rand(E, n, self.cdiv(k, group)).to(torch.bfloat16)
        elif dtype == "fp8_w8a8":
            # an expert at a time: the whole tensor in fp32 first would take 4x the weights' memory,
            # and the compile processes share the GPU
            w = torch.empty(E, n, k, device=self.device, dtype=torch.float8_e4m3fn)
            for e in range(E):
                w[e] = (torch.randn(n, k, generator=gen, device=self.device, dtype=torch.float32) * 16).to(w.dtype)
            if block is not None:
                scale = rand(E, self.cdiv(n, block[0]), self.cdiv(k, block[1]))
            elif self.per_channel:
                scale = rand(E, n, 1)
            else:
                scale = rand(E)
                a_scale = rand(1) * 10
        return w, scale, a_scale

    def start_batch(self, m: int) -> None:
        """Activations, graph_runs routings and buffers for M tokens (seeded by M, so a rerun or
        another GPU builds the same ones)."""
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + m)
        x = torch.randn(m, self.H, generator=gen, device=self.device, dtype=self.act_dtype)
        routings = []
        for _ in range(self.graph_runs):
            # top_k distinct experts a token, uniform over experts
            ids = (
                torch.rand(m, self.E, generator=gen, device=self.device).topk(self.topk, dim=1).indices.to(torch.int32)
            )
            weights = torch.softmax(torch.randn(m, self.topk, generator=gen, device=self.device), dim=-1)
            routings.append((ids.contiguous(), weights.contiguous()))
        self.batch = {
            "m": m,
            "x": x,
            "routings": routings,
            "aligned": {},
            "cache1": torch.empty(m * self.topk, 2 * self.I, device=self.device, dtype=self.act_dtype),
            "cache2": torch.empty(m * self.topk, self.I, device=self.device, dtype=self.act_dtype),
            "cache3": torch.empty(m, self.topk, self.H, device=self.device, dtype=self.act_dtype),
            "out": torch.empty(m, self.H, device=self.device, dtype=self.act_dtype),
        }

    def _aligned(self, r: int, block_m: int):
        key = (r, block_m)
        aligned = self.batch["aligned"]
        if key not in aligned:
            aligned[key] = self.sglang.align(self.batch["routings"][r][0], block_m, self.E)
        return aligned[key]

    def prepare(self, config: dict) -> None:
        for r in range(self.graph_runs):
            self._aligned(r, config["BLOCK_SIZE_M"])

    def forward(self, config: dict, r: int = 0):
        """One MoE forward over routing r, as sglang's fused_experts_impl sequences it."""
        torch, b = self.torch, self.batch
        ids, weights = b["routings"][r]
        sorted_ids, expert_ids, post_padded = self._aligned(r, config["BLOCK_SIZE_M"])
        common = dict(
            bias=None,
            B_zp=None,
            topk_weights=weights,
            topk_ids=ids,
            sorted_token_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_post_padded=post_padded,
            config=config,
            compute_type=self.compute_type,
            per_channel_quant=self.per_channel,
            block_shape=self.block_shape,
            **self.flags,
        )
        self.sglang.call(
            A=b["x"],
            B=self.w1,
            C=b["cache1"],
            A_scale=self.a1_scale,
            B_scale=self.w1_scale,
            mul_routed_weight=False,
            top_k=self.topk,
            **common,
        )
        gate, up = b["cache1"][:, : self.I], b["cache1"][:, self.I :]
        torch.mul(torch.nn.functional.silu(gate), up, out=b["cache2"])
        self.sglang.call(
            A=b["cache2"],
            B=self.w2,
            C=b["cache3"],
            A_scale=self.a2_scale,
            B_scale=self.w2_scale,
            mul_routed_weight=True,
            top_k=1,
            router_topk=self.topk,
            **common,
        )
        torch.sum(b["cache3"], dim=1, out=b["out"])
        return b["out"]


# ----------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, torch, problem: Problem, warmup: int, repeats: int) -> None:
        self.torch, self.problem, self.warmup, self.repeats = torch, problem, warmup, repeats
        # 256 MB written before timing, as sglang's tuner does, so no candidate starts on a warm L2
        self.flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")

    def run_once(self, config: dict):
        """Compile (first call) and run on routing 0; the output, copied. The buffers are NaN
        before: a config whose kernel leaves part of them unwritten cannot pass for correct on
        what the one before it wrote."""
        self.problem.prepare(config)
        for name in ("cache1", "cache2", "cache3", "out"):
            self.problem.batch[name].fill_(math.nan)
        out = self.problem.forward(config, 0).clone()
        self.torch.cuda.synchronize()
        return out

    def capture(self, config: dict, warmup: int | None = None):
        """The graph of graph_runs forwards. run_once came first: it compiled the kernels, and
        every routing of a batch size has the same tensor sizes, so the same specialisations."""
        torch, problem = self.torch, self.problem
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(problem.graph_runs):
                problem.forward(config, r)
        torch.cuda.synchronize()
        for _ in range(self.warmup if warmup is None else warmup):
            graph.replay()
        torch.cuda.synchronize()
        return graph

    def replay_ms(self, graph) -> float:
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def per_forward_us(self, samples: list[float]) -> float:
        return statistics.median(samples) * 1000.0 / self.problem.graph_runs

    def time(self, config: dict, give_up_us: float | None = None) -> tuple[float, bool]:
        """Median µs of one forward, and whether the timing was cut short: a config whose first
        warm replay is slower than give_up_us cannot win (it is given as twice the best so far),
        so that one replay is its estimate and the repeats are spared."""
        graph = self.capture(config, warmup=1)
        first = self.per_forward_us([self.replay_ms(graph)])
        if give_up_us is not None and first > give_up_us:
            del graph
            return first, True
        for _ in range(self.warmup - 1):
            graph.replay()
        self.flush.zero_()
        samples = [self.replay_ms(graph) for _ in range(self.repeats)]
        del graph
        return self.per_forward_us(samples), False

    def time_interleaved(self, configs: list[dict]) -> list[float]:
        """Each config's graph replayed turn about, so clock and thermal drift fall on all alike."""
        graphs = [self.capture(c) for c in configs]
        self.flush.zero_()
        samples: list[list[float]] = [[] for _ in configs]
        for _ in range(self.repeats):
            for i, graph in enumerate(graphs):
                samples[i].append(self.replay_ms(graph))
        del graphs
        return [self.per_forward_us(s) for s in samples]


def rel_err(torch, out, ref) -> float:
    out32, ref32 = out.float(), ref.float()
    if not bool(torch.isfinite(out32).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref32))
    return float(torch.linalg.vector_norm(out32 - ref32)) / max(denom, 1e-30)


def is_context_fatal(exc: BaseException) -> bool:
    """Errors after which this process's CUDA context is unusable."""
    text = str(exc).lower()
    return any(
        s in text
        for s in ("illegal memory access", "illegal instruction", "unspecified launch failure", "misaligned address")
    )


# ----------------------------------------------------------------------------- the job


def parse_request(item) -> dict:
    if isinstance(item, int):
        return {"batch_size": item}
    if isinstance(item, dict) and isinstance(item.get("batch_size"), int):
        return item
    raise Fatal("bad-job", f"a batch request is an int or {{'batch_size': M}}, not {item!r}")


def run_batch(torch, sglang: Sglang, problem: Problem, timer: Timer, job: dict, request: dict) -> None:
    m = request["batch_size"]
    candidates = job["candidates"]
    indices = request.get("indices")
    indices = list(range(len(candidates))) if indices is None else list(indices)
    skip = set(request.get("skip") or ())
    indices = [i for i in indices if i not in skip]
    tolerance = job.get("tolerance") or TOLERANCE[problem.dtype]
    started = time.perf_counter()
    problem.start_batch(m)
    default = sglang.default_config(problem.shape, m)
    emit("batch", batch_size=m, default=default, candidates=len(indices))

    reference, source = None, "default"
    for config, label in ((default, "default"), (FALLBACK_REFERENCE, "fallback")):
        try:
            reference = timer.run_once(config)
            source, ref_config = label, config
            break
        except Exception as exc:
            if is_context_fatal(exc):
                raise Fatal("cuda", f"reference config {config}: {first_line(exc)}") from exc
            log(f"batch {m}: {label} config {config} cannot run: {first_line(exc)}")
    if reference is None:
        raise Fatal("cuda", f"batch {m}: neither sglang's default config nor the fallback runs on this GPU")

    default_us = None
    compile_s = bench_s = 0.0  # seconds in first runs (compiles) and in timing, over the candidates
    if job.get("interleave"):
        runnable = []
        for i in indices:
            try:
                out = timer.run_once(candidates[i])
                err = rel_err(torch, out, reference)
            except Exception as exc:
                emit("result", batch_size=m, index=i, status="failed", error=first_line(exc))
                if is_context_fatal(exc):
                    raise Fatal("cuda", first_line(exc)) from exc
                continue
            runnable.append((i, err))
        times = timer.time_interleaved([ref_config] + [candidates[i] for i, _ in runnable])
        ref_us = times[0]
        emit("reference", batch_size=m, config=ref_config, us=ref_us, source=source)
        results = list(zip(runnable, times[1:]))
        for (i, err), us in results:
            ok = err <= tolerance
            emit(
                "result",
                batch_size=m,
                index=i,
                status="ok" if ok else "incorrect",
                us=us,
                rel_err=err,
                **({} if ok else {"error": f"relative error {err:.3g} over {tolerance:g}"}),
            )
        scored = [(us, i) for (i, err), us in results if err <= tolerance]
    else:
        ref_us, _ = timer.time(ref_config)
        emit("reference", batch_size=m, config=ref_config, us=ref_us, source=source)
        scored = []
        fastest = ref_us
        for i in indices:
            config = candidates[i]
            t0 = time.perf_counter()
            try:
                out = timer.run_once(config)  # compiles on first sight of this config
                err = rel_err(torch, out, reference)
                t1 = time.perf_counter()
                us, cut = timer.time(config, give_up_us=PRUNE * fastest)
            except Exception as exc:
                emit("result", batch_size=m, index=i, status="failed", error=first_line(exc))
                if is_context_fatal(exc):
                    raise Fatal("cuda", first_line(exc)) from exc
                continue
            spent = {"compile_s": round(t1 - t0, 4), "bench_s": round(time.perf_counter() - t1, 4), "pruned": cut}
            compile_s += spent["compile_s"]
            bench_s += spent["bench_s"]
            if err <= tolerance:
                emit("result", batch_size=m, index=i, status="ok", us=us, rel_err=err, **spent)
                scored.append((us, i))
                fastest = min(fastest, us)
            else:
                error = f"relative error {err:.3g} over {tolerance:g}"
                emit("result", batch_size=m, index=i, status="incorrect", us=us, rel_err=err, error=error, **spent)
    if source == "default":
        default_us = ref_us
    best_us, best_index = min(scored) if scored else (None, None)
    emit(
        "done",
        batch_size=m,
        default_us=default_us,
        best_index=best_index,
        best_us=best_us,
        elapsed_s=round(time.perf_counter() - started, 3),
        compile_s=round(compile_s, 3),
        bench_s=round(bench_s, 3),
        align=sglang.align_source,
    )


def compile_candidates(problem: Problem, job: dict) -> None:
    """The compile mode: run the job's candidates (`indices`) once at each batch size, so that
    Triton compiles every specialisation the timing will meet (tokens reach the kernel as integer
    arguments that Triton specialises on) into its on-disk cache, which the timing workers share.
    Several of these run side by side, one CPU core each, before the timing starts; nothing is
    timed here. One `compiled` event per (batch size, candidate)."""
    torch = problem.torch
    candidates = job["candidates"]
    indices = job.get("indices")
    indices = list(range(len(candidates))) if indices is None else list(indices)
    for item in job.get("batch_sizes") or ():
        m = parse_request(item)["batch_size"]
        problem.start_batch(m)
        for i in indices:
            error = None
            try:
                problem.prepare(candidates[i])
                problem.forward(candidates[i], 0)
                torch.cuda.synchronize()
            except Exception as exc:
                error = first_line(exc)
                if is_context_fatal(exc):
                    emit("compiled", batch_size=m, index=i, error=error)
                    raise Fatal("cuda", error) from exc
            emit("compiled", batch_size=m, index=i, error=error)


def read_job(argv: list[str]) -> dict:
    try:
        text = Path(argv[0]).read_text() if argv else sys.stdin.readline()
        job = json.loads(text)
    except (OSError, ValueError) as exc:
        raise Fatal("bad-job", f"the job is not readable JSON: {first_line(exc)}") from exc
    if not isinstance(job, dict) or job.get("protocol") != PROTOCOL:
        raise Fatal(
            "bad-job",
            f"the job speaks protocol {job.get('protocol') if isinstance(job, dict) else None}, this worker {PROTOCOL}",
        )
    for key in ("shape", "candidates"):
        if key not in job:
            raise Fatal("bad-job", f"the job has no {key!r}")
    return job


def main(argv: list[str]) -> int:
    keep_stdout_for_protocol()
    if argv[:1] == ["--probe"]:
        emit("probe", **probe())
        return 0
    try:
        job = read_job(argv)
        try:
            import torch
            import triton
        except Exception as exc:
            raise Fatal("no-torch", f"torch/triton cannot be imported here: {first_line(exc)}") from exc
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise Fatal("no-gpu", "torch sees no CUDA GPU in this process")
        torch.cuda.set_device(0)
        sglang = Sglang(torch, triton)
        compiling = job.get("mode") == "compile"
        graph_runs = 1 if compiling else int(job.get("graph_runs", 10))
        problem = Problem(torch, triton, sglang, job["shape"], int(job.get("seed", 0)), graph_runs)
        emit(
            "ready",
            sglang=version_of("sglang"),
            triton=triton.__version__,
            torch=torch.__version__,
            device=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)),
            kernel_module=sglang.kernel_module,
            sgl_kernel=sglang.sgl_kernel,
            pid=os.getpid(),
        )
        if compiling:
            compile_candidates(problem, job)
            emit("exit", align=sglang.align_source)
            return 0
        timer = Timer(torch, problem, int(job.get("warmup", 3)), int(job.get("repeats", 10)))
        for item in job.get("batch_sizes") or ():
            run_batch(torch, sglang, problem, timer, job, parse_request(item))
        if job.get("stream"):
            for line in sys.stdin:
                if line.strip():
                    run_batch(torch, sglang, problem, timer, job, parse_request(json.loads(line)))
        emit("exit", align=sglang.align_source)
        return 0
    except Fatal as fatal:
        emit("fatal", kind=fatal.kind, error=fatal.error)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
