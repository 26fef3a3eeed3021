"""The installed sglang's fused-MoE Triton kernel: where its file is, and the two launches one
MoE forward makes with a given config, as the release's own `invoke_fused_moe_kernel` makes
them (run here with FakeTensors, its kernels replaced by recorders; see aot.capture_launches).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from sm120kit.errors import UserError
from sm120kit.tune import aot
from sm120kit.tune.shape import MoeShape
from sm120kit.tune.space import CONFIG_KEYS

# Where releases keep the file that defines `fused_moe_kernel`, newest layout first (paths
# inside site-packages, as the wheels have them).
KERNEL_FILES = (
    "sglang/kernels/ops/moe/fused_moe_triton_kernels.py",  # 0.5.16 and later
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_kernels.py",  # 0.5.11-0.5.15.post1
    "sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py",  # 0.5.9-0.5.10.post1
)
KERNELS = ("fused_moe_kernel", "fused_moe_kernel_gptq_awq")
ENTRY = "invoke_fused_moe_kernel"
# sglang's config dtype names (get_config_dtype_str) this module knows how to launch.
DTYPES = (None, "fp8_w8a8", "int8_w8a8", "int8_w8a16", "int4_w4a16")
DTYPE_FLAGS = ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16")
GEMMS = ("w13", "w2")  # up (gate and up projections, fused), down


def defines_fused_moe_kernel(source: bytes) -> bool:
    """True when the file defines a @triton.jit `fused_moe_kernel` (not a re-export)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "fused_moe_kernel" and node.decorator_list
        for node in tree.body
    )


def find_kernel_file(site: Path) -> Path:
    """The installed file that defines sglang's fused_moe_kernel, among the known locations."""
    for relpath in KERNEL_FILES:
        path = Path(site) / relpath
        if path.is_file() and defines_fused_moe_kernel(path.read_bytes()):
            return path
    raise UserError(
        f"no file under {site} defines sglang's fused_moe_kernel (looked for {', '.join(KERNEL_FILES)})",
        "check that sglang is installed in the target environment (sm120kit status), or pass --python EXE",
    )


def load(source: bytes, tmpdir: Path, capability: tuple[int, int] = (12, 0), origin: str = "") -> ModuleType:
    """The kernel file's kernels and launcher, importable without sglang or torch (origin:
    the file's name, for messages)."""
    return prepare(aot.load_kernels(source, tmpdir), capability, origin)


def prepare(module: ModuleType, capability: tuple[int, int] = (12, 0), origin: str = "") -> ModuleType:
    """A kernel file loaded by aot.load_kernels, made ready for moe_launches on a GPU of
    this capability."""
    missing = [name for name in (*KERNELS, ENTRY) if not hasattr(module, name)]
    if missing:
        raise UserError(
            f"{origin or 'the fused-MoE kernel file'} has no {', '.join(missing)}: "
            "an sglang layout sm120kit does not know",
            "tune-moe supports the sglang releases sm120kit was proven on (sm120kit status shows them)",
        )
    vars(module).update(_quant_stand_ins())
    return aot.set_gpu(module, capability)


