"""Fixtures and hooks only: real sglang releases unpacked into throwaway site directories, the
CLI run in-process, private caches, and the two tiers. What tests share as code (helpers,
stand-ins, the patch tests' harness) is tests/support/, imported by name; no test imports
this file (tests/test_truth_suite.py keeps it so).

Tiers: every test that needs real wheels, a child process, the router or Triton is marked
`integration` (and `wheels` / `processes` / `router` / `triton`) at collection, by reading
the code it runs: the rule and its table are in tests/tiers.py. `pytest -m "not integration"`
is the fast loop; plain `pytest` (the README's command, .ci/run) runs both tiers. A fast-tier
test that does start a process, fetch a wheel or compile with Triton all the same fails
(fast_tier_guard), naming what it did, so the rule's misses do not stay hidden.

What a test needs is imported, never skipped for: a missing module, patch or fixture fails
the run (tests/test_truth_suite.py keeps it so).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import tiers
from support.cli import Cli
from support.fast_tier import watch_fast_tier
from support.paths import ROOT
from support.process_scope import scope_to_this_run, take_interrupts

sys.path.insert(0, str(ROOT / "scripts"))  # the scripts the tests run in-process (conformance)

# The host's processes are not the tests' business: scans see only this test run's
# descendants, and the orphans its servers leave are re-parented to it (not to PID 1).
scope_to_this_run()
take_interrupts()  # Ctrl-C reaches the children, however this run was started


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One sm120kit cache for the whole run, never the user's: a transform's verdict on a
    file is a pure function of its bytes, so tests of the same release share it warm."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def private_caches(request, session_cache, tmp_path_factory, monkeypatch) -> None:
    """The session's warm sm120kit cache ($SM120KIT_CACHE_DIR; an empty one of its own for a
    test marked cold_cache), a flashinfer JIT cache root of each test's own (patching
    flashinfer removes that version's JIT cache: never the machine's), no outcome seed, no
    CUDA toolkit."""
    cold = request.node.get_closest_marker("cold_cache")
    monkeypatch.setenv("SM120KIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache") if cold else session_cache))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path_factory.mktemp("flashinfer-home")))
    # The shipped outcome seed (patches/outcomes.json) off: the tests exercise the transforms,
    # which the seed would answer for (tests/test_outcome_seed.py turns it on).
    monkeypatch.setenv("SM120KIT_NO_OUTCOME_SEED", "1")
    # No CUDA toolkit unless a test gives one: the host's nvcc must not decide a launch rule.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path_factory.getbasetemp() / "no-cuda-toolkit"))


@pytest.fixture(scope="session")
def rewrite_memo() -> dict:
    return {}


@pytest.fixture
def rewrites_once(rewrite_memo, monkeypatch) -> None:
    """libcst's rewrite of a file, computed once a session: it is a pure function of the
    file's bytes and the patches (their source included), and the tests that use this
    (`pytest.mark.usefixtures("rewrites_once")`) prove what the engine does around it --
    a kill or an I/O failure at every step of a write, each step followed by a verify --
    not the rewrite, which the patch tests and the lifecycle prove uncached."""
    from sm120kit.patching import transform

    real = transform.run_rewrites

    def run_rewrites(source, items, version, relpath):
        key = (source, tuple((p.id, p.revision, p.source_sha256, r.path) for p, r in items), version, relpath)
        if key not in rewrite_memo:
            rewrite_memo[key] = real(source, items, version, relpath)
        after, findings = rewrite_memo[key]
        return after, [dataclasses.replace(f) for f in findings]

    monkeypatch.setattr(transform, "run_rewrites", run_rewrites)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    path = tmp_path / "site-packages"
    path.mkdir()
    return path


@pytest.fixture
def cli(capsys) -> Cli:
    return Cli(capsys)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        found = tiers.needs(item)
        for need in sorted(found):
            item.add_marker(need)
        if found:
            item.add_marker("integration")


@pytest.fixture(autouse=True)
def fast_tier_guard(request, monkeypatch):
    """A test left in the fast tier fails when it did what the tier promises it does not."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    done = watch_fast_tier(monkeypatch)
    yield
    if done:
        pytest.fail(
            f"this test is in the fast tier but used {', '.join(dict.fromkeys(done))}: "
            "teach tests/tiers.py to see it (its tables name what sm120kit's code hides)",
            pytrace=False,
        )
