"""The host's processes are not a test's business."""

from __future__ import annotations

import os

from sm120kit.serve import procs


def scope_to_this_run() -> None:
    """Process scans (serve's stale check, a stop) see only this process's descendants, and
    the orphans its servers leave are re-parented to it, not to PID 1: the test run (and the
    scripts that borrow the tests' stand-ins) are not swayed by an sglang the host runs."""
    procs.become_subreaper()
    os.environ[procs.SCOPE] = str(os.getpid())
