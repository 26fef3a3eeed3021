"""The static flag schema (sm120kit/profiles/flags.py), read from the real sglang wheels of
every release in the window.

The expectations below were checked against the code of each release and against argparse
itself: the counts are what `ServerArgs.add_cli_args` registers when server_args.py is imported
with everything outside the CLI machinery stubbed out.
"""

from __future__ import annotations

import functools

import pytest
from packaging.version import Version
from support.sites import WINDOW, wheel_bytes

from sm120kit import wheels
from sm120kit.profiles import flags
from sm120kit.profiles.flags import FlagSchema, read_schema, schema_from_sources
from sm120kit.target import Target

# release: (flags, spellings). Spellings count aliases and the --no-x form that argparse adds
# for BooleanOptionalAction.
COUNTS = {
    "0.5.9": (331, 341),
    "0.5.10": (354, 365),
    "0.5.10.post1": (354, 365),
    "0.5.11": (374, 387),
    "0.5.12": (387, 402),
    "0.5.12.post1": (387, 402),
    "0.5.13": (406, 419),
    "0.5.13.post1": (406, 419),
    "0.5.14": (420, 433),
    "0.5.15": (437, 451),
    "0.5.15.post1": (437, 451),
    "0.5.16": (460, 476),
    "0.5.17": (474, 491),
    "0.5.18": (488, 506),
    "0.5.19": (503, 521),
    "0.5.20": (494, 513),
    "0.5.21": (512, 532),
    "0.5.22": (521, 544),
    "0.5.23": (531, 559),
}


def read_wheel(version: str):
    def read(relpath: str) -> bytes | None:
        try:
            return wheel_bytes(version, relpath)
        except KeyError:
            return None

    return read


@functools.cache
def schema(version: str) -> FlagSchema:
    return schema_from_sources(version, read_wheel(version))


def between(version: str, first: str | None = None, first_without: str | None = None) -> bool:
    """first <= version < first_without."""
    v = Version(version)
    return (first is None or v >= Version(first)) and (first_without is None or v < Version(first_without))


def test_window_is_covered():
    assert set(COUNTS) == set(WINDOW)


@pytest.mark.parametrize("version", WINDOW)
def test_flag_count(version):
    s = schema(version)
    spellings = [x for f in s.flags for x in (f.name, *f.aliases)]
    assert 300 <= len(s.flags) <= 700
    assert len(spellings) == len(set(spellings)), "a spelling belongs to two flags"
    assert all(x.startswith("--") for x in spellings)
    assert (len(s.flags), len(spellings)) == COUNTS[version]
    assert s.version == version


@pytest.mark.parametrize("version", WINDOW)
def test_flags_we_rely_on(version):
    s = schema(version)

    def choices(name: str) -> set[str]:
        flag = s.get(name)
        assert flag is not None and flag.takes_value and flag.choices is not None, name
        return set(flag.choices)

    assert {"auto", "triton", "flashinfer_cutlass", "flashinfer_trtllm", "cutlass"} <= choices("--moe-runner-backend")
    for name in ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
        assert {"flashinfer", "triton", "fa3", "trtllm_mla", "nsa"} <= choices(name)
        assert ("cutlass_mla" in choices(name)) == between(version, first_without="0.5.20")
        assert ("dsa" in choices(name)) == between(version, "0.5.13")
    kv = choices("--kv-cache-dtype")
    assert {"auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"} <= kv
    assert ("fp4_e2m1" in kv) == between(version, first_without="0.5.21")
    assert ({"nvfp4", "mxfp8"} <= kv) == between(version, "0.5.16")
    assert {"modelopt_fp4", "fp8"} <= choices("--quantization")
    assert {"auto", "flashinfer_cutlass", "flashinfer_cudnn", "flashinfer_trtllm"} <= choices("--fp4-gemm-backend")

    tp = s.get("--tp-size")
    assert tp is not None and tp is s.get("--tensor-parallel-size") and tp.takes_value and tp.type == "int"
    # argparse's first spelling: the old add_argument call lists --tensor-parallel-size first
    assert tp.name == ("--tp-size" if between(version, "0.5.14") else "--tensor-parallel-size")
    assert s.get("--tp-size=8") is tp
    for name, type_ in [
        ("--max-running-requests", "int"),
        ("--mem-fraction-static", "float"),
        ("--chunked-prefill-size", "int"),
        ("--host", "str"),
        ("--port", "int"),
        ("--api-key", "str"),
        ("--model-path", "str"),
        ("--served-model-name", "str"),
        ("--nnodes", "int"),
        ("--node-rank", "int"),
        ("--dist-init-addr", "str"),
        ("--pp-size", "int"),
    ]:
        flag = s.get(name)
        assert flag is not None and flag.takes_value and flag.type == type_ and not flag.deprecated, name
    assert s.get("--model") is s.get("--model-path")
    assert s.get("--nccl-init-addr") is s.get("--dist-init-addr")
    assert s.get("--pipeline-parallel-size") is s.get("--pp-size")
    for name in (
        "--disable-radix-cache",
        "--trust-remote-code",
        "--disable-flashinfer-autotune",
        "--disable-shared-experts-fusion",
    ):
        flag = s.get(name)
        assert flag is not None and not flag.takes_value and flag.type == "bool" and not flag.deprecated, name
    assert s.get("--no-such-flag") is None


