"""tune-moe's candidates: sglang's tuning space, and the sm_120 filter on the real fused-MoE
kernels of two releases, one per kernel location (0.5.12.post1: moe_runner/triton_utils/,
0.5.23: kernels/ops/moe/), compiled for sm_120 on the CPU.

The shape is Kimi K2's at TP8 (384 experts, hidden 7168, intermediate 2048 / 8 = 256, top-8)
with block-wise fp8 [128, 128]. A slice of the space keeps this to a few dozen compiles.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
import zipfile

import pytest
from support.sites import WINDOW, wheel_bytes

from sm120kit import wheels
from sm120kit.errors import UserError
from sm120kit.tune import aot, fit, fit_workers, kernels, space
from sm120kit.tune.shape import MoeShape

RELEASES = ("0.5.12.post1", "0.5.23")
KIMI_FP8 = MoeShape(384, 7168, 256, 256, 8, "fp8_w8a8", (128, 128), model="Kimi-K2 TP8 (fp8 block)")
KIMI_INT4 = MoeShape(384, 7168, 256, 128, 8, "int4_w4a16", (0, 32), model="Kimi-K2 TP8 (int4 group 32)")
# 16 configs, 8 distinct (GROUP_SIZE_M does not change the shared memory): 16 compiles.
SLICE = [
    dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=128, GROUP_SIZE_M=g, num_warps=8, num_stages=s)
    for m, n, s, g in itertools.product((16, 128), (32, 256), (2, 4), (1, 64))
]
SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=2)
LARGE = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=4)
SMALL_BYTES = 6144  # one 16x128 fp8 A tile and one 128x32 fp8 B tile (2 stages: one buffered)
LARGE_BYTES = 148480  # 3 buffered stages of 128x128 + 128x256 fp8 tiles (147456), plus the block scales
# Of SLICE's 8 (M, N, stages), all but two fit 101376 B in both releases: LARGE, and the
# one that rules it out uncompiled (a launch of a config inside it is already over the limit).
INSIDE_LARGE = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=4)
INSIDE_LARGE_BYTES = 105472
SLICE_FITTING = 2 * 6


@functools.cache
def kernel_source(version: str) -> bytes:
    """The release's fused-MoE kernel file, wherever that release keeps it."""
    with zipfile.ZipFile(wheels.fetch("sglang", version)) as zf:
        [relpath] = [path for path in kernels.KERNEL_FILES if path in zf.namelist()]
    return wheel_bytes(version, relpath)


@pytest.fixture(scope="module", autouse=True)
def triton_cache(tmp_path_factory):
    """In-process compiles get a fresh Triton cache (~/.triton stays untouched); fit's
    workers keep their own in a scratch directory."""
    root = tmp_path_factory.mktemp("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root / "cache"))
        mp.setenv("TRITON_HOME", str(root))
        yield


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """fit_configs(SLICE) per release, once pruned (cold) and once exhaustive (on the cache the
    first filled: only what it ruled out is compiled), with their progress calls and cache.
    The pruned run has one worker: what pruning skips depends on which results are in when
    a unit is handed out, so only one worker makes it the same on every machine (two
    workers may both start a config's launches before either is over the limit)."""

    @functools.cache
    def run(version: str):
        cache = tmp_path_factory.mktemp(f"smem-{version}")
        runs = []
        for prune, jobs in ((True, 1), (False, 2)):
            calls = []
            results = fit.fit_configs(
                kernel_source(version),
                KIMI_FP8,
                SLICE,
                prune=prune,
                jobs=jobs,
                cache_dir=cache,
                progress=lambda *a, calls=calls: calls.append(a),
            )
            runs.append((results, calls))
        return runs, cache

    return run


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels")
    return functools.cache(lambda version: kernels.load(kernel_source(version), tmp))


# --- the search space ----------------------------------------------------------------------


def test_space_is_sglangs_1920_configs_in_its_json_key_order():
    configs = space.full_space()
    assert len(configs) == 1920 == len({tuple(c.items()) for c in configs})
    assert all(tuple(c) == space.CONFIG_KEYS for c in configs)
    assert {k: sorted({c[k] for c in configs}) for k in space.CONFIG_KEYS} == {
        k: sorted(v) for k, v in space.SPACE.items()
    }
    assert configs[0] == dict(
        BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2
    )


def test_space_block_quant_keeps_block_k_that_divide_the_quant_block():
    configs = space.search_space(KIMI_FP8)
    assert len(configs) == 1280
    assert {c["BLOCK_SIZE_K"] for c in configs} == {64, 128}  # 128 % 256 != 0
    assert {c["BLOCK_SIZE_N"] for c in configs} == {32, 64, 128, 256}  # N is not filtered
    assert len(space.search_space(MoeShape(384, 7168, 256, 256, 8, "fp8_w8a8", (128, 64)))) == 640
    assert len(space.search_space(MoeShape(384, 7168, 256, 256, 8, None))) == 1920
    assert len(space.search_space(MoeShape(384, 7168, 256, 256, 8, "fp8_w8a8"))) == 1920  # per-tensor
    assert len(space.search_space(KIMI_INT4)) == 1920  # [0, 32]: the GPTQ/AWQ kernel takes any BLOCK_SIZE_K


# --- where each release keeps the kernel ---------------------------------------------------


@pytest.mark.parametrize("version", WINDOW)
def test_kernel_file_found_in_every_release(tmp_path, version):
    wheels.install(tmp_path, "sglang", version, kernels.KERNEL_FILES)
    found = kernels.find_kernel_file(tmp_path)
    assert kernels.defines_fused_moe_kernel(found.read_bytes())
    assert found.relative_to(tmp_path).as_posix() in kernels.KERNEL_FILES


def test_no_kernel_file_is_a_user_error(tmp_path):
    (tmp_path / "sglang").mkdir()
    with pytest.raises(UserError, match="fused_moe_kernel"):
        kernels.find_kernel_file(tmp_path)


# --- the launches, captured from the release's own invoke_fused_moe_kernel ----------------


@pytest.mark.parametrize("version", RELEASES)
def test_launches_are_the_up_and_down_gemm(module, version):
    up, down = kernels.moe_launches(module(version), KIMI_FP8, SMALL, 64)
    assert up.kernel.__name__ == down.kernel.__name__ == "fused_moe_kernel"
    assert (up.args["N"], up.args["K"], down.args["N"], down.args["K"]) == (512, 7168, 7168, 256)
    assert up.args["a_ptr"].dtype.name == "float8_e4m3fn"  # quantised by the launcher itself
    assert (up.args["group_n"], up.args["group_k"]) == (128, 128)
    assert up.args["b_scale_ptr"].shape == (384, 4, 56)
    assert (up.args["MUL_ROUTED_WEIGHT"], down.args["MUL_ROUTED_WEIGHT"]) == (False, True)
    assert (up.args["top_k"], down.args["top_k"]) == (8, 1)
    assert (up.num_warps, up.num_stages) == (8, 2)
    pdl = "USE_GDC" in up.args  # 0.5.19+ launch with programmatic dependent launch on sm_90+
    assert pdl == (version == "0.5.23")
    assert up.options == ({"launch_pdl": True} if pdl else {})


@pytest.mark.parametrize("version", RELEASES)
def test_int4_launches_the_gptq_awq_kernel_on_packed_weights(module, version):
    up, down = kernels.moe_launches(module(version), KIMI_INT4, SMALL, 64)
    assert up.kernel.__name__ == down.kernel.__name__ == "fused_moe_kernel_gptq_awq"
    assert up.args["b_ptr"].shape == (384, 512, 3584) and up.args["b_ptr"].dtype.name == "uint8"
    assert down.args["b_ptr"].shape == (384, 7168, 128)
    assert up.args["group_size"] == 32 and up.args["use_int4_w4a16"] and not up.args["has_zp"]
    assert up.args["K"] == 7168  # A's K, unpacked


def test_a_down_table_drives_the_down_gemm_only(module):
    [down] = kernels.moe_launches(module("0.5.23"), KIMI_FP8, SMALL, 64, gemms=("w2",))
    assert down.args["MUL_ROUTED_WEIGHT"] and down.args["K"] == 256


def test_even_ks_splits_the_families_pruning_compares(module):
    """The GPTQ/AWQ kernel's down GEMM of Kimi K2 int4 (K = 256, 128 bytes packed) needs less
    at BLOCK_SIZE_K 256 than at 128: there sglang's even_Ks (from the packed K) turns false
    and B's loads are masked. Pruning compares only launches of one family, and even_Ks
    is part of it."""
    mod = module("0.5.23")
    families = [
        [
            launch.compile_keys(120, fit.TILE)[1]
            for launch in kernels.moe_launches(mod, KIMI_INT4, {**SMALL, "BLOCK_SIZE_K": k}, 64)
        ]
        for k in (128, 256)
    ]
    assert [
        launch.args["even_Ks"] for launch in kernels.moe_launches(mod, KIMI_INT4, {**SMALL, "BLOCK_SIZE_K": 256}, 64)
    ] == [True, False]
    assert families[0][0] == families[1][0] and families[0][1] != families[1][1]


def test_unknown_dtype_is_a_user_error(module):
    with pytest.raises(UserError, match="mxfp4"):
        kernels.moe_launches(module("0.5.23"), MoeShape(8, 64, 32, 32, 2, "mxfp4"), SMALL, 1)
    with pytest.raises(UserError, match="group_size"):
        kernels.moe_launches(module("0.5.23"), MoeShape(8, 64, 32, 32, 2, "int4_w4a16"), SMALL, 1)


# --- the sm_120 filter --------------------------------------------------------------------


def point(config: dict) -> tuple[int, int, int, int]:
    return config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["num_stages"]


def _find(results, config):
    [found] = [r for r in results if r.config == config]
    return found


@pytest.mark.parametrize("version", RELEASES)
def test_slice_fit_count_and_known_configs(sliced, version):
    [(pruned, _), (exhaustive, _)], _ = sliced(version)
    for results in (pruned, exhaustive):
        assert [r.config for r in results] == SLICE
        small = _find(results, SMALL)
        assert small.fits and small.shared == SMALL_BYTES and small.launches == (SMALL_BYTES, SMALL_BYTES)
        assert INSIDE_LARGE_BYTES in _find(results, INSIDE_LARGE).launches
        assert sum(r.fits for r in results) == SLICE_FITTING and not any(r.error for r in results)
    assert _find(exhaustive, INSIDE_LARGE).shared == INSIDE_LARGE_BYTES
    large = _find(exhaustive, LARGE)
    assert not large.fits and large.shared == LARGE_BYTES and large.launches == (LARGE_BYTES, LARGE_BYTES)
    assert all(r.fits == (r.shared <= aot.SM120_SMEM_OPTIN) for r in exhaustive)


@pytest.mark.parametrize("version", RELEASES)
def test_pruning_rules_out_what_contains_a_config_over_the_limit(sliced, version):
    [(pruned, calls), (exhaustive, again)], _ = sliced(version)
    large = _find(pruned, LARGE)
    assert not large.fits and large.shared is None and large.at_least == INSIDE_LARGE_BYTES
    assert large.launches == (None, None) and large.error is None
    # The first of INSIDE_LARGE's launches to compile is over the limit: the other is not compiled.
    inside = _find(pruned, INSIDE_LARGE)
    assert not inside.fits and inside.shared is None and inside.at_least == INSIDE_LARGE_BYTES
    assert set(inside.launches) == {INSIDE_LARGE_BYTES, None} and inside.error is None
    assert [r.fits for r in pruned] == [r.fits for r in exhaustive]
    assert {point(r.config) for r in pruned if r.shared is None} == {point(LARGE), point(INSIDE_LARGE)}
    distinct = len({point(c) for c in SLICE})
    assert calls[0] == (0, 2 * distinct) and calls[-1] == (2 * distinct, 2 * distinct)
    assert again[0] == (2 * distinct - 3, 2 * distinct)  # the exhaustive rerun compiles the three ruled out


@pytest.mark.parametrize("version", RELEASES)
def test_fit_agrees_with_an_in_process_compile_for_any_group_size_and_tokens(sliced, module, version):
    """The workers' figures (LLVM's optimiser off) are what a plain compile of the captured
    launch gives here; and what fit_configs relies on to compile once per (M, N, K, warps,
    stages): GROUP_SIZE_M only reorders program ids, and tokens only reach integer arguments
    (and, in 0.5.23, GDC_EARLY = tokens <= 512), none of which changes the shared memory."""
    [_, (exhaustive, _)], _ = sliced(version)
    mod = module(version)
    for config in (SMALL, INSIDE_LARGE):
        expected = _find(exhaustive, config).launches
        for group, tokens in ((1, fit.FIT_TOKENS), (64, fit.FIT_TOKENS), (1, 1)):
            launches = kernels.moe_launches(mod, KIMI_FP8, {**config, "GROUP_SIZE_M": group}, tokens)
            assert tuple(launch.shared_bytes() for launch in launches) == expected, (config, group, tokens)


@pytest.mark.parametrize("version", RELEASES)
def test_shared_memory_grows_with_every_tile_dimension_and_stage(sliced, version):
    """The monotone rule pruning relies on, on the slice (the whole space of the Kimi-K2
    shape was checked in bf16, block fp8 and int4 when it was introduced): within a family,
    no step up in M, N, K or stages lowers a launch's bytes."""
    [_, (exhaustive, _)], _ = sliced(version)
    bytes_at = {point(r.config): r.launches for r in exhaustive}
    steps = 0
    for here, launches in bytes_at.items():
        for axis in range(4):
            bigger = [
                p for p in bytes_at if p[axis] > here[axis] and all(p[i] == here[i] for i in range(4) if i != axis)
            ]
            for other in bigger:
                steps += 1
                assert all(a <= b for a, b in zip(launches, bytes_at[other])), (here, other)
    assert steps == 12


@pytest.mark.parametrize("version", RELEASES)
def test_a_second_run_is_served_from_the_cache(sliced, monkeypatch, version):
    [_, (exhaustive, _)], cache = sliced(version)

    def no_compiler(*args, **kwargs):
        raise AssertionError("a cached config was compiled again")

    monkeypatch.setattr(fit_workers, "CompileWorker", no_compiler)
    calls = []
    assert (
        fit.fit_configs(kernel_source(version), KIMI_FP8, SLICE, cache_dir=cache, progress=lambda *a: calls.append(a))
        == exhaustive
    )
    assert calls == [(16, 16)]


def test_a_config_the_compiler_rejects_does_not_fit(tmp_path):
    """fp8 tl.dot needs K >= 32 per tile: BLOCK_SIZE_K 16 (outside the space) fails to compile."""
    config = {**SMALL, "BLOCK_SIZE_K": 16}
    shape = MoeShape(384, 7168, 256, 256, 8, "fp8_w8a8")
    [result] = fit.fit_configs(kernel_source("0.5.23"), shape, [config], jobs=1, cache_dir=tmp_path)
    assert not result.fits and result.shared is None and result.launches == (None, None)
    assert result.error.startswith("CompilationError: ") and "K >= 32" in result.error


def test_configs_with_keys_the_launcher_does_not_take_are_user_errors(module):
    with pytest.raises(UserError, match="TMA"):
        kernels.moe_launches(module("0.5.23"), KIMI_FP8, {**SMALL, "USE_TMA": True}, 1)
    with pytest.raises(UserError, match="unknown waves_per_eu"):
        kernels.moe_launches(module("0.5.23"), KIMI_FP8, {**SMALL, "waves_per_eu": 0}, 1)
    assert kernels.moe_launches(module("0.5.23"), KIMI_FP8, {**SMALL, "USE_TMA": False}, 1)  # what sglang pops


def test_workers_that_keep_dying_stop_the_sweep_with_their_last_words(tmp_path, monkeypatch):
    def garbage(self, message):  # each worker fails on its first line, with a traceback
        try:
            self.proc.stdin.write("not json\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    monkeypatch.setattr(fit_workers.CompileWorker, "send", garbage)
    with pytest.raises(RuntimeError, match=r"keep dying(.|\n)*JSONDecodeError"):
        fit.fit_configs(kernel_source("0.5.23"), KIMI_FP8, [SMALL, INSIDE_LARGE], jobs=1, cache_dir=tmp_path)
    assert not list(tmp_path.rglob("*.json"))  # nothing learned, nothing cached


def test_importing_fit_does_not_import_triton():
    code = "import sys, sm120kit.tune.fit, sm120kit.tune.space; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
