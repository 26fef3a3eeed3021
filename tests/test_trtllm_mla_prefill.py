"""sglang-trtllm-mla-prefill-sm120 on the real code of every release 0.5.9-0.5.23: before/after
source, no-op cases, and the release's own backend resolution, extracted from the patched
file and run with the GPU presented as SM120 (12, 0) and as SM100 (10, 0)."""

from __future__ import annotations

import ast
import logging
import textwrap
import types
import typing

import libcst as cst
import pytest
from packaging.version import Version
from support import patch_cases
from support.sites import WINDOW, wheel_bytes

PATCH = patch_cases.shipped_patch("sglang-trtllm-mla-prefill-sm120")
RELEASES = patch_cases.releases(PATCH)  # the window: server_args.py's method to 0.5.14, overrides.py's pass from 0.5.15
MARKER = "# sm120kit: sglang-trtllm-mla-prefill-sm120 r1"
SM120, SM100 = 12, 10


def _function(source: bytes, name: str, cls: str | None = None) -> str:
    tree = ast.parse(source)
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls) if cls else tree
    node = next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return textwrap.dedent(ast.get_source_segment(source.decode(), node))


def _platform(major: int) -> dict:
    """The capability seam both shapes read: sglang.srt.utils' probes (0.5.9-0.5.18) and
    get_platform()'s facts (0.5.19+), as they answer on a GPU of this capability major."""
    facts = {
        "is_blackwell": major in (10, 11, 12),
        "is_sm100": major == 10,
        "is_sm120": major == 12,
        "is_sm90": major == 9,
        "is_hopper_with_cuda_12_3": major == 9,
        "is_hip": False,
        "is_xpu": False,
    }
    platform = types.SimpleNamespace(**facts)
    return {
        "get_platform": lambda: platform,
        "is_blackwell_supported": lambda: facts["is_blackwell"],
        "is_sm100_supported": lambda: facts["is_sm100"],
        "is_sm120_supported": lambda: facts["is_sm120"],
        "is_sm90_supported": lambda: facts["is_sm90"],
        "is_hopper_with_cuda_12_3": lambda: facts["is_hopper_with_cuda_12_3"],
        "is_hip": lambda: False,
        "cpu_has_amx_support": lambda: False,
        "xpu_has_xmx_support": lambda: False,
        "is_flashinfer_available": lambda: True,
        "logger": logging.getLogger("sglang-under-test"),
        "Any": typing.Any,
    }


# --- 0.5.15+: the resolution passes of arg_groups/overrides.py -----------------------------


class _View(types.SimpleNamespace):
    """A resolving view: the fields a test names, None for every other field."""

    def __getattr__(self, name):
        return None


def pass_resolver(version: str, overrides: bytes):
    """The attention passes in the order attention_hook runs them (backend default fill,
    page-size snap, trtllm_mla checks), each pass's declaration applied to the view, then
    the release's own attention_backends_of -> (prefill, decode)."""
    passes = ("_attention_backend_default", "_mla_backend_page_constraints", "_mla_kv_cache_dtype_checks")
    base = overrides if Version(version) < Version("0.5.19") else wheel_bytes(version, MODEL_OVERRIDE_BASE)
    code = "\n\n".join([*(_function(overrides, name) for name in passes), _function(base, "attention_backends_of")])

    def resolve(major: int, **fields) -> tuple[str, str]:
        scope = _platform(major)
        exec(code, scope)
        view = _View(**{"kv_cache_dtype": "auto", **fields})
        for name in passes:
            declared = scope[name](view)
            assert isinstance(declared, dict)
            vars(view).update(declared)
        return scope["attention_backends_of"](view)

    return resolve


MODEL_OVERRIDE_BASE = "sglang/srt/arg_groups/model_override_base.py"


# --- 0.5.9-0.5.14: ServerArgs._handle_attention_backend_compatibility -----------------------


class _ModelConfig:
    """Kimi K2.5 as the method reads it: an MLA model, long context, not encoder-decoder."""

    hf_config = types.SimpleNamespace(architectures=["KimiK25ForConditionalGeneration"])
    context_len = 262144
    is_encoder_decoder = False

    def get_num_kv_heads(self, tp_size):
        return 1


