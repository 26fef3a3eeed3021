"""sglang-trtllm-mha-fp8-kv-sm120 on the real code of every release 0.5.9-0.5.23.

Two pieces of each release's own code are extracted with ast and run with the GPU seam
presented as SM120 (12, 0) or SM100 (10, 0): the argument-time trtllm_mha check (which
decides whether trtllm_mha may prefill on SM12x at all, and what it refuses there), and the
KV-dtype resolver that turns `--kv-cache-dtype auto` into fp8_e4m3 for a checkpoint that
declares kv_cache_quant_algo FP8 (before and after the patch)."""

from __future__ import annotations

import ast
import builtins
import sys
import textwrap
import types

import libcst as cst
import pytest
from packaging.version import Version
from support import patch_cases
from support.sites import wheel_bytes

PATCH = patch_cases.shipped_patch("sglang-trtllm-mha-fp8-kv-sm120")
BUGGY = patch_cases.releases(PATCH)  # 0.5.19 on: trtllm_mha may prefill on SM12x, and `auto` picks the checkpoint's FP8
PREFILL_REFUSED = patch_cases.uncovered(PATCH)
FP8_CHECKPOINT = types.SimpleNamespace(quant_config=types.SimpleNamespace(kv_cache_quant_algo="FP8"))
BF16_CHECKPOINT = types.SimpleNamespace(quant_config=types.SimpleNamespace(kv_cache_quant_algo=None))


class _Scope(dict):
    """Globals of extracted code: builtins, the stand-ins we name, and a placeholder for
    names the exercised path does not use."""

    def __missing__(self, name):
        return getattr(builtins, name) if hasattr(builtins, name) else type(name, (), {})


class _Logger:
    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg, *args):
        self.warnings.append(msg % args if args else msg)

    def info(self, *_):
        pass


class _Dtype:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


def fake_torch(major: int):
    names = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "bfloat16", "float16", "float4_e2m1fn_x2")
    torch = types.SimpleNamespace(**{n: _Dtype(n) for n in names}, dtype=_Dtype)
    torch.cuda = types.SimpleNamespace(get_device_capability=lambda: (major, 0), is_available=lambda: True)
    return torch


def _segment(source: bytes, node) -> str:
    return textwrap.dedent(ast.get_source_segment(source.decode(), node))


# -- the argument-time check: may trtllm_mha prefill on SM12x, and with which KV dtype --------


def _arg_check_source(version: str) -> bytes:
    if Version(version) >= Version("0.5.19"):
        return wheel_bytes(version, "sglang/srt/arg_groups/attention_hook.py")
    return wheel_bytes(version, "sglang/srt/server_args.py")


def arg_check(version: str):
    """The release's `if ... "trtllm_mha" ...:` validation block, wrapped in a function."""
    source = _arg_check_source(version)
    tree = ast.parse(source)

    def raises_trtllm_mha(node) -> bool:
        return any(
            isinstance(n, ast.Raise)
            and any(isinstance(c, ast.Constant) and "TRTLLM MHA backend" in str(c.value) for c in ast.walk(n))
            for n in ast.walk(node)
        )

    def tests_trtllm_mha(node) -> bool:
        return any(isinstance(c, ast.Constant) and c.value == "trtllm_mha" for c in ast.walk(node.test))

    [block] = [
        n
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in f.body
        if isinstance(n, ast.If) and tests_trtllm_mha(n) and raises_trtllm_mha(n)
    ]
    code = "def check(self, cfg, prefill_backend, decode_backend):\n" + textwrap.indent(_segment(source, block), "    ")

    def call(major: int, kv_cache_dtype: str) -> str:
        platform = types.SimpleNamespace(is_sm90=major == 9, is_sm100=major == 10, is_sm120=major == 12)
        scope = _Scope(
            get_platform=lambda: platform,
            is_sm90_supported=lambda: major == 9,
            is_sm100_supported=lambda: major == 10,
            is_sm120_supported=lambda: major == 12,
            envs=types.SimpleNamespace(
                SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR=types.SimpleNamespace(get=lambda: None)
            ),
            logger=_Logger(),
        )
        exec(code, scope)
        args = types.SimpleNamespace(
            attention_backend="trtllm_mha",
            prefill_attention_backend=None,
            decode_attention_backend=None,
            page_size=64,
            kv_cache_dtype=kv_cache_dtype,
            attn_cp_size=1,
            enable_prefill_context_parallel=False,
        )
        try:
            scope["check"](args, args, "trtllm_mha", "trtllm_mha")
        except ValueError as e:
            return f"refused: {e}"
        return "allowed"

    return call


@pytest.mark.parametrize("version", patch_cases.cases(PREFILL_REFUSED))
def test_before_0_5_19_trtllm_mha_cannot_prefill_on_sm12x_so_the_patch_stays_out(version):
    check = arg_check(version)
    assert check(12, "auto").startswith("refused: TRTLLM MHA backend")
    assert check(10, "auto") == "allowed"
    assert PATCH.rewrites_for(version) == []


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_upstream_refuses_explicit_fp8_on_sm12x_but_lets_auto_through(version):
    check = arg_check(version)
    assert (
        check(12, "fp8_e4m3")
        == "refused: TRTLLM FMHAv2 prefill on SM120 does not support fp8_e4m3 KV cache or skip-softmax."
    )
    assert check(12, "auto") == "allowed"  # `auto` is resolved later, from the loaded checkpoint
    assert check(12, "bf16") == "allowed"
    assert check(10, "fp8_e4m3") == "allowed"


# -- the KV-dtype resolver, before and after ----------------------------------------------


@pytest.fixture
def prefill_backend(monkeypatch):
    """The process-wide (prefill, decode) pair the patched resolver reads
    (sglang.srt.runtime_context.attention_backends)."""
    chosen = {"prefill": "trtllm_mha"}
    context = types.ModuleType("sglang.srt.runtime_context")
    context.attention_backends = lambda: (chosen["prefill"], chosen["prefill"])
    for name, module in (
        ("sglang", types.ModuleType("sglang")),
        ("sglang.srt", types.ModuleType("sglang.srt")),
        ("sglang.srt.runtime_context", context),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return chosen


def resolver(source: bytes):
    """The release's configure_kv_cache_dtype, with its module's dtype-name table."""
    tree = ast.parse(source)
    table = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "TORCH_DTYPE_TO_KV_CACHE_STR" for t in n.targets)
    )
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "configure_kv_cache_dtype")
    code = _segment(source, table) + "\n\n" + _segment(source, func)

    def call(major: int, requested: str, model=FP8_CHECKPOINT):
        torch = fake_torch(major)
        logger = _Logger()
        scope = _Scope(
            torch=torch,
            nn=types.SimpleNamespace(Module=type("Module", (), {})),
            fp8_dtype=torch.float8_e4m3fn,
            _is_hip=False,
            logger=logger,
        )
        exec(code, scope)
        resolved, dtype = scope["configure_kv_cache_dtype"](
            server_args_kv_cache_dtype=requested,
            model=model,
            model_dtype=torch.bfloat16,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend=None,
        )
        return resolved, dtype.name, logger.warnings

    return call


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_auto_fp8_checkpoint_on_sm12x_trtllm_mha_keeps_model_dtype(version, prefill_backend):
    before, after = patch_cases.applied(PATCH, version)
    old, new = resolver(before), resolver(after)

    # Upstream: the checkpoint's FP8 wins on SM12x too, and FMHAv2 prefill then raises.
    assert old(12, "auto")[:2] == ("fp8_e4m3", "float8_e4m3fn")
    # Patched: the model dtype, as `auto` gives a checkpoint without FP8 KV, with a warning.
    resolved, dtype, warnings = new(12, "auto")
    assert (resolved, dtype) == (None, "bfloat16")
    [warning] = warnings
    assert "no FP8 (e4m3) kernel on SM12x" in warning and "torch.bfloat16 KV cache" in warning
    assert "--kv-cache-dtype bf16" in warning and "--attention-backend flashinfer" in warning

    # SM100 keeps upstream's FP8 KV cache (trtllm-gen prefills e4m3 there).
    assert new(10, "auto") == old(10, "auto") == ("fp8_e4m3", "float8_e4m3fn", [])
    # Explicit choices and checkpoints without FP8 KV are untouched.
    for major in (10, 12):
        assert new(major, "fp8_e4m3") == old(major, "fp8_e4m3") == (None, "float8_e4m3fn", [])
        assert new(major, "bf16") == old(major, "bf16") == (None, "bfloat16", [])
        assert new(major, "auto", BF16_CHECKPOINT) == old(major, "auto", BF16_CHECKPOINT) == (None, "bfloat16", [])


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_the_release_has_the_backend_pair_the_patch_reads(version):
    """`sglang.srt.runtime_context.attention_backends()` exists, takes nothing and returns
    attention_backends_of(...), the (prefill, decode) pair the argument check tested."""
    tree = ast.parse(wheel_bytes(version, "sglang/srt/runtime_context.py"))
    [func] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "attention_backends"]
    assert not func.args.args and not func.args.kwonlyargs
    [returned] = [n.value for n in ast.walk(func) if isinstance(n, ast.Return)]
    assert isinstance(returned, ast.Call) and returned.func.id == "attention_backends_of"


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "fa4"])
def test_other_prefill_backends_keep_the_fp8_kv_cache_on_sm12x(version, backend, prefill_backend):
    prefill_backend["prefill"] = backend
    before, after = patch_cases.applied(PATCH, version)
    assert resolver(after)(12, "auto") == resolver(before)(12, "auto") == ("fp8_e4m3", "float8_e4m3fn", [])


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_second_pass_is_a_no_op_and_the_diff_is_the_branch(version):
    before, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)
    added = [line for line in after.decode().splitlines() if line not in before.decode().splitlines()]
    assert "# sm120kit: sglang-trtllm-mha-fp8-kv-sm120 r1" in added[0]
    assert added[1].strip() == "from sglang.srt.runtime_context import attention_backends"
    assert not [line for line in before.decode().splitlines() if line not in after.decode().splitlines()]
    cst.parse_module(after)
    compile(after, "kv_cache_dtype.py", "exec")


def test_an_upstream_backend_check_is_fixed_upstream():
    """Were the resolver to weigh trtllm_mha itself (as a fix of #39807 would), the patch steps aside."""
    before = patch_cases.release_file(PATCH, "0.5.23")
    edited = before.replace(
        b'and kv_cache_quant_algo.upper() == "FP8"',
        b'and kv_cache_quant_algo.upper() == "FP8"\n            and prefill_attention_backend != "trtllm_mha"',
    )
    assert edited != before
    finding = patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)
    assert "trtllm_mha" in finding.detail


@pytest.mark.parametrize(
    "mutation, reshaped",
    [
        pytest.param(b"def configure_kv_cache_dtype(", b"def resolve_kv_cache_dtype(", id="resolver renamed"),
        pytest.param(
            b'kv_cache_quant_algo.upper() == "FP8"', b'kv_cache_quant_algo in ("FP8", "fp8")', id="FP8 test reshaped"
        ),
        pytest.param(
            b"resolved_kv_cache_dtype = TORCH_DTYPE_TO_KV_CACHE_STR[kv_cache_dtype]",
            b"pass",
            id="branch no longer records the resolved dtype",
        ),
    ],
)
def test_unknown_shape_is_anchor_missing(mutation, reshaped):
    before = patch_cases.release_file(PATCH, "0.5.23")
    edited = before.replace(mutation, reshaped, 1)
    assert edited != before
    patch_cases.assert_anchor_missing(PATCH, "0.5.23", edited)
