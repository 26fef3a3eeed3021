"""`sm120kit bench --serve --vary/--variants`: the search over profile variants, end to end
against the sglang stand-in run by the real supervisor (TEST FIXTURES: the stand-in server,
whose faults follow its flags through `by_args`, and the benchmark-client stand-in, which
measures the stand-in's token rate as the real client would). Also --repeat's median and
spread, the smoke before a plain sweep, --dry-run, `bench compare RUN_DIR`, and bad input.
A module of its own: no other stand-in server may run meanwhile (it would be stale)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.standin import PROFILES, Served, make_env_python

from sm120kit.bench.analysis import Level, verdict
from sm120kit.bench.search_report import picks
from sm120kit.bench.search_state import Outcome, VariantResult

LOAD = {"load_s": 0.2, "warmup_s": 0.1, "shards": 2}
CRASH = "RuntimeError: CUDA error: an illegal instruction was encountered"
MEMORY = "RuntimeError: CUDA error: an illegal memory access was encountered"
# The stand-in's faults follow the variant's flags: the server as written makes 1500 tok/s.
FAULTS = {
    **LOAD,
    "tokens_per_s": 1500,
    "by_args": [
        {"args": "--max-running-requests 96", "faults": {"tokens_per_s": 6000}},
        {"args": "--disable-radix-cache", "faults": {"garbage": "repeat"}},
        {"args": "--max-running-requests 80", "faults": {"die_loading": CRASH}},
        {"args": "--chunked-prefill-size 2048", "faults": {"die_under_load": MEMORY}},
        {"args": "--chunked-prefill-size 4096", "faults": {"load_s": 4.0}},
    ],
}
VARIANTS = """
profile = "standin"
description = "TEST FIXTURE: one lever each way the search must handle"

[variants.fast]
description = "the stand-in's token rate follows --max-running-requests 96"
set = { "engine.max_running_requests" = 96 }

[variants.garbage]
set = { engine.radix_cache = false }

[variants.garbage-served]
description = "the same garbage, found by serve's own smoke (health.smoke)"
set = { engine.radix_cache = false, health.smoke = true }

[variants.crash]
set = { "engine.max_running_requests" = 80 }

[variants.dies]
description = "dies under the first level's load, after the smoke passed"
set = { "engine.chunked_prefill_size" = 2048 }

[variants.slow]
description = "loads for longer than its startup budget"
set = { "engine.chunked_prefill_size" = 4096, "health.startup_timeout_s" = 1.0 }

