"""The engine's own guarantees, whatever a patch does: a transform that raises, rewrites
forever, forgets its marker or breaks the syntax is reported as failed and nothing is
written (Black's assert_stable, for patches)."""

from __future__ import annotations

import libcst as cst
import pytest
from support.sites import install
from support.tree import tree_snapshot

from sm120kit.patching import apply, planning
from sm120kit.patching.cst_tools import marker_line
from sm120kit.patching.spec import Outcome, Patch, Rewrite, Rewritten
from sm120kit.target import resolve_target


def _append(module: cst.Module, line: cst.EmptyLine) -> cst.Module:
    return module.with_changes(footer=[*module.footer, line])


def raises(module, ctx):
    raise RuntimeError("boom")


def grows(module, ctx):  # never says already-applied: unstable
    return Rewritten(_append(module, marker_line(ctx.marker)))


def unmarked(module, ctx):
    return Rewritten(_append(module, marker_line("# something")))


def breaks_syntax(module, ctx):
    body = [*module.body, cst.parse_statement("x = 1\n")]
    bad = body[-1].with_changes(body=[cst.Expr(cst.Name("def"))])
    return Rewritten(module.with_changes(body=[*module.body, bad], footer=[marker_line(ctx.marker)]))


@pytest.mark.parametrize(
    "transform, says",
    [
        (raises, "transform raised RuntimeError('boom')"),
        (grows, "unstable: a second pass would change the code again"),
        (unmarked, "did not leave its marker comment"),
        (breaks_syntax, "does not compile"),
    ],
)
def test_misbehaving_transform_is_failed_and_nothing_written(site, transform, says):
    install(site, "0.5.10")
    patch = Patch("bad", "sglang", "s", "w", (Rewrite("sglang/version.py", ">=0.5.9", transform),))
    before = tree_snapshot(site)
    result = apply.apply(resolve_target(site=str(site)), [patch])
    [finding] = result.findings
    assert finding.outcome is Outcome.FAILED and says in finding.detail
    assert result.exit_code(check=False) == 2
    assert tree_snapshot(site) == before


def test_out_of_window_versions(site):
    """Older than the window: not applicable. Newer: the transform runs by shape, whether or
    not the bug is known fixed (a release number says nothing of its code; here it
    misbehaves: failed)."""
    install(site, "0.5.10", flashinfer=False)
    target = resolve_target(site=str(site))
    newer = Patch("newer", "sglang", "s", "w", (Rewrite("sglang/version.py", ">=0.5.11,<0.5.20", grows),))
    past = Patch("past", "sglang", "s", "w", (Rewrite("sglang/version.py", "<0.5.5", grows),))
    fixed = Patch("fixed", "sglang", "s", "w", (Rewrite("sglang/version.py", "<0.5.5", grows),), fixed_in="0.5.6")
    absent = Patch("absent", "sglang", "s", "w", (Rewrite("sglang/not_there.py", ">=0.5.9", grows),))
    other = Patch("other", "flashinfer-python", "s", "w", (Rewrite("flashinfer/x.py", ">=0", grows),))
    findings = {f.patch.id: f for f in planning.plan(target, [newer, past, fixed, absent, other]).findings}
    outcomes = {pid: (f.outcome, f.detail) for pid, f in findings.items()}
    assert outcomes["newer"] == (Outcome.NOT_APPLICABLE, "sglang 0.5.10 is outside >=0.5.11,<0.5.20")
    assert outcomes["past"] == (Outcome.FAILED, "unstable: a second pass would change the code again")
    assert findings["past"].unproven == "unproven on sglang 0.5.10 (proven <0.5.5)"
    assert outcomes["fixed"] == (Outcome.FAILED, "unstable: a second pass would change the code again")
    assert findings["fixed"].unproven == "unproven on sglang 0.5.10 (proven <0.5.5)"
    assert not findings["newer"].unproven
    assert outcomes["absent"][0] is Outcome.ANCHOR_MISSING and "sglang/not_there.py is absent" in outcomes["absent"][1]
    assert outcomes["other"] == (Outcome.NOT_APPLICABLE, "flashinfer-python is not installed")
