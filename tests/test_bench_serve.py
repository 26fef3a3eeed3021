"""`sm120kit bench --serve`: the profile's server started with `sm120kit serve` for the
sweep and stopped after it (the sglang and benchmark-client stand-ins are TEST FIXTURES).
A module of its own: no other stand-in server may run meanwhile (it would be stale)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.standin import PROFILES, Served, make_env_python


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("bench-env"), "0.5.23")


def test_serve_starts_the_server_for_the_sweep_and_stops_it(env_python, tmp_path):
    """--serve: `sm120kit serve` up until it generates, the sweep, then its clean stop."""
    s = Served(tmp_path / "own", env_python, {"load_s": 0.3}, [], [], {})
    argv = bench_serve_argv(s, env_python, tmp_path / "r", "--concurrency", "64,128")
    env = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"total": {"64": 757, "128": 806}})}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "starting the server: serve standin --quiet" in done.stdout
        and "stopped the server (sm120kit serve exit code 0)" in done.stdout
    )
    assert [e["event"] for e in s.events()][-2:] == ["stopping", "stopped"] and s.events("stopped")[0]["clean"]
    assert [lv["concurrency"] for lv in json.loads((tmp_path / "r" / "run.json").read_text())["levels"]] == [64, 128]
    assert not s.ours()


def test_serve_that_cannot_start_benchmarks_nothing(env_python, tmp_path):
    s = Served(
        tmp_path / "own",
        env_python,
        {"die_loading": "RuntimeError: CUDA error: an illegal instruction was encountered"},
        [],
        [],
        {},
    )
    argv = bench_serve_argv(s, env_python, tmp_path / "r", "--set", "health.max_restarts=0")
    done = subprocess.run(argv, capture_output=True, text=True, env=s.env, timeout=120)
    assert (
        done.returncode == 2
        and "the server for standin did not get ready" in done.stderr
        and "nothing was benchmarked" in done.stderr
    )
    assert not (tmp_path / "r").exists()


def test_a_server_with_an_api_key(env_python, tmp_path):
    """The profile's key goes to the client as OPENAI_API_KEY (what sglang's client sends)."""
    s = Served(tmp_path / "own", env_python, {"load_s": 0.2}, [], [], {"BENCH_KEY": "sk-bench-secret"})
    argv = bench_serve_argv(
        s, env_python, tmp_path / "r", "--set", "server.api_key_env=BENCH_KEY", "--concurrency", "64"
    )
    env = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"total": {"64": 757}})}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sk-bench-secret" not in done.stdout + done.stderr + (tmp_path / "r" / "run.json").read_text()
    del env["BENCH_KEY"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "server.api_key_env is BENCH_KEY, but $BENCH_KEY is empty or not set" in done.stderr


def bench_serve_argv(s: Served, env_python: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sm120kit",
        "bench",
        "standin",
        "--serve",
        "--python",
        str(env_python),
        "--profile-dir",
        str(PROFILES),
        "--no-gpu-check",
        "--set",
        f"server.port={s.port}",
        "--out",
        str(out),
        *extra,
    ]


def first_level_done(out: Path, proc: subprocess.Popen) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end and proc.poll() is None:
        if (out / "run.json").exists() and json.loads((out / "run.json").read_text())["levels"]:
            return
        time.sleep(0.05)
    raise AssertionError("no level finished")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_mid_sweep_stops_the_server_and_keeps_the_finished_levels(env_python, tmp_path, sig):
    """Ctrl-C (the terminal's SIGINT reaches bench alone: the server runs in a session of
    its own) or SIGTERM: the supervisor's clean stop, exit 130, the finished levels kept."""
    s = Served(tmp_path / "own", env_python, {"load_s": 0.2}, [], [], {})
    out = tmp_path / "r"
    env = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"total": {"32": 438, "64": 757}, "sleep_s": 3.0})}
    argv = bench_serve_argv(s, env_python, out, "--concurrency", "32,64")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first_level_done(out, proc)
    os.kill(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "stopped the server (sm120kit serve exit code 0)" in stdout
    assert [e["event"] for e in s.events()][-2:] == ["stopping", "stopped"] and s.events("stopped")[0]["clean"]
    assert [lv["concurrency"] for lv in json.loads((out / "run.json").read_text())["levels"]] == [32]
    assert not s.ours()


def test_a_bench_killed_outright_still_stops_its_server(env_python, tmp_path):
    """SIGKILL leaves bench no chance: the supervisor, tied to it, stops the server itself."""
    s = Served(tmp_path / "own", env_python, {"load_s": 0.2}, [], [], {})
    out = tmp_path / "r"
    env = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"total": {"32": 438, "64": 757}, "sleep_s": 3.0})}
    argv = bench_serve_argv(s, env_python, out, "--concurrency", "32,64")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    first_level_done(out, proc)
    proc.kill()
    proc.wait()
    end = time.monotonic() + 30
    while time.monotonic() < end and not s.events("stopped"):
        time.sleep(0.1)
    assert s.events("stopped") and s.events("stopped")[0]["clean"], [e["event"] for e in s.events()]
    assert not s.ours()


def test_json_keeps_stdout_for_the_document(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, {"load_s": 0.2}, [], [], {})
    argv = bench_serve_argv(s, env_python, tmp_path / "r", "--concurrency", "64", "--json")
    env = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"total": {"64": 757}})}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["exit_code"] == 0 and [lv["concurrency"] for lv in doc["levels"]] == [64] and doc["finished"]
    assert "preflight for standin" in done.stderr and "stopped the server" in done.stderr


def _serve_child(monkeypatch, raised: BaseException, debug: bool = False) -> int:
    """serving._serve in a forked child as `served` runs it, with serve() raising `raised`."""
    import multiprocessing

    from sm120kit.bench import serving

    def serve(*args):
        raise raised

    monkeypatch.setattr(serving, "serve", serve)
    child = multiprocessing.get_context("fork").Process(
        target=serving._serve, args=(os.getpid(), True, None, None, None, None, None, debug)
    )
    child.start()
    child.join(30)
    return child.exitcode


@pytest.mark.parametrize("debug", [False, True])
def test_a_bug_in_the_serve_child_is_an_internal_error(monkeypatch, capfd, debug):
    """As `sm120kit serve` says it: one line and 2 (1 would read as "gave up"); the traceback with --debug."""
    assert _serve_child(monkeypatch, RuntimeError("boom"), debug) == 2
    err = capfd.readouterr().err
    if debug:
        assert "Traceback" in err and "RuntimeError: boom" in err
    else:
        assert err.startswith("sm120kit: internal error: RuntimeError: boom\n  rerun with --debug")
        assert "Traceback" not in err


def test_ctrl_c_in_the_serve_child_is_interrupted(monkeypatch, capfd):
    assert _serve_child(monkeypatch, KeyboardInterrupt()) == 130
    assert "Traceback" not in capfd.readouterr().err


def test_the_event_tail_reads_only_whole_new_lines(tmp_path):
    from sm120kit.bench.serving import EventTail
    from sm120kit.serve.status import EventKind

    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "started"}\n')
    tail = EventTail(path)
    assert tail.new() == []
    with path.open("a") as fh:
        fh.write('{"event": "progress"}\n{"event": "rea')
    assert tail.new() == [EventKind.PROGRESS]
    with path.open("a") as fh:
        fh.write('dy"}\n')
    assert tail.new() == [EventKind.READY] and tail.new() == []
