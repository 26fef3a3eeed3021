"""sglang-moe-autotune-flashinfer-cutlass on the real code of every release 0.5.9-0.5.23:
before/after source, no-op cases, and the patched gate executed."""

from __future__ import annotations

import ast
import textwrap
import types

import libcst as cst
import pytest
from support import patch_cases

PATCH = patch_cases.shipped_patch("sglang-moe-autotune-flashinfer-cutlass")
BUGGY = patch_cases.releases(PATCH, fixed=False)  # below its fixed_in, 0.5.13
FIXED = patch_cases.releases(PATCH, fixed=True)


def gate(source: bytes):
    """The real gate function, extracted from the file and made callable."""
    tree = ast.parse(source)
    node = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_should_run_flashinfer_autotune"
    )
    code = textwrap.dedent(ast.get_source_segment(source.decode(), node))
    scope: dict = {}

    def call(backend: str, major: int) -> bool:
        torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_capability=lambda: (major, 0)))
        scope.clear()
        scope["torch"] = torch
        exec(code, scope)
        spec = types.SimpleNamespace(
            **{k: (lambda: False) for k in ("is_eagle", "is_standalone", "is_ngram", "is_speculative")}
        )
        args = types.SimpleNamespace(
            disable_flashinfer_autotune=False, moe_runner_backend=backend, moe_a2a_backend="none"
        )
        runner = types.SimpleNamespace(server_args=args, spec_algorithm=spec, is_draft_worker=False)
        return scope["_should_run_flashinfer_autotune"](runner)

    return call


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_rewrites_the_gate(version):
    before, after = patch_cases.applied(PATCH, version)
    old, new = gate(before), gate(after)
    # Upstream: flashinfer_cutlass never autotunes. Patched: only on SM120.
    assert old("flashinfer_cutlass", 12) is False
    assert new("flashinfer_cutlass", 12) is True
    # Every other GPU and every other backend keeps upstream's answer.
    for backend in ("flashinfer_cutlass", "flashinfer_trtllm", "triton", "flashinfer_mxfp4"):
        for major in (8, 9, 10, 12):
            if (backend, major) != ("flashinfer_cutlass", 12):
                assert new(backend, major) == old(backend, major), (backend, major)
    # The diff is the gate alone: one marker line, one changed line.
    changed = [line for line in after.decode().splitlines() if line not in before.decode().splitlines()]
    assert len(changed) == 2 and "# sm120kit: sglang-moe-autotune-flashinfer-cutlass r1" in changed[0]
    assert 'backend_str == "flashinfer_cutlass" and torch.cuda.get_device_capability()[0] == 12' in changed[1]


@pytest.mark.parametrize("version", patch_cases.cases(BUGGY))
def test_second_pass_is_a_no_op(version):
    _, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)


@pytest.mark.parametrize("version", patch_cases.cases(FIXED))
def test_fixed_upstream_is_detected_from_the_code(version):
    finding = patch_cases.assert_fixed_upstream(PATCH, version)
    assert "0.5.13" in finding.detail and "autotune list" in finding.detail


def test_fixed_upstream_comes_from_shape_not_version():
    """0.5.12.post1's file with the list entry added (as upstream did) is fixed-upstream
    even though the version is in the patch's window."""
    before = patch_cases.release_file(PATCH, "0.5.12.post1")
    edited = before.replace(b'# "flashinfer_cutlass",', b'"flashinfer_cutlass",')
    assert edited != before
    patch_cases.assert_fixed_upstream(PATCH, "0.5.12.post1", edited)


@pytest.mark.parametrize(
    "mutation, reason",
    [
        pytest.param(b"def _should_run_flashinfer_autotune(", b"def _should_autotune(", id="gate renamed"),
        pytest.param(
            b"if backend_str not in [", b"if self.server_args.moe_runner_backend not in [", id="test reshaped"
        ),
    ],
)
def test_unknown_shape_is_anchor_missing(mutation, reason):
    before = patch_cases.release_file(PATCH, "0.5.10").replace(mutation, reason)
    patch_cases.assert_anchor_missing(PATCH, "0.5.10", before)


def test_patched_file_is_valid_python():
    _, after = patch_cases.applied(PATCH, "0.5.10")
    cst.parse_module(after)
    compile(after, "model_runner.py", "exec")