def _quant_stand_ins() -> dict:
    """sglang's activation-quantisation functions as invoke_fused_moe_kernel sees their
    results: the quantised tensor and its scales, with the shapes and dtypes they return."""
    t = aot.FakeTensor

    def per_tensor_fp8(a, scale=None, use_per_token_if_dynamic=False, **_):
        if scale is None:
            scale = t((a.shape[0], 1) if use_per_token_if_dynamic else (1,), "float32")
        return t(a.shape, "float8_e4m3fn"), scale

    def per_token_int8(a, *_, **__):
        return t(a.shape, "int8"), t((a.shape[0], 1), "float32")

    def group(dtype):
        def quant(a, group_size, *_, **__):
            return t(a.shape, dtype), t((a.shape[0], -(-a.shape[-1] // group_size)), "float32")

        return quant

    return {
        "scaled_fp8_quant": per_tensor_fp8,
        "per_token_quant_int8": per_token_int8,
        "sglang_per_token_group_quant_fp8": group("float8_e4m3fn"),
        "per_token_group_quant_fp8": group("float8_e4m3fn"),
        "sglang_per_token_group_quant_int8": group("int8"),
        "per_token_group_quant_int8": group("int8"),
    }


@dataclass(frozen=True)
class Gemm:
    """One of the two GEMMs of a MoE forward, as sglang's fused_experts builds it."""

    name: str  # "w13" (gate/up) or "w2" (down)
    a: aot.FakeTensor  # activations as they reach invoke_fused_moe_kernel (bf16: it quantises them)
    b: aot.FakeTensor  # the experts' weights
    b_scale: aot.FakeTensor | None
    c: aot.FakeTensor
    mul_routed_weight: bool
    top_k: int


def both_gemms(shape: MoeShape, m: int) -> tuple[Gemm, Gemm]:
    """The up GEMM (A [m, hidden], B [E, 2*intermediate, hidden]) and the down GEMM
    (A [m*top_k, intermediate], B [E, hidden, intermediate]), with the weights and scales
    as sglang's quantisation methods lay them out for `shape.dtype`."""
    if shape.dtype not in DTYPES:
        known = ", ".join(str(d) for d in DTYPES)
        raise UserError(f"MoE dtype {shape.dtype!r} has no Triton fused-MoE launch sm120kit knows ({known})")
    t, e, h, i, k = aot.FakeTensor, shape.experts, shape.hidden, shape.intermediate, shape.top_k
    block = shape.block_shape
    grouped = bool(block and block[0] == 0 and block[1] > 0)  # moe_wna16's [0, group_size]
    if (shape.dtype == "int4_w4a16" and not grouped) or (shape.dtype == "int8_w8a16" and block and not grouped):
        raise UserError(f"{shape.dtype} needs block_shape [0, group_size] (got {block}), as sglang's moe_wna16 sets it")

    def weights(n: int, kk: int) -> tuple[aot.FakeTensor, aot.FakeTensor | None]:
        if shape.dtype is None:
            return t((e, n, kk)), None
        if grouped and block:  # moe_wna16: uint8, two int4 a byte; scales in the model's dtype
            pack = 2 if shape.dtype == "int4_w4a16" else 1
            return t((e, n, kk // pack), "uint8"), t((e, n, kk // block[1]))
        if shape.dtype == "int8_w8a16":  # channel-wise, no group: fused_moe_kernel's w8a16 path
            return t((e, n, kk), "int8"), t((e, n), "float32")
        weight = t((e, n, kk), "float8_e4m3fn" if shape.dtype == "fp8_w8a8" else "int8")
        if block:
            return weight, t((e, -(-n // block[0]), -(-kk // block[1])), "float32")
        if shape.per_channel_quant:  # int8_w8a8 requires it (the launcher asserts so)
            return weight, t((e, n, 1), "float32")
        return weight, t((e,), "float32")

    w1, w1_scale = weights(2 * i, h)
    w2, w2_scale = weights(h, i)
    up = Gemm("w13", t((m, h)), w1, w1_scale, t((m * k, 2 * i)), False, k)
    down = Gemm("w2", t((m * k, i)), w2, w2_scale, t((m, k, h)), True, 1)
    return up, down


def moe_launches(
    module: ModuleType, shape: MoeShape, config: dict, m: int, gemms: tuple[str, ...] = GEMMS
) -> list[aot.Launch]:
    """The launches the release's invoke_fused_moe_kernel makes for one MoE forward of m
    tokens with `config` (the up GEMM's, then the down GEMM's; `gemms` picks: a `_down.json`
    table configures the down GEMM only), captured, not restated.
    Routing as fused_experts sets it without expert parallelism (filter_expert=False), the
    activation scales dynamic, no bias, no zero points, no TMA."""
    if unknown := set(gemms) - set(GEMMS):
        raise ValueError(f"no GEMM {sorted(unknown)}: a MoE forward has {', '.join(GEMMS)}")
    config = _launchable(config)
    t, e, k = aot.FakeTensor, shape.experts, shape.top_k
    block_m = config["BLOCK_SIZE_M"]
    # moe_align_block_size's buffers: sorted ids padded per expert (E + 1 slots; 0.5.23 also
    # rounds up to a multiple of 4). Their length reaches the kernel as the integer EM only.
    tokens = m * k
    padded = tokens * block_m if tokens < e + 1 else tokens + (e + 1) * (block_m - 1)
    routing = dict(
        topk_weights=t((m, k), "float32"),
        topk_ids=t((m, k), "int32"),
        sorted_token_ids=t((padded,), "int32"),
        expert_ids=t((-(-padded // block_m),), "int32"),
        num_tokens_post_padded=t((1,), "int32"),
    )
    flags = {flag: shape.dtype == flag.removeprefix("use_") for flag in DTYPE_FLAGS}
    launches = []
    for gemm in both_gemms(shape, m):
        if gemm.name not in gemms:
            continue
        try:
            launches += aot.capture_launches(
                module,
                KERNELS,
                ENTRY,
                gemm.a,
                gemm.b,
                None,  # bias
                gemm.c,
                None,  # A_scale: dynamic, computed by the launcher's quantisation
                gemm.b_scale,
                None,  # B_zp
                **routing,
                mul_routed_weight=gemm.mul_routed_weight,
                top_k=gemm.top_k,
                config=dict(config),  # the launcher reads it; keep ours intact
                compute_type=module.tl.bfloat16,
                **flags,
                per_channel_quant=shape.per_channel_quant,
                block_shape=list(shape.block_shape) if shape.block_shape else None,
                filter_expert=False,
                **({"router_topk": k} if gemm.name == "w2" and _accepts(module, "router_topk") else {}),
            )
        except AssertionError as exc:  # the release's own checks on its arguments
            raise UserError(
                f"sglang's {ENTRY} rejects this MoE ({shape.dtype}, block {shape.block_shape}): {exc}"
            ) from None
    return launches


def _launchable(config: dict) -> dict:
    """The config as invoke_fused_moe_kernel receives it: sglang pops USE_TMA before the
    call (true switches the launch to TMA descriptors, which this module does not model)."""
    config = dict(config)
    if config.pop("USE_TMA", False):
        raise UserError(f"config {config} asks for TMA (USE_TMA: true): sm120kit does not check TMA launches")
    missing, unknown = set(CONFIG_KEYS) - set(config), set(config) - set(CONFIG_KEYS)
    if missing or unknown:
        raise UserError(
            f"config {config}: {'missing ' + ', '.join(sorted(missing)) if missing else ''}"
            f"{'; ' if missing and unknown else ''}{'unknown ' + ', '.join(sorted(unknown)) if unknown else ''}",
            f"a fused-MoE config has exactly the keys {', '.join(CONFIG_KEYS)}",
        )
    return config


def _accepts(module: ModuleType, keyword: str) -> bool:
    import inspect

    return keyword in inspect.signature(getattr(module, ENTRY)).parameters
