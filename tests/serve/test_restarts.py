"""The real supervisor's restarts, end to end against the sglang stand-in: backoff, the
crash-loop limit, a hung server, the startup budget, and a death a restart cannot mend (a
missing module: one start, exit 2). tests/serve/test_supervision.py drives the same
transitions on a fake clock."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys

from support.serve import DEATHS, MY_FAILURE, VERSION, make_venv, ps, said
from support.sites import install
from support.standin import Served, make_env_python

from sm120kit.exit_codes import ExitCode


def test_backoff_doubles_until_the_crash_loop_limit(serve):
    s = serve(
        {"die_loading": DEATHS["cuda-out-of-memory"]},
        sets=["health.max_restarts=3", "health.backoff_initial_s=0.2", "health.backoff_max_s=0.5"],
    )
    code, out = s.run()
    assert code == 1
    assert [e["in_s"] for e in s.events("restarting")] == [0.2, 0.4, 0.5]
    starts = [e["t"] for e in s.events("started")]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= delay for gap, delay in zip(gaps, [0.2, 0.4, 0.5]))
    gave_up = s.events("gave_up")[0]
    assert (
        gave_up["failures"] == 4
        and len(gave_up["deaths"]) == 4
        and all("cuda-out-of-memory" in d for d in gave_up["deaths"])
    )
    assert "giving up: 4 failed runs in a row (health.max_restarts = 3)" in out
    assert sorted(p.name for p in s.dir.iterdir() if p.name.startswith("server.log")) == [
        "server.log",
        "server.log.1",
        "server.log.2",
        "server.log.3",
    ]
    assert not s.ours()


def test_a_crash_then_a_good_start(serve, tmp_path):
    s = serve({"die_loading": DEATHS["nccl"], "fail_starts": 1, "counter": str(tmp_path / "starts")}).start()
    s.wait("ready")
    assert len(s.events("started")) == 2 and s.events("died")[0]["diagnoses"][0]["id"] == "nccl"
    _code, out, _ = ps(s)
    row = next(r for r in out["runs"] if r["profile"] == "standin")
    assert row["running"] and row["status"] == "ready" and row["restarts"] == 1 and row["last_health"]["ok"]
    text = subprocess.run(
        [sys.executable, "-m", "sm120kit", "ps", "--wide"], capture_output=True, text=True, env=s.env, check=True
    ).stdout  # --wide: every column on the row, as the assertions read it
    assert text.splitlines()[0].split() == [
        "PROFILE",
        "STATUS",
        "SUPERVISOR",
        "SERVER",
        "SINCE",
        "RESTARTS",
        "LAST",
        "HEALTH",
        "PORT",
    ]
    assert (
        text.splitlines()[1].split()[:3] == ["standin", "ready", str(s.proc.pid)]
        and "ok 200" in text
        and f"127.0.0.1:{s.port}" in text
    )
    assert s.signal(signal.SIGTERM) == 0


def test_a_death_is_diagnosed_with_the_known_failures_of_its_patch_dirs(serve, tmp_path):
    """serve --patch-dir DIR: DIR's known-failures.toml names a death, as `diagnose --patch-dir`
    and `profile check` read it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "known-failures.toml").write_text(MY_FAILURE)
    s = serve(
        {"die_loading": "RuntimeError: boom at line 12"}, sets=["health.max_restarts=0"], extra=["--patch-dir", mine]
    )
    code, out = s.run()
    assert code == 1 and "diagnosis: a failure of my own" in out, out
    assert "boom-sm120" in s.events("gave_up")[0]["deaths"][0]


def test_death_after_ready_restarts(serve, tmp_path):
    s = serve(
        {
            "die_after_ready_s": 5,  # ample for the supervisor to see it ready first on a loaded machine
            "die_text": DEATHS["illegal-instruction"],
            "fail_starts": 1,
            "counter": str(tmp_path / "starts"),
        }
    ).start()
    died = s.wait("died")
    assert died["ready"] and died["diagnoses"][0]["id"] == "illegal-instruction"
    s.wait("ready", count=2)
    assert s.signal() == 0