def method_resolver(server_args: bytes):
    """The whole method, run on a stand-in ServerArgs carrying the release's own
    get_attention_backends -> (prefill, decode) afterwards."""
    method = _function(server_args, "_handle_attention_backend_compatibility", cls="ServerArgs")
    backends = _function(server_args, "get_attention_backends", cls="ServerArgs")

    def resolve(major: int, **fields) -> tuple[str, str]:
        scope = _platform(major)
        scope["Backend"] = types.SimpleNamespace(DISABLED="disabled")
        exec(method, scope)
        exec(backends, scope)
        args = types.SimpleNamespace(
            attention_backend=None,
            prefill_attention_backend=None,
            decode_attention_backend=None,
            kv_cache_dtype="auto",
            page_size=1,
            device="cuda",
            tp_size=8,
            speculative_algorithm=None,
            speculative_eagle_topk=None,
            disable_cuda_graph=False,
            disable_radix_cache=False,
            enable_mixed_chunk=False,
            mem_fraction_static=0.85,
            cuda_graph_config=types.SimpleNamespace(
                decode=types.SimpleNamespace(backend="full"), prefill=types.SimpleNamespace(backend="full")
            ),
        )
        vars(args).update(fields)
        args.get_model_config = _ModelConfig
        args.use_mla_backend = lambda: True
        args._get_default_attn_backend = lambda use_mla, config: "triton"
        args.get_attention_backends = types.MethodType(scope["get_attention_backends"], args)
        scope["_handle_attention_backend_compatibility"](args)
        return args.get_attention_backends()

    return resolve


def resolver(version: str, source: bytes):
    return method_resolver(source) if Version(version) < Version("0.5.15") else pass_resolver(version, source)


# Kimi K2.x / DeepSeek launched with trtllm_mla as operators copy it from the Blackwell recipes.
TRTLLM_MLA = {"attention_backend": "trtllm_mla"}
SPLIT_BOTH_TRTLLM = {"prefill_attention_backend": "trtllm_mla", "decode_attention_backend": "trtllm_mla"}


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_sm120_prefills_on_flashinfer_and_decodes_on_trtllm_mla(version, caplog):
    before, after = patch_cases.applied(PATCH, version)
    old, new = resolver(version, before), resolver(version, after)
    # Upstream: SM120 keeps trtllm_mla for prefill, whose kernel refuses SM12x.
    assert old(SM120, **TRTLLM_MLA) == ("trtllm_mla", "trtllm_mla")
    # Patched: prefill moves to flashinfer, decode stays on trtllm_mla, and the log says why.
    caplog.clear()
    assert new(SM120, **TRTLLM_MLA) == ("flashinfer", "trtllm_mla")
    assert [r.getMessage() for r in caplog.records if "sm120kit" in r.getMessage()] == [
        "sm120kit: TRT-LLM MLA prefill kernels exist only for SM100/SM103 (TllmGenFmhaRunner: "
        "Unsupported architecture on SM12x); prefill runs on flashinfer, decode stays on trtllm_mla."
    ]
    assert new(SM120, **SPLIT_BOTH_TRTLLM) == ("flashinfer", "trtllm_mla")
    # SM100 keeps upstream's answer: trtllm_mla for both.
    assert new(SM100, **TRTLLM_MLA) == old(SM100, **TRTLLM_MLA) == ("trtllm_mla", "trtllm_mla")
    assert new(SM100, **SPLIT_BOTH_TRTLLM) == old(SM100, **SPLIT_BOTH_TRTLLM) == ("trtllm_mla", "trtllm_mla")


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_sm120_other_choices_are_upstreams(version):
    before, after = patch_cases.applied(PATCH, version)
    old, new = resolver(version, before), resolver(version, after)
    for major in (SM120, SM100):
        for fields in (
            {"attention_backend": "flashinfer"},
            {"attention_backend": "triton"},
            # An explicit non-trtllm prefill with trtllm_mla decode is already what we route to.
            {"attention_backend": "trtllm_mla", "prefill_attention_backend": "triton"},
            {"attention_backend": "flashinfer", "decode_attention_backend": "trtllm_mla"},
        ):
            assert new(major, **fields) == old(major, **fields), (major, fields)
    # trtllm_mla asked for prefill only: SM120 prefills on flashinfer, SM100 as upstream.
    prefill_only = {"attention_backend": "flashinfer", "prefill_attention_backend": "trtllm_mla"}
    assert new(SM120, **prefill_only) == ("flashinfer", "flashinfer")
    assert new(SM100, **prefill_only) == old(SM100, **prefill_only) == ("trtllm_mla", "flashinfer")


