"""The host's processes are not a test's business."""

from __future__ import annotations

import os
import signal
import threading

from sm120kit.serve import procs


def scope_to_this_run() -> None:
    """Process scans (serve's stale check, a stop) see only this process's descendants, and
    the orphans its servers leave are re-parented to it, not to PID 1: the test run (and the
    scripts that borrow the tests' stand-ins) are not swayed by an sglang the host runs."""
    procs.become_subreaper()
    os.environ[procs.SCOPE] = str(os.getpid())


def take_interrupts() -> None:
    """SIGINT back to Python's own handler where this run was started with it ignored (a
    shell's `cmd &` without job control, as a script or CI step runs it, ignores SIGINT in
    what it starts): its children would inherit that, and the tests that stop a child with
    Ctrl-C (bench, a search, a serve) would see the child ignore it. A handler of Python's
    is reset to the default at exec, so every child takes SIGINT as a user's shell gives it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
