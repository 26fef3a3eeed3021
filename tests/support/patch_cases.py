"""One harness for "a shipped patch on every release in its range", on the release's real
code (the file from its wheel).

- which patch: `shipped_patch(id)` (or a package's `shipped_patches`), read from patches/
  through the registry; a renamed or missing one fails every test that proves it, never
  skips it;
- which releases: `releases(patch)`, the releases of the package's window that the patch's
  own declaration covers (its rewrites' ranges), narrowed to those upstream has or has not
  fixed (`fixed=`: the rewrite's fixed_in, else the patch's) or to one file (`path=`);
  `uncovered(patch)`, the window's releases outside the range; `cases(...)`, the same as
  pytest params, where an empty selection fails the collection rather than skip the test;
- the steps every patch test takes: `transform` (the pure step, sm120kit.patching.transform,
  on the release's file or on edited bytes), `applied` (it would apply), and the no-op
  verdicts: `assert_second_pass_is_a_no_op`, `assert_fixed_upstream`, `assert_anchor_missing`
  (each leaves the bytes as they were).

The engine's side (install, apply, verify, unpatch back to the wheel's bytes) is proven for
every shipped patch on every release by tests/test_release_lifecycle.py; the patch tests
prove what each rewrite does to the code.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from packaging.version import Version

from sm120kit.patching.registry import load_patches
from sm120kit.patching.spec import Outcome, Patch, Rewrite
from sm120kit.patching.transform import Finding, run_rewrites
from support.sites import WINDOW, flashinfer_window, wheel_bytes


@functools.cache
def _shipped() -> dict[str, Patch]:
    return {p.id: p for p in load_patches()}


def shipped_patch(patch_id: str) -> Patch:
    """The shipped patch with this id; a renamed or missing one fails the test, never skips it."""
    patch = _shipped().get(patch_id)
    if patch is None:
        shipped = ", ".join(sorted(_shipped()))
        pytest.fail(f"no shipped patch has the id {patch_id} (patches/ has: {shipped})", pytrace=False)
    return patch


def shipped_patches(package: str) -> list[Patch]:
    """Every shipped patch of `package` (a distribution name: "sglang", "flashinfer-python")."""
    return [p for p in _shipped().values() if p.package == package]


def window(package: str) -> tuple[str, ...]:
    """The releases of `package` that the tests prove patches on."""
    if package == "sglang":
        return WINDOW
    if package == "flashinfer-python":
        return flashinfer_window()
    raise KeyError(f"no proven window for {package}")


def _is_at(rewrite: Rewrite, path: str | None) -> bool:
    """Whether `rewrite` is of the file at `path` (its whole path in the package, or its tail:
    "prefill_attention.py" names the file wherever a release keeps it); None: any file."""
    return path is None or rewrite.path == path or rewrite.path.endswith("/" + path)


def _is_fixed(patch: Patch, rewrite: Rewrite, version: str) -> bool:
    fixed_in = patch.fixed_in_for(rewrite)
    return fixed_in is not None and Version(version) >= Version(fixed_in)


def releases(patch: Patch, *, fixed: bool | None = None, path: str | None = None) -> list[str]:
    """The window's releases that a rewrite of `patch` covers, oldest first. With `path`, the
    rewrites of that file only; with `fixed`, the releases where upstream has (True) or has
    not yet (False) fixed what they patch."""
    found = []
    for version in window(patch.package):
        rewrites = [r for r in patch.rewrites_for(version) if _is_at(r, path)]
        if rewrites and (fixed is None or all(_is_fixed(patch, r, version) for r in rewrites) is fixed):
            found.append(version)
    return found


def uncovered(patch: Patch) -> list[str]:
    """The window's releases that no rewrite of `patch` covers (where it has nothing to do)."""
    return [v for v in window(patch.package) if not patch.rewrites_for(v)]


def cases(versions: list[str]) -> list:
    """`versions` as pytest params (each id the version). A test parametrized on no release
    would be skipped, proving nothing: an empty selection fails instead."""
    if not versions:
        pytest.fail("no release to run on: the patch's declared range selects none of the window", pytrace=False)
    return [pytest.param(v, id=v) for v in versions]


def rewrite_of(patch: Patch, version: str, path: str | None = None) -> Rewrite:
    """The one rewrite of `patch` for `version` (of the file at `path`, where it has several)."""
    rewrites = [r for r in patch.rewrites_for(version) if _is_at(r, path)]
    assert len(rewrites) == 1, f"{patch.id} has {len(rewrites)} rewrites of {path or 'its files'} for {version}"
    return rewrites[0]


def release_file(patch: Patch, version: str, path: str | None = None) -> bytes:
    """The release's own bytes of the file the patch rewrites there."""
    return wheel_bytes(version, rewrite_of(patch, version, path).path, patch.package)


@functools.cache
def _on_release(patch: Patch, version: str, path: str | None) -> tuple[bytes, Finding]:
    """The rewrite over the release's own file: a pure function of the wheel's bytes, run
    once per run (libcst takes a second over a large file)."""
    rewrite = rewrite_of(patch, version, path)
    after, [finding] = run_rewrites(release_file(patch, version, path), [(patch, rewrite)], version, rewrite.path)
    return after, finding


def transform(
    patch: Patch, version: str, source: bytes | None = None, path: str | None = None
) -> tuple[bytes, bytes, Finding]:
    """(before, after, finding) of the patch's rewrite for `version` run over `source`, by
    default the release's own file."""
    if source is None:
        after, finding = _on_release(patch, version, path)
        return release_file(patch, version, path), after, dataclasses.replace(finding)
    rewrite = rewrite_of(patch, version, path)
    after, [finding] = run_rewrites(source, [(patch, rewrite)], version, rewrite.path)
    return source, after, finding


def applied(patch: Patch, version: str, path: str | None = None) -> tuple[bytes, bytes]:
    """(before, after) of the release's own file, which the patch would rewrite."""
    before, after, finding = transform(patch, version, path=path)
    assert finding.outcome is Outcome.WOULD_APPLY, (finding.outcome, finding.detail)
    return before, after


def assert_second_pass_is_a_no_op(patch: Patch, version: str, after: bytes, path: str | None = None) -> None:
    """The patched file, run again: already-applied, and not a byte changed."""
    again, again_after, finding = transform(patch, version, after, path)
    assert finding.outcome is Outcome.ALREADY_APPLIED, (finding.outcome, finding.detail)
    assert again_after == again


def assert_fixed_upstream(patch: Patch, version: str, source: bytes | None = None, path: str | None = None) -> Finding:
    """Upstream's code already has the fix (the release's file, or `source`): the patch steps
    aside and leaves the bytes. Returns the finding (its detail names the fix)."""
    before, after, finding = transform(patch, version, source, path)
    assert finding.outcome is Outcome.FIXED_UPSTREAM, (finding.outcome, finding.detail)
    assert after == before
    return finding


def assert_anchor_missing(patch: Patch, version: str, source: bytes, path: str | None = None) -> Finding:
    """Code of a shape the patch does not know: anchor-missing, and nothing written."""
    before, after, finding = transform(patch, version, source, path)
    assert finding.outcome is Outcome.ANCHOR_MISSING, (finding.outcome, finding.detail)
    assert after == before
    return finding
