"""A pytest run inside a test (a test of the suite's own rules, or of a tier), bounded and
told apart from the run around it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_pytest(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    """`python -m pytest ARGS` in `cwd`: its exit status and its output (stderr merged).
    In a session of its own (out of the reach of a signal to this run's process group), no
    stdin; on a hang, faulthandler says where it is (SIGABRT) and the test fails with that.
    `env` adds to this process's os.environ (not its C environment: a library loaded here
    may have set COLUMNS=80 there, and the output would be fitted to it)."""
    with subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as inner:
        try:
            out, _ = inner.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            inner.send_signal(signal.SIGABRT)
            out, _ = inner.communicate()
            pytest.fail(f"the inner pytest run hung; it said:\n{out[-8000:]}")
    return inner.returncode, out
