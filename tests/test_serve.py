"""`sm120kit serve` end to end against the sglang stand-in (tests/fixtures/sglang_standin.py,
a TEST FIXTURE: the real server needs GPUs). The supervisor runs as its own process, as
an operator runs it; real signals, real sockets, real process trees.

The profile renders for a real sglang release (0.5.23 unpacked from its wheel); the
stand-in python runs `-m sglang.launch_server` as the stand-in and everything else as
the interpreter of that environment.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from standin import Served, foreign_server, free_port, make_env_python

from sm120kit.serve import procs

VERSION = "0.5.23"
TRITON_SMEM = (
    "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 147456, Hardware limit: 101376. "
    "Reducing block sizes or `num_stages` may help."
)
DEATHS = {
    "triton-shared-memory": TRITON_SMEM,
    "dsa-page-table": "AttributeError: 'PrefillMetadata' object has no attribute 'page_table_1_flattened'",
    "cuda-out-of-memory": (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 3 has a total capacity of 95.59 GiB"
    ),
    "nccl": "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "flashinfer-no-arch": "RuntimeError: No supported CUDA architectures found for major versions [10].",
    "illegal-instruction": "RuntimeError: CUDA error: an illegal instruction was encountered",
}


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("standin-env"), VERSION)


@pytest.fixture
def serve(tmp_path, env_python):
    made: list[Served] = []

    def make(faults: dict | None = None, sets=(), extra=(), env=None) -> Served:
        served = Served(tmp_path, env_python, faults or {}, list(sets), list(extra), env or {})
        made.append(served)
        return served

    yield make
    for served in made:
        served.cleanup()


def test_ready_only_when_it_generates_with_progress_then_a_clean_stop(serve):
    s = serve({"load_s": 1.0, "shards": 4, "warmup_s": 1.0}).start()
    ready = s.wait("ready")
    phases = [e["phase"] for e in s.events("progress")]
    assert phases[0] == "loading weights" and "loading weights 100% (4/4 shards)" in phases
    assert phases[-1] == "warmup done"
    assert ready["after_s"] >= 2.0  # 1 s of loading and 1 s of 503 while warming up
    assert s.ours()  # the launcher, two schedulers and a detokenizer
    assert s.signal(signal.SIGINT) == 0
    stopped = s.wait("stopped")
    assert (
        stopped["clean"] and stopped["processes"] == 4 and stopped["sigkilled"] == [] and stopped["ports_taken"] == []
    )
    assert not s.ours()
    assert not procs.port_in_use("127.0.0.1", s.port)
    out = s.output
    assert "starting: loading weights" in out and "ready: standin generates" in out
    assert "Load weight begin" in out  # the live tail
    assert "stopped: 4 processes ended" in out


def test_503_while_starting_is_not_death_and_a_slow_start_is_waited_for(serve):
    s = serve({"load_s": 2.0, "warmup_s": 2.0}).start()
    s.wait("ready", timeout=30)
    assert s.events("died") == [] and s.events("probe_failed") == []
    assert "Uvicorn running" in (s.dir / "server.log").read_text()
    s.signal()


@pytest.mark.parametrize("signature", sorted(DEATHS))
def test_death_while_loading_is_diagnosed(serve, signature):
    s = serve({"die_loading": DEATHS[signature]}, sets=["health.max_restarts=0"])
    code, out = s.run()
    assert code == 1, out
    [died] = s.events("died")
    assert not died["ready"] and died["exit_code"] is None  # sglang SIGKILLs itself
    assert [d["id"] for d in died["diagnoses"]] == [signature]
    assert "killed by SIGKILL" in out and "the server died while starting (loading weights" in out
    assert "diagnosis: " in out and "advice:" in out
    assert "giving up: 1 failed runs in a row" in out


def test_triton_diagnosis_names_the_kernel_and_the_patch(serve):
    code, out = serve({"die_loading": TRITON_SMEM}, sets=["health.max_restarts=0"]).run()
    assert code == 1
    assert "Required: 147456" in out and "fused-MoE fp8" in out and "sm120kit patch --verify" in out


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


def test_death_after_ready_restarts(serve, tmp_path):
    s = serve(
        {
            "die_after_ready_s": 1.5,
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
    s = serve(
        {"hang_after_ready_s": 0.3, "fail_starts": 1, "counter": str(tmp_path / "starts")},
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
        {"hang_after_ready_s": 1.0},
        sets=["health.probe_timeout_s=0.3", "health.max_restarts=0"],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "30"},
    ).start()
    assert s.proc.wait(30) == 1
    assert s.events("probe_failed")[0]["detail"] == "timed out after 0.3 s"
    assert s.events("hung")


def test_startup_budget(serve):
    code, out = serve({"load_s": 30}, sets=["health.startup_timeout_s=3", "health.max_restarts=0"]).run()
    assert code == 1, out
    assert "the server did not start: not generating after 3s (last: loading weights 0% (0/4 shards))" in out


def test_stop_lets_sglang_drain_before_the_group_is_signalled(serve):
    s = serve({"drain_s": 3.0}).start()
    s.wait("ready")
    schedulers = [p for p in s.ours() if p.cmdline()[0].startswith("sglang::scheduler")]
    s.proc.send_signal(signal.SIGTERM)
    s.wait("stopping")
    time.sleep(1.0)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in schedulers)  # draining: not signalled
    assert s.proc.wait(30) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and stopped["sigkilled"] == [] and stopped["seconds"] >= 3.0
    assert "Draining requests" in (s.dir / "server.log").read_text() and not s.ours()


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(serve):
    s = serve({"ignore_sigterm": True}, sets=["health.stop_timeout_s=1"]).start()
    s.wait("ready")
    began = time.monotonic()
    assert s.signal(signal.SIGTERM) == 0
    stopped = s.wait("stopped")
    assert stopped["clean"] and len(stopped["sigkilled"]) == 4 and 1.0 <= stopped["seconds"] < 5
    assert time.monotonic() - began < 10 and not s.ours()


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


@pytest.mark.preflight
def test_a_killed_supervisor_takes_the_server_down_and_the_next_preflight_finds_the_rest(serve):
    s = serve({"orphan": True}).start()
    s.wait("ready")
    launcher = s.events("started")[0]["pid"]
    s.proc.kill()  # SIGKILL: no chance to stop anything
    s.proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(s.ours()) > 1:
        time.sleep(0.05)
    left = s.ours()
    assert (
        not psutil.pid_exists(launcher) or psutil.Process(launcher).status() == psutil.STATUS_ZOMBIE
    )  # died with its supervisor
    assert [p.cmdline()[0] for p in left] == ["sglang::scheduler_TP1"]  # what escaped on purpose

    row = next(r for r in ps(s)[1]["runs"] if r["profile"] == "standin")
    assert row["status"] == "supervisor gone" and not row["running"]

    check = serve()
    check.state = s.state
    check.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = run_check(check)
    assert code == 1
    assert f"FAIL stale processes: 1 found: pid {left[0].pid} 'sglang::scheduler_TP1" in out and "--kill-stale" in out
    code, out = run_check(check, "--kill-stale")
    assert code == 0, out
    assert f"ok   stale processes: stopped 1: pid {left[0].pid}" in out
    assert not s.ours()


@pytest.mark.preflight
@pytest.mark.parametrize("marker", [None, "glm5-nvfp4:another-state-dir"])
def test_a_healthy_server_someone_else_started_is_not_stale(serve, tmp_path, marker):
    """`sglang serve` started by hand, its launcher alive: its scheduler and detokenizer
    are named and left alone, with or without --kill-stale (stale: of a run of ours that is
    over, or orphaned). So is one that sm120kit serves from another state directory (or
    another user's): a marker unknown here proves nothing."""
    other = foreign_server(tmp_path / "other", free_port(), env={"SM120KIT_SERVE_ID": marker} if marker else None)
    try:
        children = psutil.Process(other.pid).children()
        titles = sorted(c.cmdline()[0] for c in children)
        assert titles == ["sglang::detokenizer", "sglang::scheduler_TP0"]
        s = serve()
        for extra in ((), ("--kill-stale",)):
            code, out = run_check(s, *extra)
            assert code == 0, out
            assert "stale processes: none; another sglang server, not started by sm120kit, left alone" in out
            assert all(f"pid {c.pid} " in out for c in children)
            assert all(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children) and other.poll() is None
    finally:
        other.terminate()
        other.wait(10)


@pytest.mark.preflight
def test_a_port_already_taken_is_refused_and_nothing_starts(serve):
    s = serve()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", s.port))
        taken.listen()
        code, out = s.run()
    assert code == 2
    assert f"FAIL ports: in use: {s.port} (server.port) is held by pid {os.getpid()}" in out
    assert "refusing to start standin: 1 preflight check(s) failed" in out
    assert s.events("started") == [] and s.events("preflight")[0]["ok"] is False


def test_one_supervisor_per_profile(serve):
    s = serve().start()
    s.wait("ready")
    second = serve()
    second.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = second.run()
    assert code == 2 and f"profile standin is already being served by supervisor pid {s.proc.pid}" in out
    assert s.signal() == 0


def test_api_key_reaches_the_server_and_never_the_record(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret}).start()
    s.wait("ready")
    import http.client

    def models(key: str | None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        return conn.getresponse().status

    assert models(secret) == 200 and models(None) == 401
    launcher = psutil.Process(s.events("started")[0]["pid"])
    key_file = s.dir / "api-key.yaml"
    assert (
        secret not in " ".join(launcher.cmdline()) and str(key_file) in launcher.cmdline()
    )  # the process list shows a path
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert s.signal() == 0
    assert not key_file.exists()
    assert secret in (s.dir / "server.log").read_text()  # sglang's own server_args line: the directory is private
    assert s.dir.stat().st_mode & 0o777 == 0o700
    record = "".join(
        p.read_text()
        for p in s.dir.iterdir()
        if p.is_file() and not p.name.startswith(("server.log", "supervisor.lock"))
    )
    assert secret not in record and secret not in s.output  # events, state and the live tail say $STANDIN_KEY
    assert s.events("started")[0]["argv"][-2:] == ["--config", str(key_file)] and "api_key='$STANDIN_KEY'" in s.output


@pytest.mark.preflight
def test_an_api_key_with_a_trailing_carriage_return_is_refused_and_never_printed(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret + "\r"})
    code, out = s.run()
    assert code == 2 and "FAIL api key: $STANDIN_KEY ends with a carriage return" in out, out
    assert secret not in out and "Traceback" not in out and not s.events("started")


