"""Proof that sglang's Triton kernel configs fit SM120's 101376 B of shared memory per block,
with sglang-triton-smem-sm120 applied, and that they do not without it.

Every figure is compiled here, on a CPU, from the release's own file (sm120kit.tune.aot):
sglang's own selection code runs for CUDA capability (12, 0) or (9, 0), the chosen launch
is compiled for sm_120, and `metadata.shared` (what Triton compares with the opt-in limit
before raising OutOfResources) is checked against 101376.

Releases are picked per code shape, to keep the file to a few dozen compiles on a 2-core CI:
* extend attention: the first and last release of each file location (0.5.9, 0.5.15.post1
  under srt/layers/attention/triton_ops/, 0.5.16, 0.5.23 under kernels/ops/attention/).
  Its kernel changes in most releases but its tiles come from one helper, so every other
  release is checked to select the same SM120 tiles as these compiled ones.
* context_attention_fwd: the same four releases. Its `_fwd_kernel` is the same text in every
  release 0.5.9-0.5.23, so the Triton cache compiles each distinct config only once.
* fused-MoE fp8 per-tensor default: 0.5.9 (config and kernel under moe/fused_moe_triton/)
  and 0.5.13.post1 (last release with the 128x256x128 default, moe_runner/triton_utils/) are
  patched; 0.5.14 (first with upstream's low-smem default) and 0.5.23 (kernel under
  kernels/ops/moe/) are only verified.
"""

from __future__ import annotations

import functools

import pytest
import triton  # noqa: F401 -- the test extra's: a missing Triton fails the run rather than skip it
from packaging.version import Version
from support import patch_cases
from support.sites import wheel_bytes

from sm120kit.tune import aot, kernels
from sm120kit.tune.shape import MoeShape

LIMIT = aot.SM120_SMEM_OPTIN
SM120, HOPPER = (12, 0), (9, 0)
PATCH = patch_cases.shipped_patch("sglang-triton-smem-sm120")
EXTEND, PREFILL, MOE_CONFIG = "extend_attention.py", "prefill_attention.py", "fused_moe_triton_config.py"


def ends(versions: list[str]) -> tuple[str, ...]:
    return (versions[0], versions[-1])


# The releases the patch declares, picked per code shape (the module's docstring says why).
ATTENTION_RELEASES = tuple(
    v for r in PATCH.rewrites if r.path.endswith(PREFILL) for v in ends(patch_cases.releases(PATCH, path=r.path))
)
MOE_BUGGY, MOE_FIXED = (
    ends(patch_cases.releases(PATCH, path=MOE_CONFIG, fixed=False)),
    ends(patch_cases.releases(PATCH, path=MOE_CONFIG, fixed=True)),
)
MLA = (576, 512)  # absorbed MLA (DeepSeek, GLM-5)
EXTEND_DIMS = (MLA, (256, 256), (192, 128), (128, 128))  # (Lq, Lv)
HEAD_DIMS = (64, 80, 96, 128, 256)


def extend_path(v: str) -> str:
    return patch_cases.rewrite_of(PATCH, v, EXTEND).path


def prefill_path(v: str) -> str:
    return patch_cases.rewrite_of(PATCH, v, PREFILL).path


def moe_config_path(v: str) -> str:
    return patch_cases.rewrite_of(PATCH, v, MOE_CONFIG).path


def moe_kernels_path(v: str) -> str:
    """The kernels beside the config (not a file the patch touches)."""
    if Version(v) >= Version("0.5.16"):
        return "sglang/kernels/ops/moe/fused_moe_triton_kernels.py"
    return moe_config_path(v).replace("_config.py", "_kernels.py")


@pytest.fixture(scope="module", autouse=True)
def triton_cache(tmp_path_factory):
    """A fresh Triton cache for this run: every config is really compiled (once), and
    ~/.triton stays untouched."""
    root = tmp_path_factory.mktemp("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root / "cache"))
        mp.setenv("TRITON_HOME", str(root))
        yield


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """load(version, relpath, patched=False) -> the file's kernels and selection helpers,
    loaded once per file (set_gpu before each use: the module's globals are shared)."""
    tmp = tmp_path_factory.mktemp("kernels")

    @functools.cache
    def load(version: str, relpath: str, patched: bool = False):
        source = patch_cases.applied(PATCH, version, relpath)[1] if patched else wheel_bytes(version, relpath)
        return aot.load_kernels(source, tmp)

    return load


# --- launches, with the arguments sglang's launchers pass --------------------------------


def extend_launch(mod, lq: int, lv: int, gpu) -> aot.Launch:
    """extend_attention_fwd's _fwd_kernel launch (bf16, causal, page size 1, no mask/sinks),
    tiles from the release's _get_block_sizes_for_extend_attention for `gpu`."""
    aot.set_gpu(mod, gpu)
    dmodel, dpe, dv, block_m, block_n, num_warps = mod._get_block_sizes_for_extend_attention(lq, lv)
    num_stages = 1  # what extend_attention_fwd passes on CUDA; 0.5.20+ ask a helper (2 on gfx95 only)
    if hasattr(mod, "_get_num_stages_for_extend_attention"):
        num_stages = mod._get_num_stages_for_extend_attention(lq, lv, block_n)
    heads, kv_heads, tokens, slots = 16, (1 if (lq, lv) == MLA else 16), 4096, 65536
    t = aot.FakeTensor
    q, o = t((tokens, heads, lq)), t((tokens, heads, lv))
    k, v = t((tokens, kv_heads, lq)), t((tokens, kv_heads, lv))
    kb, vb = t((slots, kv_heads, lq)), t((slots, kv_heads, lv))
    known = dict(
        Q_Extend=q,
        K_Extend=k,
        V_Extend=v,
        O_Extend=o,
        LSE_Extend=None,
        K_Buffer=kb,
        V_Buffer=vb,
        qo_indptr=t((9,), "int32"),
        kv_indptr=t((9,), "int32"),
        kv_indices=t((slots,), "int64"),
        mask_ptr=None,
        mask_indptr=t((9,), "int64"),
        sink_ptr=None,
        window_kv_offset_ptr=None,
        sm_scale=lq**-0.5,
        k_scale=1.0,
        v_scale=1.0,
        kv_group_num=heads // kv_heads,
        stride_qbs=q.stride(0),
        stride_qh=q.stride(1),
        stride_kbs=k.stride(0),
        stride_kh=k.stride(1),
        stride_vbs=v.stride(0),
        stride_vh=v.stride(1),
        stride_obs=o.stride(0),
        stride_oh=o.stride(1),
        stride_lse_bs=0,
        stride_lse_h=0,
        stride_buf_kbs=kb.stride(0),
        stride_buf_kh=kb.stride(1),
        stride_buf_vbs=vb.stride(0),
        stride_buf_vh=vb.stride(1),
        stride_buf_kpage=kb.stride(0),
        stride_buf_ktok=kb.stride(0),
        stride_buf_vpage=vb.stride(0),
        stride_buf_vtok=vb.stride(0),
        compact_batch_size=8,
        SLIDING_WINDOW_SIZE=-1,
        logit_cap=0.0,
        xai_temperature_len=-1,
        Lq=lq,
        Lv=lv,
        BLOCK_DMODEL=dmodel,
        BLOCK_DPE=dpe,
        BLOCK_DV=dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_N_PREFIX=block_n,
        USE_CUSTOM_MASK=False,
        IS_CAUSAL=True,
        SKIP_PREFIX_CUSTOM_MASK=True,
        STORE_LSE=False,
        SKIP_PREFIX=False,
        SKIP_EXTEND=False,
        STORE_TRANSPOSE=False,
        HAS_SINK=False,
        USE_COMPACT_TILE_GRID=False,
        USE_EXP2=False,
        USE_FP8_PREFIX=False,
        USE_FP8_EXTEND=False,
        FP8_MAX=1.0,
        PAGE_SIZE=1,
    )
    kernel = mod._fwd_kernel  # parameters it lacks are left out; one we do not know fails to compile
    args = {p.name: known[p.name] for p in kernel.params if p.name in known}
    return aot.Launch(kernel, args, num_warps, num_stages)


def context_launch(mod, head_dim: int, dtype: str, gpu) -> aot.Launch:
    """What the release's (or the patched) context_attention_fwd launches (vision-tower shape)."""
    aot.set_gpu(mod, gpu)
    q = aot.FakeTensor((8 * 1024, 16, head_dim), dtype)
    lens = aot.FakeTensor((8,), "int32")
    return aot.capture_launch(mod, "_fwd_kernel", "context_attention_fwd", q, q, q, q, lens, lens, 1024)


def moe_config(mod, m: int, gpu, dtype="fp8_w8a8", block_shape=None, e=128) -> dict:
    """get_default_config for an E=128, top-8 MoE (N=1408, K=4096) with m tokens."""
    aot.set_gpu(mod, gpu)
    return mod.get_default_config(m, e, 1408, 4096, 8, dtype, False, block_shape)


def moe_launch(mod, config: dict, m: int, gpu, e=128, n=1408, k=4096, topk=8) -> aot.Launch:
    """The w13 (up) launch the release's invoke_fused_moe_kernel makes for an fp8 per-tensor
    MoE (A [m, k], B [e, 2n, k]) with `config`, captured by sm120kit.tune.kernels."""
    kernels.prepare(mod, gpu)
    return kernels.moe_launches(mod, MoeShape(e, k, n, n, topk, "fp8_w8a8"), config, m)[0]


def tiles(launch: aot.Launch) -> dict:
    """The tile constexprs of a launch, with its warps and stages (for comparisons and messages)."""
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_DMODEL", "BLOCK_DPE", "BLOCK_DV")
    keys += ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")
    picked = {k: launch.args[k] for k in keys if k in launch.args}
    return {**picked, "num_warps": launch.num_warps, "num_stages": launch.num_stages}


# --- extend attention: upstream's SM120 branch (0.5.9+), verified ------------------------


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_extend_mla_hopper_tiles_overflow_sm120(load, version):
    """The tiles sglang picks on Hopper for absorbed MLA do not fit an SM120 block: this is
    what the capability-12 branch exists for."""
    launch = extend_launch(load(version, extend_path(version)), *MLA, HOPPER)
    assert launch.shared_bytes() > LIMIT, tiles(launch)


@pytest.mark.parametrize("lq_lv", EXTEND_DIMS, ids=lambda d: f"Lq{d[0]}-Lv{d[1]}")
@pytest.mark.parametrize("version", ATTENTION_RELEASES)
def test_extend_sm120_branch_fits(load, version, lq_lv):
    launch = extend_launch(load(version, extend_path(version)), *lq_lv, SM120)
    assert launch.shared_bytes() <= LIMIT, tiles(launch)


@pytest.mark.parametrize("version", patch_cases.cases(patch_cases.releases(PATCH, path=EXTEND)))
def test_extend_sm120_selection_matches_the_compiled_releases(load, version):
    """Every release selects for (12, 0) what the compiled releases select, and on MLA that
    differs from its Hopper choice (the branch is really taken)."""
    mod = load(version, extend_path(version))
    reference = load("0.5.9", extend_path("0.5.9"))
    for lq, lv in EXTEND_DIMS:  # a release that picks other tiles must be compiled above
        assert tiles(extend_launch(mod, lq, lv, SM120)) == tiles(extend_launch(reference, lq, lv, SM120)), (lq, lv)
    assert tiles(extend_launch(mod, *MLA, SM120)) != tiles(extend_launch(mod, *MLA, HOPPER))


# --- context_attention_fwd ----------------------------------------------------------------


@pytest.mark.parametrize("version", ATTENTION_RELEASES)
def test_context_attention_unpatched_overflows_at_head_dim_256(load, version):
    launch = context_launch(load(version, prefill_path(version)), 256, "bfloat16", SM120)
    assert launch.args["BLOCK_M"] == 128
    assert launch.shared_bytes() > LIMIT, tiles(launch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("version", ATTENTION_RELEASES)
def test_context_attention_patched_fits(load, version, head_dim, dtype):
    relpath = prefill_path(version)
    patched, vendor = load(version, relpath, patched=True), load(version, relpath)
    launch = context_launch(patched, head_dim, dtype, SM120)
    assert launch.shared_bytes() <= LIMIT, tiles(launch)
    for gpu in (HOPPER, (8, 0), (10, 0)):  # other GPUs keep upstream's launch
        before, after = context_launch(vendor, head_dim, dtype, gpu), context_launch(patched, head_dim, dtype, gpu)
        assert tiles(after) == tiles(before), gpu


# --- fused-MoE fp8 per-tensor default config ----------------------------------------------


@pytest.mark.parametrize("version", MOE_BUGGY)
def test_moe_fp8_default_unpatched_overflows(load, version):
    config = moe_config(load(version, moe_config_path(version)), 512, SM120)  # M > E
    launch = moe_launch(load(version, moe_kernels_path(version)), config, 512, SM120)
    assert launch.shared_bytes() > LIMIT, tiles(launch)


@pytest.mark.parametrize("m", [512, 64], ids=["M>E", "M<=E"])
@pytest.mark.parametrize("version", MOE_BUGGY)
def test_moe_fp8_default_patched_fits(load, version, m):
    relpath = moe_config_path(version)
    patched, vendor = load(version, relpath, patched=True), load(version, relpath)
    launch = moe_launch(load(version, moe_kernels_path(version)), moe_config(patched, m, SM120), m, SM120)
    assert launch.shared_bytes() <= LIMIT, tiles(launch)
    for gpu in (HOPPER, (8, 0), (10, 0)):  # other GPUs keep upstream's config
        assert moe_config(patched, m, gpu) == moe_config(vendor, m, gpu), gpu
    for dtype, block_shape in (("fp8_w8a8", [128, 128]), ("int8_w8a8", None), (None, None)):  # so do other dtypes
        assert moe_config(patched, m, SM120, dtype, block_shape) == moe_config(vendor, m, SM120, dtype, block_shape)


@pytest.mark.parametrize("m", [512, 64], ids=["M>E", "M<=E"])
@pytest.mark.parametrize("version", MOE_FIXED)
def test_moe_fp8_default_upstream_low_smem_fits(load, version, m):
    """0.5.14+ pick low-shared-memory fp8 tiles when the opt-in limit is below 128 KiB."""
    relpath = moe_config_path(version)
    config = moe_config(load(version, relpath), m, SM120)
    assert config != moe_config(load(version, relpath), m, HOPPER)
    launch = moe_launch(load(version, moe_kernels_path(version)), config, m, SM120)
    assert launch.shared_bytes() <= LIMIT, tiles(launch)
    patch_cases.assert_fixed_upstream(PATCH, version, path=relpath)  # and the patch leaves them alone