@pytest.mark.parametrize("version", WINDOW)
def test_release_brackets(version):
    s = schema(version)

    def check(name: str, present: bool, deprecated: bool = False, replacement: str | None = None):
        flag = s.get(name)
        assert (flag is not None) == present, f"{name} in {version}"
        if flag is not None:
            assert (flag.deprecated, flag.replacement) == (deprecated, replacement), f"{name} in {version}"

    # NSA -> DSA rename: deprecated aliases 0.5.13 - 0.5.19, gone in 0.5.20
    for phase in ("prefill", "decode"):
        check(
            f"--nsa-{phase}-backend",
            between(version, first_without="0.5.20"),
            between(version, "0.5.13"),
            f"--dsa-{phase}-backend" if between(version, "0.5.13") else None,
        )
        check(f"--dsa-{phase}-backend", between(version, "0.5.13"))
        if between(version, "0.5.13"):
            assert {"flashmla_sparse", "flashmla_kv", "fa3", "tilelang", "trtllm"} <= set(
                s.get(f"--dsa-{phase}-backend").choices
            )
    if between(version, first_without="0.5.20"):
        assert s.get("--nsa-prefill-backend").choices == s.get("--nsa-decode-backend").choices
    # CUDA graph flags split per phase in 0.5.14; the old ones are deprecated, --cuda-graph-max-bs then goes
    new = between(version, "0.5.14")
    check("--disable-cuda-graph", True, new, "--cuda-graph-backend-{decode,prefill}=disabled" if new else None)
    assert not s.get("--disable-cuda-graph").takes_value
    check(
        "--cuda-graph-max-bs",
        between(version, first_without="0.5.20"),
        new,
        "--cuda-graph-max-bs-decode" if new else None,
    )
    for name in ("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--cuda-graph-backend-decode"):
        check(name, new)
    if new:
        assert s.get("--cuda-graph-max-bs-decode").type == "int"
        assert {"full", "breakable", "disabled"} <= set(s.get("--cuda-graph-backend-decode").choices)
    # the store_true flag stays; from 0.5.14 its help says "(Deprecated: use ...)"
    check(
        "--enable-flashinfer-allreduce-fusion", True, new, "--flashinfer-allreduce-fusion-backend=auto" if new else None
    )
    check("--flashinfer-allreduce-fusion-backend", new)
    if new:
        assert {"auto", "trtllm", "mnnvl"} <= set(s.get("--flashinfer-allreduce-fusion-backend").choices)


def test_choices_match_the_reference_lists():
    """The full lists of the reference (§4.2) for the first and the last release."""
    old, new = schema("0.5.9"), schema("0.5.23")
    assert old.get("--moe-runner-backend").choices == (
        "auto",
        "deep_gemm",
        "triton",
        "triton_kernel",
        "flashinfer_trtllm",
        "flashinfer_cutlass",
        "flashinfer_mxfp4",
        "flashinfer_cutedsl",
        "cutlass",
    )
    assert old.get("--kv-cache-dtype").choices == ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")
    assert old.get("--fp4-gemm-backend").choices == (
        "auto",
        "flashinfer_cudnn",
        "flashinfer_cutlass",
        "flashinfer_trtllm",
    )
    assert old.get("--nsa-prefill-backend").choices == (
        "flashmla_sparse",
        "flashmla_kv",
        "flashmla_auto",
        "fa3",
        "tilelang",
        "aiter",
        "trtllm",
    )
    assert new.get("--kv-cache-dtype").choices == (
        "auto",
        "fp8_e5m2",
        "fp8_e4m3",
        "mxfp8",
        "bf16",
        "bfloat16",
        "nvfp4",
        "fp4_mx_block16",
    )
    assert new.get("--dsa-prefill-backend").choices == (
        "flashmla_sparse",
        "flashmla_sparse_q8",
        "flashmla_kv",
        "flashmla_auto",
        "flashinfer_sparse_mla",
        "triton_sparse_mla",
        "fa3",
        "tilelang",
        "triton",
        "aiter",
        "trtllm",
        "intel_xpu",
    )
    assert set(new.get("--dsa-decode-backend").choices) == set(new.get("--dsa-prefill-backend").choices) - {
        "triton_sparse_mla"
    }
    assert set(new.get("--fp4-gemm-backend").choices) == {
        "auto",
        "flashinfer_cudnn",
        "flashinfer_cutedsl",
        "flashinfer_cutlass",
        "flashinfer_trtllm",
        "marlin",
    }
    assert len(new.get("--moe-runner-backend").choices) == 22
    assert len(new.get("--attention-backend").choices) == 25
    # Backend.ALL, a class attribute in another module, lost tc_piecewise by 0.5.23
    assert "tc_piecewise" in schema("0.5.14").get("--cuda-graph-backend-decode").choices
    assert new.get("--cuda-graph-backend-decode").choices == ("full", "breakable", "disabled")