def test_a_key_that_is_also_part_of_the_record_leaves_the_record_intact(serve):
    """Redaction by text substitution once rewrote state.json ("host": "127.$KEY.$KEY.1")."""
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": "127.0.0.1"}).start()
    s.wait("ready")
    code, doc, _ = ps(s)
    [run] = doc["runs"]
    assert code == 0 and run["host"] == "127.0.0.1" and run["status"] == "ready" and run["running"]
    assert s.events("started")[0]["argv"][-2:] == ["--config", str(s.dir / "api-key.yaml")]
    assert s.signal() == 0


def test_a_key_file_left_by_a_killed_supervisor_is_removed_by_the_next_start(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret}).start()
    s.wait("ready")
    key_file = s.dir / "api-key.yaml"
    s.proc.kill()  # SIGKILL: no finally runs
    s.proc.wait()
    assert secret in key_file.read_text()  # what it leaves behind
    again = serve(sets=["server.api_key_env=STANDIN_KEY_UNSET"])  # the next start (refused later by its preflight)
    again.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = again.run()
    assert code == 2 and not key_file.exists(), out
    assert f"removed the API key file that a killed supervisor left behind: {key_file}" in out


def test_a_full_disk_under_the_state_dir_does_not_stop_a_healthy_server(serve):
    """events.jsonl and the state file's temporary copy on /dev/full: every write of the
    record fails with ENOSPC, as on a full disk. The supervisor says so and supervises on."""
    s = serve().start()
    s.wait("ready")
    events, state_tmp = s.dir / "events.jsonl", s.dir / ".state.json.tmp"
    events.unlink()
    events.symlink_to("/dev/full")
    state_tmp.unlink(missing_ok=True)
    state_tmp.symlink_to("/dev/full")
    deadline = time.monotonic() + 10
    while "could not record" not in s.output and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # probes every 0.2 s: each one updates the state
    assert s.proc.poll() is None, s.output
    assert "could not record state.json (No space left on device)" in s.output, s.output
    assert s.output.count("could not record state.json") == 1, "said once, not at every probe"
    events.unlink()
    state_tmp.unlink()  # space again
    assert s.signal() == 0, s.output
    assert "recording state.json again" in s.output
    assert s.events("stopped")[-1]["clean"] is True