[variants.future]
set = { "engine.cuda_graphs" = false }
requires = { sglang = ">=9" }
why = "needs a release from the future"
"""


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("search-env"), "0.5.23")


def search_argv(s: Served, out: Path, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "sm120kit", "bench", "standin", "--serve", "--python", str(s.python)),
        *("--profile-dir", str(PROFILES), "--no-gpu-check", "--set", f"server.port={s.port}"),
        *("--set", "health.max_restarts=0", "--out", str(out), "--wide"),
        *("--concurrency", "4,8", "--input-len", "16", "--output-len", "16", "--prompts-per-level", "1"),
        *extra,
    ]


def run(argv: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def variant(out: Path, name: str) -> dict:
    return json.loads((out / name / "variant.json").read_text())


def test_the_search_picks_the_fast_variant_excludes_garbage_records_the_crash_and_resumes(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, FAULTS, [], [], {})
    (tmp_path / "variants.toml").write_text(VARIANTS)
    out = tmp_path / "search"
    argv = search_argv(s, out, "--variants", str(tmp_path / "variants.toml"))
    try:
        done = run(argv, s.env)
        text = done.stdout + done.stderr
        assert done.returncode == 1, text  # a variant excluded and one crashed: findings
        assert not s.ours()  # every server of the search is gone

        names = ("as-written", "fast", "garbage", "garbage-served", "crash", "dies", "slow")
        assert {n: variant(out, n)["status"] for n in names} == {
            "as-written": "done",
            "fast": "done",
            "garbage": "excluded",
            "garbage-served": "excluded",
            "crash": "crashed",
            "dies": "crashed",
            "slow": "crashed",
        }
        assert "the server failed during the sweep: died" in variant(out, "dies")["why"] and any(
            "illegal memory access" in d for d in variant(out, "dies")["diagnosis"]
        )
        assert (
            "start timeout" in variant(out, "slow")["why"] and "not generating after 1s" in variant(out, "slow")["why"]
        )
        assert not (out / "future").exists()  # skipped: nothing started
        for name in ("as-written", "fast", "garbage"):
            assert variant(out, name)["stop"]["exit_code"] == 0 and variant(out, name)["stop"]["clean"]
        garbage = variant(out, "garbage")
        assert garbage["why"].startswith("smoke FAILED") and not garbage["levels"]
        served = variant(out, "garbage-served")
        assert served["why"].startswith("smoke FAILED") and served["why"].endswith("(health.smoke)")
        assert any(d.startswith("garbage:") for d in served["diagnosis"])
        assert not (out / "garbage" / "run.json").exists()  # excluded: not swept
        crash = variant(out, "crash")
        assert "died" in crash["why"] and "loading weights" in crash["why"]
        assert any("illegal instruction" in d for d in crash["diagnosis"])
        assert CRASH in (out / "crash" / "server.log").read_text()

        summary = (out / "summary.md").read_text()
        assert "overall (each variant at its best level): fast" in summary
        assert "over as-written" in summary or "over the next, as-written" in summary
        assert "excluded by the smoke: garbage: smoke FAILED" in summary
        assert "crashed: crash:" in summary and "a GPU kernel executed an illegal instruction" in summary
        assert "skipped: future: needs sglang>=9; installed: 0.5.23 (needs a release from the future)" in summary
        assert "--set engine.max_running_requests=96" in summary and "max_running_requests = 96" in summary
        assert "to adopt fast:" in done.stdout
        rows = list(csv.DictReader((out / "results.csv").open()))
        assert {(r["variant"], r["concurrency"]) for r in rows if r["variant"] != "dies"} == {
            ("as-written", "4"),
            ("as-written", "8"),
            ("fast", "4"),
            ("fast", "8"),
        }
        # the level it died in is kept, marked crashed, its requests failed (the next ran only
        # if its sm120kit serve had not given up yet)
        died_in = [r for r in rows if r["variant"] == "dies"]
        assert died_in[0]["concurrency"] == "4" and len(died_in) <= 2
        assert all(r["status"] == "crashed" and int(r["failed"]) > 0 for r in died_in)
        best = {r["concurrency"]: r for r in rows if r["variant"] == "fast"}
        base = {r["concurrency"]: r for r in rows if r["variant"] == "as-written"}
        assert all(float(best[c]["total_throughput"]) > 1.5 * float(base[c]["total_throughput"]) for c in best)
        assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        search = json.loads((out / "search.json").read_text())
        assert search["status"] == {
            "as-written": "done",
            "fast": "done",
            "garbage": "excluded",
            "garbage-served": "excluded",
            "crash": "crashed",
            "dies": "crashed",
            "slow": "crashed",
            "future": "skipped",
        }

        cmp = run([sys.executable, "-m", "sm120kit", "bench", "compare", str(out), "--wide"], s.env)
        assert cmp.returncode == 0, cmp.stderr
        table = cmp.stdout.strip().split("\n\n")[0].splitlines()[1:]  # the title, the table; then the verdicts
        assert table[0].split() == ["variant", "status", "c4", "c8"]
        assert [row.split()[:2] for row in table[1:]] == [
            ["as-written", "done"],
            ["fast", "done"],
            ["garbage", "excluded"],
            ["garbage-served", "excluded"],
            ["crash", "crashed"],
            ["dies", "crashed"],
            ["slow", "crashed"],
            ["future", "skipped"],
        ]
        assert "as-written alone: 8 vs 4:" in cmp.stdout

        again = run(argv, s.env)  # the same --out: everything is done already
        assert again.returncode == 1, again.stdout + again.stderr
        assert "starting the server" not in again.stdout
        for name in names:
            assert f"{name}: already {variant(out, name)['status']} in this directory, not run again" in again.stdout
        assert "already done in the directory, not run again: as-written, fast, garbage, garbage-served" in again.stdout
        # a crash may have been the node's (a port in use): how to run it again is said
        assert f"crash: already crashed in this directory, not run again (remove {out / 'crash'} to run it" in (
            again.stdout.replace("\n  ", " ")
        )
    finally:
        s.cleanup()


def test_an_interrupted_search_keeps_what_is_done_and_a_rerun_goes_on(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, FAULTS, [], [], {})
    out = tmp_path / "search"
    argv = search_argv(s, out, "--vary", "engine.max_running_requests=96", "--concurrency", "4")
    slow = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"sleep_s": 1.0})}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slow)
    try:
        # the first variant whole and the second's start: a bound on a loaded machine
        end = time.monotonic() + 180
        while time.monotonic() < end and proc.poll() is None:
            if (out / "max_running_requests=96" / "c4.log").exists():  # the second variant's sweep is on
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the second variant's sweep did not begin (exit {proc.poll()}); {sorted(out.rglob('*'))}")
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stdout + stderr
        assert not s.ours()
        assert s.events("stopped")[-1]["clean"]
        assert variant(out, "as-written")["status"] == "done"
        assert variant(out, "max_running_requests=96")["status"] == "interrupted"
        assert f"rerun with --out {out} to go on" in stderr

        again = run([*argv, "--json"], s.env)  # the document alone on stdout; the rest on stderr
        assert again.returncode == 0, again.stdout + again.stderr
        assert "as-written: already done in this directory, not run again" in again.stderr
        assert again.stderr.count("starting the server") == 1
        assert variant(out, "max_running_requests=96")["status"] == "done"
        doc = json.loads(again.stdout)
        assert [(v["name"], v["status"], v["resumed"]) for v in doc["variants"]] == [
            ("as-written", "done", True),
            ("max_running_requests=96", "done", False),
        ]
        assert doc["picks"][-1]["best"] == "max_running_requests=96" and doc["exit_code"] == 0
        assert doc["adopt"]["set"][-1] == "engine.max_running_requests=96"
        # pasted as printed, it serves the winner: the profile directory and python the search had
        adopt = doc["adopt"]["command"].split()
        assert adopt[:3] == ["sm120kit", "serve", "standin"] and ["--profile-dir", str(PROFILES)] == adopt[3:5]
        assert adopt[5:7] == ["--python", str(s.python)]
        served = run([sys.executable, "-m", "sm120kit", *adopt[1:], "--dry-run"], s.env)
        assert served.returncode == 0 and "--max-running-requests 96" in served.stdout, served.stderr
        assert not s.ours()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        s.cleanup()


def test_a_server_stopped_by_someone_else_during_its_sweep_is_not_done(env_python, tmp_path):
    """The variant's `sm120kit serve` ends before the search stops it (someone stopped it,
    its supervisor was killed): its levels ran against no server, so the variant is
    recorded as crashed, with who stopped it, not as done."""
    import psutil

    # The second variant's server notes each request it gets (fault requests_log, by its flags
    # alone): its GET /v1/models are bench's reachability check, then the client stand-in's
    # ready check, after which the client is in its sleep_s.
    requests = tmp_path / "requests.jsonl"
    noted = {"args": "--max-running-requests 96", "faults": {"requests_log": str(requests)}}
    s = Served(tmp_path / "own", env_python, {**FAULTS, "by_args": [*FAULTS["by_args"], noted]}, [], [], {})
    out = tmp_path / "search"
    argv = search_argv(s, out, "--vary", "engine.max_running_requests=96", "--no-smoke")  # levels 4 and 8
    # each level's client sleeps 3 s once it found the server ready: the SIGTERM below lands meanwhile
    slow = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"sleep_s": 3.0})}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slow)

    def ready_checks() -> int:
        lines = requests.read_text().splitlines() if requests.exists() else []
        return sum(1 for line in lines if json.loads(line)["path"] == "/v1/models")

    try:
        # the first variant whole and the second's start: a bound on a loaded machine
        end = time.monotonic() + 180
        while time.monotonic() < end and proc.poll() is None and ready_checks() < 2:
            time.sleep(0.05)
        assert ready_checks() >= 2, f"no ready check by the client (exit {proc.poll()}); {sorted(out.rglob('*'))}"
        bench = psutil.Process(proc.pid)

        def cmdlines() -> list[tuple[psutil.Process, list[str]]]:
            found = []
            for c in bench.children():
                with contextlib.suppress(psutil.Error):
                    found.append((c, c.cmdline()))
            return found

        # the client stand-in found the server ready and is in its sleep_s
        assert any("bench_serving" in " ".join(c) for _, c in cmdlines()), cmdlines()
        [child] = [p for p, c in cmdlines() if c == bench.cmdline()]  # the forked serve child
        child.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 1, stdout + stderr
        assert not s.ours()
        gone = variant(out, "max_running_requests=96")
        assert gone["status"] == "crashed", gone
        assert "the server stopped during the sweep (SIGTERM to its sm120kit serve; " in gone["why"]
        assert "crashed: max_running_requests=96: the server stopped during the sweep" in stdout
        # the next level is not run against no server (the client would wait a minute for it)
        assert not (out / "max_running_requests=96" / "c8.log").exists()
        assert variant(out, "as-written")["status"] == "done"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        s.cleanup()


def test_a_variant_the_preflight_refuses_is_tried_again_on_a_rerun(env_python, tmp_path):
    """A refusal by serve's preflight (a port in use, a stale process, busy GPUs) is the
    node's state, not the variant's: recorded as refused (exit 1), and a rerun with the
    same --out tries it again rather than skip it as finished."""
    import socket

    s = Served(tmp_path / "own", env_python, FAULTS, [], [], {})
    out = tmp_path / "search"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = search_argv(s, out, "--vary", f"server.port={port}", "--concurrency", "4", "--no-smoke")
        try:
            done = run(argv, s.env)
            assert done.returncode == 1, done.stdout + done.stderr
            refused = variant(out, f"port={port}")
            assert refused["status"] == "refused" and refused["why"].startswith("refused by the preflight: ports")
            assert f"refused: port={port}: refused by the preflight" in done.stdout
            assert "a rerun with the same --out tries it again" in done.stdout
            again = run(argv, s.env)
            assert again.returncode == 1, again.stdout + again.stderr
            assert "as-written: already done" in again.stdout and f"port={port}: already" not in again.stdout
            assert again.stdout.count("starting the server") == 1
            assert not s.ours()
        finally:
            s.cleanup()


def test_a_stop_that_leaves_a_process_ends_the_search(tmp_path, monkeypatch, cli):
    """serve's stop proves what it left (exit code 3, UNCLEAN, and its `stopped` event): the
    search records it and stops there rather than start the next variant on a node that is
    not free. (The stand-in cannot outlive the supervisor's stop: the supervisor is its
    subreaper and kills what left its tree, tests/serve/test_stop.py; so the variant's run is faked.)"""
    from sm120kit.bench import search, search_events
    from sm120kit.bench.command import BenchOptions
    from sm120kit.bench.variants import Plan, Planned, Variant, VariantStatus
    from sm120kit.profiles.loader import load_profile

    profile = load_profile("standin", [str(PROFILES)])
    names = ["as-written", "a", "b"]
    plan = Plan("standin", "--vary", [Planned(Variant(n), VariantStatus.RUNNABLE, "", profile) for n in names])
    events = tmp_path / "events.jsonl"
    left = {"event": "stopped", "clean": False, "ports_taken": [], "on_gpu": None, "left": ["pid 4242 sglang::x"]}
    events.write_text(json.dumps(left) + "\n")
    ran = []

    def fake(options, planned, vdir, target, progress, width, out):
        ran.append(planned.name)
        vdir.mkdir(parents=True)
        stop = search_events.stop_from_events(search_events.events_since(events, 0), 3 if planned.name == "a" else 0)
        why = stop.get("said", "") if planned.name == "a" else ""
        result = VariantResult(planned.name, [], Outcome.DONE, why, [runs(4, [100.0])], stop=stop)
        (vdir / "variant.json").write_text(json.dumps(result.as_json()))
        return result

    monkeypatch.setattr(search, "_run_variant", fake)
    progress = type("Quiet", (), {"__getattr__": lambda self, name: lambda *a, **k: None})()
    options = search.SearchOptions(BenchOptions(levels=[4], out=tmp_path / "out"), None)
    result = search.search(options, plan, [], None, progress, None, None)
    assert ran == ["as-written", "a"] and result.exit_code == 3
    assert result.results[1].why == "its stop left: pid 4242 sglang::x"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "STOPPED EARLY: the stop of a left a process, port or GPU memory of its server" in summary
    assert "not run: b (a rerun with the same --out runs them)" in summary
    # `bench compare RUN_DIR` read it: it exits 0 (printed), and its --json says the same
    code, out, err = cli("bench", "compare", tmp_path / "out", "--json")
    assert code == 0 and json.loads(out)["exit_code"] == 0, out + err


def test_repeat_gives_the_median_and_spread_and_close_variants_are_within_noise(env_python, tmp_path):
    """Two variants the stand-in serves at the same rate, measured on a noisy machine (the
    client stand-in scales its runs by 0.8, 1.0, 1.25): no best variant is named."""
    s = Served(tmp_path / "own", env_python, {**FAULTS, "tokens_per_s": 8000}, [], [], {})
    out = tmp_path / "search"
    noisy = {
        **s.env,
        "SGLANG_STANDIN_BENCH": json.dumps(
            {"jitter": {"4": [0.8, 1.0, 1.25], "8": [0.8, 1.0, 1.25]}, "counter": str(tmp_path / "runs")}
        ),
    }
    argv = search_argv(s, out, "--vary", "engine.max_running_requests=64", "--repeat", "3", "--no-smoke")
    try:
        done = run(argv, noisy)
        assert done.returncode == 0, done.stdout + done.stderr
        assert not s.ours()
        for name in ("as-written", "max_running_requests=64"):
            level = variant(out, name)["levels"][0]
            assert len(level["runs"]) == 3 and level["total_min"] < level["figures"]["total_throughput"]
            assert level["total_max"] > level["figures"]["total_throughput"]
            assert (out / name / "c4.r3.jsonl").exists() and (out / name / "c8.r1.log").exists()
            assert variant(out, name)["smoke"] is None  # --no-smoke
        assert "within noise of it (their runs overlap" in done.stdout and "no best variant here" in done.stdout
        assert "to adopt" not in done.stdout
        rows = list(csv.DictReader((out / "results.csv").open()))
        assert all(
            r["runs"] == "3" and float(r["total_throughput_min"]) < float(r["total_throughput_max"]) for r in rows
        )
        assert "median of the runs ± half their spread" in (out / "summary.md").read_text()
    finally:
        s.cleanup()


def test_dry_run_lists_the_variants_and_the_time_and_starts_nothing(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, FAULTS, [], [], {})
    (tmp_path / "variants.toml").write_text(VARIANTS)
    out = tmp_path / "search"
    argv = search_argv(s, out, "--variants", str(tmp_path / "variants.toml"), "--dry-run", "--repeat", "2")
    done = run(argv, s.env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert next(x for x in done.stdout.splitlines() if x.startswith("future")).split()[:2] == ["future", "skipped"]
    assert "skipped: future: needs sglang>=9; installed: 0.5.23 (needs a release from the future)" in done.stdout
    # no start measured: each start counts at its whole budget, so the time is a bound, said so
    assert "estimated time: 7 variant(s) to run, up to ~" in done.stdout and "in all at most" in done.stdout
    assert "start up to 120 s (health.startup_timeout_s)" in done.stdout and "2 level(s) x 2 run(s)" in done.stdout
    assert "nothing was started" in done.stdout
    assert not out.exists() and not s.dir.exists() and not s.ours()
    doc = json.loads(run([*argv, "--json"], s.env).stdout)
    assert [v["status"] for v in doc["plan"]["variants"]] == ["runnable"] * 7 + ["skipped"]
    assert doc["estimate"]["seconds"] > 0


def test_a_plain_sweep_runs_the_smoke_first_and_marks_a_failure(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, {**LOAD, "garbage": "bang"}, [], [], {})
    out = tmp_path / "r"
    argv = [
        *(sys.executable, "-m", "sm120kit", "bench", "standin", "--serve", "--python", str(env_python)),
        *("--profile-dir", str(PROFILES), "--no-gpu-check", "--set", f"server.port={s.port}", "--out", str(out)),
        *("--concurrency", "4,8", "--input-len", "16", "--output-len", "8", "--wide"),
    ]
    plan = json.dumps({"total": {"4": 100, "8": 180}})
    done = run(argv, {**s.env, "SGLANG_STANDIN_BENCH": plan})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "smoke FAILED" in done.stdout and "these figures are of a server that answers wrong" in done.stdout
    doc = json.loads((out / "run.json").read_text())
    assert doc["smoke"]["passed"] is False and [lv["concurrency"] for lv in doc["levels"]] == [4, 8]  # still swept
    assert "**smoke FAILED" in (out / "summary.md").read_text()
    done = run([*argv, "--no-smoke", "--repeat", "2"], {**s.env, "SGLANG_STANDIN_BENCH": plan})
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["smoke"] == {"skipped": "--no-smoke"} and doc["repeat"] == 2
    assert [len(lv["runs"]) for lv in doc["levels"]] == [2, 2] and (out / "c8.r2.jsonl").exists()
    assert "total spread" in done.stdout and "each level: the median of 2 runs" in done.stdout
    assert not s.ours()


# -- bad input: exit 2, a clear message, nothing started ---------------------------------


BAD_FILES = {
    "unknown-top": (
        'profiles = "standin"\n[variants.a]\nset = { "engine.radix_cache" = false }\n',
        "did you mean 'profile'",
    ),
    "unknown-variant-key": ('[variants.a]\nsets = { "engine.radix_cache" = false }\n', "did you mean 'set'"),
    "bad-name": ('[variants."Fast!"]\nset = { "engine.radix_cache" = false }\n', "a variant name is lower-case"),
    "bad-range": (
        '[variants.a]\nset = { "engine.radix_cache" = false }\nrequires = { sglang = "=>0.5" }\n',
        "is not a PEP 440 version range",
    ),
    "unknown-profile-key": ('[variants.a]\nset = { "engine.radix_cach" = false }\n', "did you mean engine.radix_cache"),
    "wrong-type": ('[variants.a]\nset = { "engine.max_running_requests" = "many" }\n', "expected an integer"),
    "empty": ('profile = "standin"\n', "no [variants.NAME] tables"),
    "reserved": ('[variants."summary.md"]\nset = { "engine.radix_cache" = false }\n', "names its directory"),
    "as-written": ('[variants.as-written]\nset = { "engine.radix_cache" = false }\n', "the profile as written"),
}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--vary", "engine.max_runing_requests=64,96"], "did you mean engine.max_running_requests?"),
        (["--vary", "engine.cuda_graphs=true,maybe"], "--vary engine.cuda_graphs=maybe: profile standin is not valid"),
        (["--vary", "engine.max_running_requests=0,96"], "--vary engine.max_running_requests=0: profile standin"),
        (["--vary", "engine.max_running_requests="], "an empty list"),
        (["--vary", "engine.max_running_requests=64,,96"], "an empty value in the list"),
        (["--vary", "engine.max_running_requests=64,96,64"], "64 is in the list twice"),
        (["--vary", "engine.radix_cache=true", "--vary", "engine.radix_cache=false"], "is given twice"),
        (["--vary", "nokey"], "expected KEY=V1,V2"),
        (["--variants", "no-such-variants"], "no variants file of that name"),
        (["--variants", "x.toml", "--vary", "engine.radix_cache=false"], "two ways to name the variants"),
        (["--dry-run"], "--dry-run plans a search"),
        (["--repeat", "0"], "--repeat 0"),
        *((["--variants", f"FILE:{k}"], m) for k, (_, m) in BAD_FILES.items()),
    ],
)
def test_bad_input_is_refused_before_anything_starts(cli, env_python, tmp_path, monkeypatch, extra, message):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    if extra[1:2] and extra[1].startswith("FILE:"):
        body, _ = BAD_FILES[extra[1][5:]]
        (tmp_path / "v.toml").write_text(body)
        extra = [extra[0], str(tmp_path / "v.toml")]
    argv = ["bench", "standin", "--serve", "--python", env_python, "--profile-dir", PROFILES, "--no-gpu-check"]
    code, out, err = cli(*argv, "--out", tmp_path / "out", *extra)
    assert code == 2, out + err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("option", ["--vary", "--variants"])
