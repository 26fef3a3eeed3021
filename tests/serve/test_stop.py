"""Stopping a served server, end to end against the sglang stand-in: sglang drains first,
SIGKILL when SIGTERM is ignored, a second Ctrl-C, and workers that left the process group."""

from __future__ import annotations

import os
import signal
import time

import psutil

from sm120kit.serve import procs


def test_stop_lets_sglang_drain_before_the_group_is_signalled(serve):
    # a drain of 6 s, well within the stop's 20: the look 1 s in falls inside it on a loaded machine
    s = serve({"drain_s": 6.0}, sets=["health.stop_timeout_s=20"]).start()
    s.wait("ready")
    schedulers = [p for p in s.ours() if p.cmdline()[0].startswith("sglang::scheduler")]
    s.proc.send_signal(signal.SIGTERM)
    s.wait("stopping")
    time.sleep(1.0)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in schedulers)  # draining: not signalled
    assert s.proc.wait(30) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and stopped["sigkilled"] == [] and stopped["seconds"] >= 6.0
    assert "Draining requests" in (s.dir / "server.log").read_text() and not s.ours()


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(serve):
    s = serve({"ignore_sigterm": True}, sets=["health.stop_timeout_s=1"]).start()
    s.wait("ready")
    began = time.monotonic()
    assert s.signal(signal.SIGTERM) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and len(stopped["sigkilled"]) == 4 and 1.0 <= stopped["seconds"] < 8
    assert time.monotonic() - began < 20 and not s.ours()


def test_a_second_ctrl_c_kills_at_once(serve):
    s = serve({"ignore_sigterm": True}, sets=["health.stop_timeout_s=60"]).start()
    s.wait("ready")
    s.proc.send_signal(signal.SIGINT)
    s.wait("stopping")
    time.sleep(0.3)
    assert s.signal(signal.SIGINT, timeout=15) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and stopped["sigkilled"] and stopped["seconds"] < 10


def test_a_worker_that_left_the_process_group_is_stopped_too(serve):
    s = serve({"orphan": True}).start()
    s.wait("ready")
    orphan = next(p for p in s.ours() if p.cmdline()[0] == "sglang::scheduler_TP1")
    assert os.getpgid(orphan.pid) != s.events("started")[0]["pid"]  # outside killpg's reach
    assert s.signal() == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and not s.ours()
    assert not psutil.pid_exists(orphan.pid) or psutil.Process(orphan.pid).status() == psutil.STATUS_ZOMBIE


def test_a_titled_worker_that_left_the_group_is_found_when_its_launcher_is_killed(serve):
    """The launcher ignores SIGTERM, so the stop ends in SIGKILL to the group; the scheduler
    that titled itself (its environ unreadable) and then left the group escapes that, and
    its launcher's own tree kill. It is the supervisor's child (a subreaper) and was in the
    tree it sampled: the stop finds it, and says clean only when it is gone."""
    s = serve({"orphan": True, "ignore_sigterm": True}, sets=["health.stop_timeout_s=1"]).start()
    s.wait("ready")
    [orphan] = [p for p in s.ours() if p.cmdline()[0] == "sglang::scheduler_TP1"]
    assert os.getsid(orphan.pid) == orphan.pid  # its own session and group: outside killpg's reach
    assert procs.MARKER not in orphan.environ()  # setproctitle wrote over it
    assert s.signal(signal.SIGTERM) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and orphan.pid in stopped["sigkilled"] and stopped["left"] == []
    assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
    assert not s.ours()
