"""sglang-dsa-kpool-sm120 on the real code of every release that has the k-pool DSA mixin
(0.5.20-0.5.23): the mixin's tail resolver and its check, extracted from the (patched) file,
are run for a k-pool model (index_kpool 4, GLM-5.3-Flash) and a plain one (1, GLM-5/5.1)
with the GPU presented as SM120, SM100, SM110 and SM90."""

from __future__ import annotations

import ast
import builtins
import itertools
import textwrap
import types

import pytest
from support import patch_cases
from support.sites import wheel_bytes

PATCH = patch_cases.shipped_patch("sglang-dsa-kpool-sm120")
KPOOL_FILE = "sglang/srt/layers/attention/dsa/dsa_backend_kpool.py"
BACKEND_FILE = "sglang/srt/layers/attention/dsa_backend.py"
RELEASES = patch_cases.releases(PATCH)  # 0.5.20 on: the releases with the k-pool mixin
EARLIER = patch_cases.uncovered(PATCH)
SM120, SM100, SM110, SM90 = 12, 10, 11, 9
TOPK = object()  # the indexer's top-k indices: only `is None` is asked of them


class _Scope(dict):
    """Globals of the extracted methods: builtins, and a placeholder for annotations."""

    def __missing__(self, name):
        return getattr(builtins, name) if hasattr(builtins, name) else type(name, (), {})


def mixin(source: bytes, major: int, index_kpool: int = 4):
    """(resolve, check) of the file's DeepseekSparseAttnBackendKPoolMixin, bound to a backend
    on a GPU of capability `major` serving a model with this index_kpool (bf16 KV pool)."""
    text = source.decode()
    scope = _Scope()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name in (
            "_resolve_kpool_tail_backend",
            "_check_kpool_tail_backend",
        ):
            exec(textwrap.dedent(ast.get_source_segment(text, node)), scope)
    backend = types.SimpleNamespace(device_sm_major=major, dsa_index_kpool=index_kpool, dsa_kv_cache_store_fp8=False)

    def resolve(dsa_impl, topk_indices=TOPK):
        return scope["_resolve_kpool_tail_backend"](backend, topk_indices, dsa_impl)

    def check(dsa_impl, phase="prefill"):
        return scope["_check_kpool_tail_backend"](backend, TOPK, dsa_impl, phase)

    return resolve, check


def _calls(node, method: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_sm120_kpool_tail_stays_off_trtllm(version):
    before, after = patch_cases.applied(PATCH, version)
    old_resolve, _ = mixin(before, SM120)
    assert old_resolve("flashmla_sparse") == "trtllm"  # the upstream path to TllmGen's Unsupported architecture
    resolve, check = mixin(after, SM120)
    assert resolve("flashmla_sparse") == "flashmla_sparse"
    with pytest.raises(NotImplementedError, match="index_kpool > 1"):  # sglang's own refusal, in both phases
        check(resolve("flashmla_sparse"))
    with pytest.raises(NotImplementedError, match="DSA decode backend"):
        check(resolve("flashmla_sparse"), "decode")


@pytest.mark.parametrize("major", [SM100, SM110, SM90])
@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_other_gpus_keep_upstreams_choice(version, major):
    before, after = patch_cases.applied(PATCH, version)
    (old_resolve, _), (resolve, check) = mixin(before, major), mixin(after, major)
    chosen = resolve("flashmla_sparse")
    assert chosen == old_resolve("flashmla_sparse") == ("fa3" if major == SM90 else "trtllm")
    check(chosen)  # a backend that reads the tail: no refusal


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_what_never_reached_the_redirect_is_unchanged(version):
    """Plain DSA models (index_kpool 1: GLM-5, GLM-5.1), calls without top-k indices and the
    backends other than flashmla_sparse (flashinfer_sparse_mla, tilelang...) pass through."""
    before, after = patch_cases.applied(PATCH, version)
    for major in (SM120, SM100, SM90):
        for impl in ("flashmla_sparse", "flashinfer_sparse_mla", "tilelang", "trtllm"):
            plain_old, _ = mixin(before, major, index_kpool=1)
            plain_new, _ = mixin(after, major, index_kpool=1)
            assert plain_old(impl) == plain_new(impl) == impl
            (old, _), (new, _) = mixin(before, major), mixin(after, major)
            assert old(impl, None) == new(impl, None) == impl
            if impl != "flashmla_sparse":
                assert old(impl) == new(impl) == impl


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_backend_checks_the_resolved_impl_right_after(version):
    """Every caller in dsa_backend.py hands the resolved impl straight to the check, so on
    SM12x the refusal is what the user sees."""
    tree = ast.parse(wheel_bytes(version, BACKEND_FILE))
    pairs = 0
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt, following in itertools.pairwise(body):
            if isinstance(stmt, ast.Assign) and _calls(stmt.value, "_resolve_kpool_tail_backend"):
                assert isinstance(following, ast.Expr) and _calls(following.value, "_check_kpool_tail_backend")
                assert ast.unparse(following.value.args[1]) == ast.unparse(stmt.targets[0])
                pairs += 1
    assert pairs == 2  # prefill and decode


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23"])
def test_second_pass_is_a_no_op(version):
    _, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)


@pytest.mark.parametrize(
    "gate",
    [b"if self.device_sm_major in (10, 11):", b"if 10 <= self.device_sm_major < 12:"],
    ids=["major-10-11", "below-12"],
)
def test_an_upstream_gate_is_fixed_upstream(gate):
    before = patch_cases.release_file(PATCH, "0.5.23")
    edited = before.replace(
        b'if self.device_sm_major >= 10:\n            return "trtllm"', gate + b'\n            return "trtllm"'
    )
    assert edited != before
    patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)


def test_unknown_shape_is_anchor_missing():
    before = patch_cases.release_file(PATCH, "0.5.23")
    edited = before.replace(b'if self.device_sm_major >= 10:\n            return "trtllm"', b'return "trtllm"')
    assert edited != before
    patch_cases.assert_anchor_missing(PATCH, "0.5.23", edited)


@pytest.mark.parametrize("version", patch_cases.cases(EARLIER))
def test_not_applicable_before_the_kpool_mixin(version):
    """0.5.9-0.5.19 have no k-pool tail (and no GLM-5.3-Flash model): nothing to patch."""
    assert PATCH.rewrites_for(version) == []
    with pytest.raises(KeyError):
        wheel_bytes(version, KPOOL_FILE)