def test_deprecations_the_code_spells_out():
    """Deprecated*Action classes (whose own nargs default decides whether a value follows),
    and deprecation said only in the help text."""
    old, new = schema("0.5.9"), schema("0.5.23")
    # DeprecatedAction, help "Note: ... is deprecated now. Please use --swa-full-tokens-ratio instead."
    assert old.get("--hybrid-kvcache-ratio") == flags.Flag(
        "--hybrid-kvcache-ratio", takes_value=False, type="bool", deprecated=True, replacement="--swa-full-tokens-ratio"
    )
    assert (
        old.get("--prefill-round-robin-balance").deprecated
        and old.get("--prefill-round-robin-balance").replacement is None
    )
    # DeprecatedStoreConstAction with nargs=None and choices: the old valued form
    assert new.get("--monokernel-backend") == flags.Flag(
        "--monokernel-backend",
        takes_value=True,
        type="str",
        choices=("amd",),
        deprecated=True,
        replacement="--enable-amd-monokernel",
    )
    assert not new.get("--enable-dp-attention").takes_value and new.get("--enable-dp-attention").deprecated
    # an annotated field whose help starts "(Deprecated, use --smg-grpc-mode)"
    assert new.get("--grpc-mode").deprecated and new.get("--grpc-mode").replacement == "--smg-grpc-mode"
    assert schema("0.5.19").get("--elastic-ep-rejoin").replacement == "--elastic-ep-join-mode recover"
    assert not new.get("--smg-grpc-mode").deprecated


def test_run_time_choices_stay_unknown():
    """A list that depends on the machine or on plugins is not guessed: nothing valid is refused."""
    assert schema("0.5.9").get("--sampling-backend").choices == ("flashinfer", "pytorch", "ascend")
    # 0.5.13 adds "token_oracle" to the set at import time when an env var says so
    assert schema("0.5.13").get("--sampling-backend").choices is None
    assert schema("0.5.23").get("--reasoning-parser").choices is None
    # BooleanOptionalAction: argparse accepts --no-x too
    flag = schema("0.5.23").get("--no-enable-tf32-matmul")
    assert flag is not None and flag.name == "--enable-tf32-matmul" and not flag.takes_value


def test_nearest():
    s = schema("0.5.23")
    assert s.nearest("--moe-runner-backed") == "--moe-runner-backend"
    assert schema("0.5.9").nearest("--moe-runner-backed") == "--moe-runner-backend"
    assert s.nearest("--zzzzzzzzzzzzzzzzzzzzz") is None


def test_disk_cache_returns_an_equal_schema(monkeypatch):
    version = "0.5.23"
    fresh = schema_from_sources(version, read_wheel(version))

    def no_parsing(*args):
        raise AssertionError("parsed again although the cache holds this release")

    monkeypatch.setattr(flags, "_parse", no_parsing)
    cached = schema_from_sources(version, read_wheel(version))
    assert cached == fresh and cached is not fresh
    assert cached.get("--tp-size") == fresh.get("--tp-size")


def test_disk_cache_follows_every_file_read():
    """The entry is keyed by server_args.py; a change in another file read must still show."""
    version = "0.5.23"
    schema_from_sources(version, read_wheel(version))  # cached
    choices = "sglang/srt/arg_groups/choices.py"
    edited = wheel_bytes(version, choices).replace(b'"flashinfer_cutlass",', b'"flashinfer_cutlass", "sm120_test",', 1)
    assert edited != wheel_bytes(version, choices)
    read = read_wheel(version)
    changed = schema_from_sources(version, lambda p: edited if p == choices else read(p))
    assert "sm120_test" in changed.get("--moe-runner-backend").choices
    assert "sm120_test" not in schema_from_sources(version, read).get("--moe-runner-backend").choices


def test_read_schema_from_an_installed_release(site):
    """read_schema finds the files through the Distribution, as the CLI does."""
    version = "0.5.14"
    members = [
        "sglang/srt/server_args.py",
        "sglang/srt/arg_groups/*",
        "sglang/srt/utils/common.py",
        "sglang/srt/model_executor/cuda_graph_config.py",
    ]
    wheels.install(site, "sglang", version, members)
    dist = Target("test", [site]).find("sglang")
    assert dist is not None and dist.version == version
    assert read_schema(dist) == schema(version)


def test_missing_server_args_is_an_error():
    with pytest.raises(FileNotFoundError):
        schema_from_sources("0.0.0", lambda relpath: None)