def test_a_search_needs_serve(cli, option):
    value = "engine.radix_cache=false" if option == "--vary" else "glm5-nvfp4"
    code, _, err = cli("bench", "standin", "--profile-dir", PROFILES, option, value)
    assert code == 2 and f"{option} starts a server per variant: it needs --serve" in err


def test_a_rerun_with_other_settings_is_refused(cli, env_python, tmp_path, monkeypatch):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "search.json").write_text(json.dumps({"settings": {"profile": "standin", "levels": [1, 2]}}))
    argv = ["bench", "standin", "--serve", "--python", env_python, "--profile-dir", PROFILES, "--out", out]
    code, _, err = cli(*argv, "--vary", "engine.radix_cache=false", "--concurrency", "4,8")
    assert code == 2 and "holds a search with other settings" in err and "levels: [1, 2] then, [4, 8] now" in err


def test_compare_run_dir_needs_a_search_directory(cli, tmp_path):
    (tmp_path / "run.json").write_text("{}")
    code, _, err = cli("bench", "compare", tmp_path)
    assert code == 2 and "is not a search directory" in err and "bench compare BEFORE AFTER" in err


def test_the_shipped_variants_file_is_found_by_name(env_python, tmp_path, monkeypatch, cli):
    """--variants NAME: variants/NAME.toml in a profile directory, the shipped one last."""
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    argv = ["bench", "glm5-nvfp4", "--serve", "--python", env_python, "--variants", "glm5-nvfp4", "--dry-run"]
    code, out, err = cli(*argv, "--json")
    assert code == 1, err  # env_python is unpatched: serve would refuse glm5-nvfp4, and the plan says so
    doc = json.loads(out)
    assert doc["plan"]["variants"][0]["status"] == "refused" and "patches" in doc["plan"]["variants"][0]["why"]
    assert Path(doc["plan"]["source"]).parts[-3:] == ("profiles", "variants", "glm5-nvfp4.toml")
    assert doc["plan"]["variants"][0]["name"] == "as-written" and len(doc["plan"]["variants"]) > 1


