"""What a fast-tier test must not use, watched while it runs (conftest's fast_tier_guard
fails the test that used it; tests/tiers.py is the rule that should have seen it)."""

from __future__ import annotations

import functools
import os

import pytest
import tiers

from sm120kit import wheels


def watch_fast_tier(monkeypatch) -> list[str]:
    """Wrap what a fast-tier test must not use (a child process, a wheel fetch, a Triton
    compile); returns the list that notes each use, as "processes (os.system)"."""
    done: list[str] = []

    def watch(owner, name: str, need: str, replaces_this_process: bool = False) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def watched(*args, **kwargs):
            done.append(f"{need} ({getattr(owner, '__name__', owner)}.{name})")
            if replaces_this_process:  # an exec would end pytest itself: nothing left to fail the test
                pytest.fail(f"this test is in the fast tier but called {done[-1]}", pytrace=False)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    import subprocess

    from sm120kit.tune import aot

    watch(subprocess.Popen, "__init__", "processes")
    for name in tiers.OS_PROCESS_CALLS:
        watch(os, name, "processes", replaces_this_process=name.startswith("exec"))
    watch(wheels, "fetch", "wheels")
    watch(wheels, "_pip_download", "wheels")
    watch(aot, "compile_for", "triton")
    return done