@pytest.mark.parametrize("version", ["0.5.9", "0.5.14", "0.5.15", "0.5.19", "0.5.23"])
def test_trtllm_mla_validation_still_runs_on_sm120(version):
    """The branch comes after sglang's own trtllm_mla checks: a KV dtype that trtllm_mla
    decode cannot take is still refused, and pre-Blackwell GPUs are still refused."""
    _, after = patch_cases.applied(PATCH, version)
    new = resolver(version, after)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        new(SM120, attention_backend="trtllm_mla", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="only supported on Blackwell"):
        new(9, attention_backend="trtllm_mla")


@pytest.mark.parametrize("version", patch_cases.cases(RELEASES))
def test_the_diff_is_one_marked_branch(version):
    before, after = patch_cases.applied(PATCH, version)
    old_lines, new_lines = before.decode().splitlines(), after.decode().splitlines()
    added = [line for line in new_lines if line not in old_lines]
    assert len(new_lines) == len(old_lines) + 4 and len(added) == 4
    assert added[0].strip().startswith(MARKER)
    probe = "is_sm120_supported()" if Version(version) < Version("0.5.19") else "get_platform().is_sm120"
    assert added[1].strip().startswith(f"if {probe} and (")
    assert "TllmGenFmhaRunner" in added[2]
    compile(after, "patched.py", "exec")
    cst.parse_module(after)


@pytest.mark.parametrize("version", ["0.5.9", "0.5.14", "0.5.15", "0.5.18", "0.5.19", "0.5.23"])
def test_second_pass_is_a_no_op(version):
    _, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)


def test_upstream_prefill_gate_is_fixed_upstream():
    """PR #28837's shape: the pass refuses trtllm_mla prefill off SM100. The patch steps
    aside, read from the code, not the version."""
    before = patch_cases.release_file(PATCH, "0.5.23")
    anchor = b"    return {}\n\n\n@register_post_process\ndef _hisparse_validation("
    assert before.count(anchor) == 1
    edited = before.replace(
        anchor,
        b'    if attention_backends_of(view)[0] == "trtllm_mla" and not get_platform().is_sm100:\n'
        b'        raise ValueError("TRTLLM MLA prefill requires SM100/SM103.")\n' + anchor,
    )
    patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)


def test_upstream_method_gate_is_fixed_upstream():
    before = patch_cases.release_file(PATCH, "0.5.9")
    old = b'if not is_blackwell_supported():\n                raise ValueError(\n                    "TRTLLM MLA'
    assert before.count(old) == 1
    edited = before.replace(old, old.replace(b"is_blackwell_supported", b"is_sm100_supported"))
    patch_cases.assert_fixed_upstream(PATCH, "0.5.9", edited)


@pytest.mark.parametrize(
    "version, old, new",
    [
        pytest.param("0.5.23", b"def _mla_kv_cache_dtype_checks(", b"def _mla_checks(", id="pass renamed"),
        pytest.param("0.5.23", b"if not get_platform().is_blackwell:", b"if not _blackwell():", id="probe unknown"),
        pytest.param(
            "0.5.23",
            b'                "TensorRT-LLM MLA backend only supports kv-cache-dtype of fp8_e4m3, bf16, or auto."\n'
            b"            )\n    return {}\n",
            b'                "TensorRT-LLM MLA backend only supports kv-cache-dtype of fp8_e4m3, bf16, or auto."\n'
            b"            )\n    return dict()\n",
            id="pass no longer returns {}",
        ),
        pytest.param(
            "0.5.12", b"def _handle_attention_backend_compatibility(", b"def _attention_compat(", id="method renamed"
        ),
    ],
)
def test_unknown_shape_is_anchor_missing(version, old, new):
    before = patch_cases.release_file(PATCH, version)
    assert before.count(old) == 1
    edited = before.replace(old, new)
    patch_cases.assert_anchor_missing(PATCH, version, edited)


def test_rewrites_cover_the_window_once():
    for version in WINDOW:
        assert len(PATCH.rewrites_for(version)) == 1, version
    assert [r.path for r in PATCH.rewrites_for("0.5.14")] == ["sglang/srt/server_args.py"]
    assert [r.path for r in PATCH.rewrites_for("0.5.15")] == ["sglang/srt/arg_groups/overrides.py"]
    assert PATCH.fixed_in is None