# -- the variants, parsed ----------------------------------------------------------------


def test_vary_lists_make_the_cartesian_product_named_after_the_values():
    from sm120kit.bench.variant_reading import split_values, vary_variants
    from sm120kit.bench.variants import profile_snippet

    assert split_values('1, "a,b" ,[2,3],{ x = 1, y = 2 }') == ["1", '"a,b"', "[2,3]", "{ x = 1, y = 2 }"]
    found = vary_variants(["engine.max_running_requests=1024,2048", "engine.cuda_graphs=true,false"])
    assert [v.name for v in found] == [
        "max_running_requests=1024,cuda_graphs=true",
        "max_running_requests=1024,cuda_graphs=false",
        "max_running_requests=2048,cuda_graphs=true",
        "max_running_requests=2048,cuda_graphs=false",
    ]
    assert found[1].sets == ("engine.max_running_requests=1024", "engine.cuda_graphs=false")
    snippet = profile_snippet("glm5-nvfp4", ("engine.max_running_requests=2048", 'env.NCCL_P2P_LEVEL="SYS"'))
    assert snippet == (
        'extends = "glm5-nvfp4"\n\n[engine]\nmax_running_requests = 2048\n\n[env]\nNCCL_P2P_LEVEL = "SYS"'
    )


def test_a_variant_the_same_as_the_profile_is_skipped(env_python, tmp_path, monkeypatch, cli):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    argv = ["bench", "standin", "--serve", "--python", env_python, "--profile-dir", PROFILES, "--dry-run"]
    code, out, err = cli(*argv, "--vary", "engine.radix_cache=true,false", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [(v["name"], v["status"], v["why"]) for v in doc["plan"]["variants"]] == [
        ("as-written", "runnable", ""),
        ("radix_cache=true", "skipped", "the same profile as as-written (nothing it sets differs)"),
        ("radix_cache=false", "runnable", ""),
    ]


# -- the verdicts, on numbers ------------------------------------------------------------


def runs(c: int, totals: list[float]) -> Level:
    figures = [{"total_throughput": t, "completed": 32} for t in totals]
    median = sorted(totals)[len(totals) // 2]
    return Level(c, 32, {"total_throughput": median, "completed": 32}, "", figures)


def test_a_gain_within_the_spread_of_the_threshold_is_said_to_be_within_noise():
    """The field report's noisy sweep: concurrency 8 moved from 318.6 to 258.1 tok/s between
    two runs. Over three runs each, the step straddles the 10% threshold: neither
    "plateaued" nor "still scaling", but within noise."""
    v = verdict([runs(4, [280.0, 290.0, 300.0]), runs(8, [258.1, 300.0, 318.6])])
    assert v.plateau_from is None
    assert "8 vs 4: +3.4% (runs: -14.0% .. +13.8%) — within noise" in v.lines[0]
    assert "each level: the median of 3 runs; spread = lowest .. highest run" in v.lines[2]
    tight = verdict([runs(4, [280.0, 290.0, 300.0]), runs(8, [292.0, 295.0, 298.0])])
    assert tight.plateau_from == 4 and "plateaued" in tight.lines[0]
    scaling = verdict([runs(4, [280.0, 290.0, 300.0]), runs(8, [500.0, 520.0, 540.0])])
    assert "still scaling" in scaling.lines[0]


def test_a_crash_is_told_from_the_supervisor_record(tmp_path):
    from sm120kit.bench.search_events import crash_from_events, events_since

    events = tmp_path / "events.jsonl"
    refused = {
        "event": "preflight",
        "ok": False,
        "checks": [{"check": "ports", "status": "fail", "detail": "30000 is in use by pid 7"}],
    }
    events.write_text(json.dumps(refused) + "\n")
    assert (
        crash_from_events(events_since(events, 0), "did not get ready")[0]
        == "refused by the preflight: ports: 30000 is in use by pid 7"
    )
    timeout = {
        "event": "start_timeout",
        "detail": "not generating after 5s",
        "phase": "loading weights",
        "ready": False,
    }
    events.write_text(json.dumps(timeout) + "\n" + json.dumps({"event": "gave_up"}) + "\n")
    why, diagnoses = crash_from_events(events_since(events, 0), "did not get ready")
    assert why == "gave up after 1 failed start(s); last: start timeout (loading weights): not generating after 5s"
    assert diagnoses == []


def test_the_best_variant_is_named_only_past_the_spread():
    def result(name: str, totals: list[float]) -> VariantResult:
        return VariantResult(name, [], Outcome.DONE, levels=[runs(64, totals)])

    found, lines = picks([result("as-written", [100, 104, 108]), result("a", [102, 106, 110])], True)
    assert found[0].best is None and found[0].leader == "a" and "within noise of it" in lines[0]
    found, lines = picks([result("as-written", [100, 104, 108]), result("a", [120, 125, 130])], True)
    assert found[0].best == "a" and "+20.2% over the next, as-written (104.0)" in lines[0]


def test_a_level_whose_requests_failed_is_not_ranked():
    """A variant that drops requests at a level is not the best there (its figure is not of
    the same work), and the report says why it was left out."""
    failing = runs(64, [200.0])
    failing.figures["completed"] = failing.runs[0]["completed"] = 16
    found, lines = picks(
        [
            VariantResult("as-written", [], Outcome.DONE, levels=[runs(64, [100.0])]),
            VariantResult("a", [], Outcome.DONE, levels=[failing]),
        ],
        False,
    )
    assert [(p.concurrency, p.best) for p in found] == [(64, "as-written"), (None, "as-written")]
    assert "not ranked: a at concurrency 64: 16 of 32 requests failed" in lines


def test_a_damaged_search_file_is_refused_with_what_to_do(cli, env_python, tmp_path, monkeypatch):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "search.json").write_text("{not json")
    argv = ["bench", "standin", "--serve", "--python", env_python, "--profile-dir", PROFILES, "--out", out]
    code, _, err = cli(*argv, "--vary", "engine.radix_cache=false", "--dry-run")
    assert code == 2 and f"{out / 'search.json'} cannot be read" in err, err
    assert "that variant runs again" not in err and "give another --out" in err, err