@pytest.mark.preflight
def test_api_key_variable_unset_is_refused(serve):
    code, out = serve(sets=["server.api_key_env=STANDIN_KEY_UNSET"]).run()
    assert (
        code == 2
        and "FAIL api key: server.api_key_env = STANDIN_KEY_UNSET, but $STANDIN_KEY_UNSET is empty or not set" in out
    )


@pytest.mark.preflight
def test_required_patches_are_verified_before_a_start(serve, env_python):
    """glm5-nvfp4 on an unpatched sglang 0.5.23: refused until `sm120kit patch`."""
    s = serve()
    argv = [
        sys.executable,
        "-m",
        "sm120kit",
        "serve",
        "glm5-nvfp4",
        "--python",
        str(env_python),
        "--check",
        "--no-gpu-check",
        "--set",
        f"server.port={s.port}",
        "--wide",  # each check on one line, as the assertions read it
    ]
    out = subprocess.run(argv, capture_output=True, text=True, env=s.env)
    assert out.returncode == 1
    assert (
        "FAIL patches: not in place: sglang-dsa-page-table-guard: would-apply; sglang-triton-smem-sm120: would-apply"
        in out.stdout
    )
    assert "-> run `sm120kit patch --verify`; or `sm120kit serve --no-patch-check` to start anyway" in out.stdout
    try:
        patched = subprocess.run(
            [sys.executable, "-m", "sm120kit", "patch", "--python", str(env_python)],
            capture_output=True,
            text=True,
            env=s.env,
        )
        assert patched.returncode == 0, patched.stdout + patched.stderr
        out = subprocess.run(argv, capture_output=True, text=True, env=s.env)
        assert out.returncode == 0, out.stdout
        assert "ok   patches: 6 in place, fixed upstream or not needed" in out.stdout
    finally:
        subprocess.run(
            [sys.executable, "-m", "sm120kit", "unpatch", "--python", str(env_python)],
            capture_output=True,
            env=s.env,
            check=True,
        )


def ps(s: Served) -> tuple[int, dict, str]:
    out = subprocess.run([sys.executable, "-m", "sm120kit", "ps", "--json"], capture_output=True, text=True, env=s.env)
    return out.returncode, json.loads(out.stdout), out.stderr


def run_check(s: Served, *extra: str) -> tuple[int, str]:
    argv = [*s.argv, "--check", "--wide", *extra]  # --wide: each check on one line, as the assertions read it
    proc = subprocess.run(argv, capture_output=True, text=True, env=s.env, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr
