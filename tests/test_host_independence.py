"""The tests never depend on the host: an unrelated sglang process on the machine running
them (operators run the suite on GPU nodes that are serving) changes no result.

conftest.py makes the test run a child subreaper and the scope of every process scan
(SM120KIT_PROCESS_SCOPE): the processes the tests start, and the orphans they leave, are
its descendants; the host's are not."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import ROOT

from sm120kit.serve import procs

# A scheduler whose launcher is gone, titled as sglang titles it (setproctitle).
FOREIGN = "import setproctitle, time; setproctitle.setproctitle('sglang::scheduler_TP0'); time.sleep(600)"


def foreign_orphan() -> int:
    """An orphaned `sglang::scheduler_TP0` outside the scope of a test run started later:
    started through a parent that exits at once."""
    spawn = (
        f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {FOREIGN!r}], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    pid = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout)
    proc = psutil.Process(pid)
    for _ in range(100):  # until its title is set
        if proc.cmdline()[:1] == ["sglang::scheduler_TP0"]:
            return pid
        psutil.wait_procs([proc], timeout=0.05)
    raise AssertionError("the foreign scheduler did not title itself")


def test_the_preflight_tests_give_the_same_results_with_a_foreign_sglang_process_alive(tmp_path: Path, monkeypatch):
    pid = foreign_orphan()
    try:
        monkeypatch.delenv(procs.SCOPE, raising=False)  # as on a node: the scan sees the whole machine
        assert pid in {p.pid for p in procs.scan(sglang=True)}
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "t"),
            "-m",
            "preflight",
            "tests/test_serve.py",
            "tests/test_serve_parts.py",
        ]
        # os.environ, not this process's C environment: a library loaded here may have set COLUMNS=80
        # there, and the output would be fitted to it
        env = dict(os.environ)
        done = subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
        summary = done.stdout.strip().splitlines()[-1]
        assert done.returncode == 0 and " passed" in summary and "failed" not in summary, done.stdout[-4000:]
        assert psutil.Process(pid).cmdline()[:1] == ["sglang::scheduler_TP0"]  # --kill-stale left it alone
    finally:
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # adopted by this test run (a subreaper): reap it