def test_a_hung_server_is_killed_and_restarted(serve, tmp_path):
    # /health_generate stops answering; sglang's own check gives up after
    # SGLANG_HEALTH_CHECK_TIMEOUT and answers 503 (a process check would say "alive")
    # it hangs 3 s after ready (the supervisor must see it ready first); the probe waits 5 s, so
    # sglang's 503 after its 1 s comes in time on a loaded machine
    s = serve(
        {"hang_after_ready_s": 3.0, "fail_starts": 1, "counter": str(tmp_path / "starts")},
        sets=["health.probe_timeout_s=5"],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"},
    ).start()
    hung = s.wait("hung")
    failures = s.events("probe_failed")
    assert [f["consecutive"] for f in failures] == [1, 2] and failures[0]["detail"].startswith("503")
    assert hung["ready"] and "failed 2 probes in a row" in hung["detail"]
    s.wait("ready", count=2)
    assert "Health check failed" in (s.dir / "server.log.1").read_text()
    assert s.signal() == 0


def test_a_probe_that_times_out_counts_as_a_failure(serve):
    s = serve(
        {"hang_after_ready_s": 3.0},  # the supervisor sees it ready first
        sets=["health.probe_timeout_s=0.3", "health.max_restarts=0"],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "30"},
    ).start()
    assert s.proc.wait(30) == 1
    assert s.events("probe_failed")[0]["detail"] == "timed out after 0.3 s"
    assert s.events("hung")


def test_startup_budget(serve):
    # 10 s: ample for the stand-in to be loading on a loaded machine; 120 s of loading, 30 s a shard:
    # still at its first when the budget is spent
    code, out = serve({"load_s": 120}, sets=["health.startup_timeout_s=10", "health.max_restarts=0"]).run()
    assert code == 1, out
    assert "the server did not start: not generating after 10s (last: loading weights 0% (0/4 shards))" in out


def test_a_real_start_that_dies_of_a_missing_module_is_not_restarted(tmp_path):
    """The static read cannot see an import inside a function: the server dies at its
    start. Before: restarted up to health.max_restarts, exit 1 (systemd restarts serve on).
    Now: one start, exit 2."""
    python, site = make_venv(tmp_path / "env")
    install(site, VERSION, flashinfer=False)
    (site / "sglang" / "launch_server.py").write_text(
        "# TEST FIXTURE: a server that imports, when it starts, a package the environment lacks\n"
        "def main():\n    import sm120kit_fixture_absent_package  # noqa: F401\n\n\nmain()\n"
    )
    s = Served(tmp_path / "run", python, {}, ["health.max_restarts=2"], [], {})
    code, out = s.run()
    assert code == ExitCode.ERROR, out
    assert len(s.events("started")) == 1 and s.events("restarting") == []
    assert [d["id"] for d in s.events("died")[0]["diagnoses"]] == ["missing-module"]
    assert "not restarting standin: the serving environment is incomplete" in said(out)


def test_a_fleet_whose_every_replica_lacks_a_module_exits_2(tmp_path):
    """Each replica's scheduler dies loading, for want of a kernel package (imported where
    no static read looks): each member supervisor stops with 2 after one start, and so
    does the fleet (before: each restarted up to health.max_restarts, the fleet exit 1)."""
    from support.standin import Fleet

    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", VERSION)
    fleet = Fleet(tmp_path / "fleet", python, {"die_loading": "ModuleNotFoundError: No module named 'sgl_kernel'"})
    try:
        code, out = fleet.run(timeout=120)
        assert code == ExitCode.ERROR, out
        exited = {e["member"]: e["exit_code"] for e in fleet.events("member_exited")}
        assert exited == {"replica-0": 2, "replica-1": 2, "replica-2": 2}, exited
        for name in exited:
            member = [json.loads(line) for line in (fleet.dir / name / "events.jsonl").read_text().splitlines()]
            assert [e["event"] for e in member].count("started") == 1
        assert "lacks a module (a restart cannot mend that)" in said(out)
    finally:
        fleet.cleanup()
