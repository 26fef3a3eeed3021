"""`sm120kit smoke`: the task generator and its checks, the garbage detectors, the serve
machine's smoke gate, and the smoke end to end against the sglang stand-in (TEST FIXTURE:
the real server needs GPUs) served by `sm120kit serve`: healthy, each kind of garbage,
wrong only under load, logprobs shifted against a recorded baseline; bad input."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.http_server import http_served
from support.standin import PROFILES, STANDIN, Served, free_port, make_env_python

from sm120kit.exit_codes import ExitCode
from sm120kit.quality import baseline, detectors, tasks
from sm120kit.quality.command import smoke
from sm120kit.quality.options import SmokeOptions, options_for
from sm120kit.serve.machine import Machine, Policy, Probe, ServerSpec, Smoke, Spawn, Stop
from sm120kit.serve.probe import ProbeResult
from sm120kit.serve.status import EventKind, RunStatus

FAST = {"load_s": 0.1, "warmup_s": 0.05}
SLOW_BOOT_S = 120  # a bound on a loaded machine: the wait returns once ready

# -- the tasks ---------------------------------------------------------------------------


def test_the_tasks_are_generated_from_the_seed_alone():
    first, again, other = tasks.generate(0), tasks.generate(0), tasks.generate(1)
    assert first == again and first != other
    assert len(first) == tasks.DEFAULT_COUNT >= tasks.MIN_COUNT == 30
    assert {t.kind for t in first} == set(tasks.Kind) and len({t.id for t in first}) == len(first)
    assert all(t.prompt.startswith("Question: ") and t.prompt.endswith(" only.\nAnswer:") for t in first)


@pytest.mark.parametrize("task", tasks.generate(7, 45), ids=lambda t: t.id)
def test_each_check_takes_the_right_answer_and_refuses_a_wrong_one(task):
    right = task.answer
    wrong = str(int(right) + 1) if right.isdigit() else right[:-1] + ("X" if right[-1] != "X" else "Y")
    assert task.check(right) and task.check(f" {right}\n\nQuestion: What is 1 + 1?")
    assert task.check(f" {right}.") and task.check(f"**{right}**") and task.check(f"The answer is {right}.")
    assert not task.check(wrong) and not task.check(f"The answer is {wrong}.") and not task.check("")
    assert not task.check(f"{right} or {wrong}")
    assert not task.check("\n" + right * 40)  # not "the answer alone"


def test_checks_are_tolerant_of_the_form_and_strict_about_the_value():
    add = tasks.Task("t", tasks.Kind.ADD, "What is 17 + 25?", "42")
    assert all(add.check(t) for t in ("42", " 42 ", "42.", "`42`", "17 + 25 = 42", "The sum is 42.", "'42'"))
    assert not any(add.check(t) for t in ("43", "42 or 43", "4 2", "142", "420", "-42", "forty-two"))
    copy = tasks.Task("t", tasks.Kind.COPY, "Repeat this code exactly: qzv-4821", "qzv-4821")
    assert copy.check('"qzv-4821"') and copy.check("The code is qzv-4821.")
    assert not copy.check("qzv-4822") and not copy.check("QZV-4821") and not copy.check("qzv-4821 qzv-4822")
    caps = tasks.Task("t", tasks.Kind.CAPITALS, "Write the word apple in capital letters.", "APPLE")
    assert caps.check("APPLE") and caps.check("The word is APPLE.") and not caps.check("apple")
    assert not caps.check("APPLES")


# -- the detectors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, fired",
    [
        (detectors.Output(""), ["empty"]),
        (detectors.Output("  \n "), ["empty"]),
        (detectors.Output(" the the the the the the"), ["repeat"]),
        (detectors.Output("aaaaaaaaaaaaaaaa"), ["repeat"]),
        (detectors.Output("!!!!!!!!"), ["bang"]),
        (detectors.Output("42 !!!!"), ["bang"]),
        (detectors.Output("?..,;"), ["bang"]),
        (detectors.Output("4\ufffd2"), ["replacement"]),
        (detectors.Output("", 1, "stop"), ["empty", "stops-at-once"]),
        (detectors.Output("x", 0, "stop"), ["stops-at-once"]),
    ],
)
def test_each_detector_fires_on_its_garbage(output, fired):
    assert detectors.flags(output) == fired


@pytest.mark.parametrize(
    "output",
    [
        detectors.Output(" 42", 2, "stop"),  # the answer and its EOS
        detectors.Output(" 42\n\nQuestion: What is 1 + 1?\nAnswer: 2", 16, "length"),
        detectors.Output(" APPLE", 2, "stop"),
        detectors.Output(" qzv-4821"),
        detectors.Output("The answer is 42!"),
        detectors.Output("42\n\n\n\n\n\n\n\n\n\n\n\n\n\n"),  # blank lines after the answer: not a repeat
        detectors.Output("1 2 3 4 5 6 7"),
        detectors.Output("the answer", 1, "length"),  # cut by max_new_tokens, not stopped
    ],
)
def test_no_detector_fires_on_a_right_answer(output):
    assert detectors.flags(output) == []


# -- the serve machine's gate ----------------------------------------------------------------


class Clock:
    now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_800_000_000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


SPEC = ServerSpec("fake", ["sglang"], ["sglang"], {}, "127.0.0.1", 30000, [], check_gpus=False)
POLICY = Policy(60, 1.0, 2.0, 2, 2, 0.2, 0.5, 10, 600, smoke=True)
OK = ProbeResult(True, 200, "200", 0.01)


def generating_machine() -> Machine:
    machine = Machine(SPEC, POLICY, Clock(), "server.log", "events.jsonl")
    assert machine.tick() == [Spawn()]
    machine.started(1000, "fake:1")
    assert machine.tick() == [Probe(1)]
    actions = machine.probe_done(1, OK)
    assert actions[-1] == Smoke(1) and machine.status is RunStatus.STARTING  # not ready before the smoke
    assert machine.tick() == [] and machine.wake_at() == 1.0  # no probe, no deadline meanwhile
    return machine


def test_the_machine_calls_it_ready_only_after_the_smoke_passed():
    machine = generating_machine()
    actions = machine.smoke_done(1, True, "smoke passed: 32/32 answers right", [])
    assert actions[0].kind is EventKind.SMOKE and actions[0].fields["passed"] is True
    assert machine.status is RunStatus.READY and any(getattr(a, "kind", None) is EventKind.READY for a in actions)
    assert {"phase": "smoke passed"} in [getattr(a, "fields", None) for a in actions]  # ps: no longer "(smoke)"
    assert machine.smoke_done(1, False, "late", []) == []  # one verdict per start


def test_a_failed_smoke_stops_the_server_for_good_and_exits_1():
    from sm120kit.serve.procs import StopReport

    machine = generating_machine()
    actions = machine.smoke_done(1, False, "smoke FAILED: garbage", ["garbage: bang in 96 of 96 outputs"])
    assert actions[-1] == Stop() and machine.status is RunStatus.STOPPING
    assert not any(getattr(a, "kind", None) is EventKind.READY for a in actions)
    done = machine.stopped(StopReport(4, [], [], 0.1), [], None, None)
    assert done[-1].code is ExitCode.FINDINGS and machine.status is RunStatus.GAVE_UP
    assert machine.smoke_done(2, True, "late", []) == []


def test_a_stop_signal_during_the_smoke_stops_and_its_late_verdict_is_ignored():
    machine = generating_machine()
    assert machine.signalled("SIGINT")[-1] == Stop() and machine.status is RunStatus.STOPPING
    assert machine.smoke_done(1, True, "smoke passed", []) == [] and machine.status is RunStatus.STOPPING


def test_without_health_smoke_the_first_200_is_ready():
    from dataclasses import replace

    machine = Machine(SPEC, replace(POLICY, smoke=False), Clock(), "server.log", "events.jsonl")
    machine.tick()
    machine.started(1000, "fake:1")
    machine.tick()
    assert not any(isinstance(a, Smoke) for a in machine.probe_done(1, OK)) and machine.status is RunStatus.READY


# -- end to end against the stand-in -------------------------------------------------------------


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("smoke-env"), "0.5.23")


class Server:
    """`sm120kit serve standin` with the stand-in's faults, ready, until stopped."""

    def __init__(self, root: Path, python: Path, faults: dict, sets=(), env=None) -> None:
        self.sets = [a for s in sets for a in ("--set", s)]
        self.served = Served(root, python, {**FAST, **faults}, list(sets), ["--quiet"], env or {}).start()
        self.served.wait("ready", timeout=SLOW_BOOT_S)

    def smoke(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "sm120kit", "smoke", "standin", "--profile-dir", str(PROFILES)]
        argv += [*self.sets, "--set", f"server.port={self.served.port}", *args]
        return subprocess.run(argv, capture_output=True, text=True, env={**self.served.env, **(env or {})}, timeout=60)

    def stop(self) -> None:
        self.served.signal()
        self.served.cleanup()


@pytest.fixture(scope="class")
def healthy(tmp_path_factory, env_python):
    """A healthy stand-in for one class of tests (serve's preflight refuses a second server
    while one runs: the servers of the other tests start outside that class)."""
    server = Server(tmp_path_factory.mktemp("healthy"), env_python, {})
    yield server
    server.stop()


@pytest.fixture(scope="class")
def recorded(healthy, tmp_path_factory) -> Path:
    """A baseline recorded from the healthy stand-in."""
    path = tmp_path_factory.mktemp("baseline") / "standin.json"
    done = healthy.smoke("--record-baseline", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    return path


class TestAHealthyServer:
    def test_another_model_on_the_profiles_port_is_not_checked_in_its_place(self, healthy, tmp_path):
        """What answers on the profile's port serves another model (someone else's server):
        exit 2, nothing checked or recorded; --url checks it as what it is."""
        path = tmp_path / "other.json"
        done = healthy.smoke(
            "--set", "model.path=other/Model", "--set", "model.served_name=other", "--record-baseline", str(path)
        )
        refused(done, "serves glm-5 / standin/GLM-5-NVFP4, not profile standin's other / other/Model", "smoke --url")
        assert not path.exists()

    def test_the_healthy_server_passes_and_its_baseline_round_trips(self, healthy, recorded):
        done = healthy.smoke("--baseline", str(recorded), "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        doc = json.loads(done.stdout)
        assert doc["passed"] and doc["failures"] == [] and doc["exit_code"] == 0
        assert [c["name"] for c in doc["checks"]] == [
            "answers",
            "garbage",
            "under-load",
            "streamed",
            "logprobs",
            "baseline",
        ]
        assert doc["model"] == "glm-5" and doc["sglang"] == "standin" and doc["concurrency"] == 64
        check = {c["name"]: c for c in doc["checks"]}
        assert check["answers"]["right"] == 32 and check["under-load"]["agree"] == 64
        assert check["baseline"]["mean_abs_delta"] == 0 and check["baseline"]["answers_as_recorded"] == 32
        assert doc["seconds"] < 20  # well under a minute
        kept = baseline.load(recorded)
        assert kept.model == "glm-5" and kept.text == baseline.FIXED_TEXT and len(kept.answers) == 32
        assert kept.logprobs[0] is None and len(kept.token_ids) == len(kept.logprobs) > 50
        assert kept.answers["t00-add"] == tasks.generate(0)[0].answer and kept.sglang == "standin"

    def test_the_text_report_and_the_default_baseline_place(self, healthy):
        done = healthy.smoke("--record-baseline")
        assert done.returncode == 0, done.stdout + done.stderr
        where = Path(healthy.served.env["SM120KIT_STATE_DIR"]) / "smoke" / "standin.json"
        assert f"baseline recorded: {where}" in done.stdout and baseline.load(where).model == "glm-5"
        lines = done.stdout.splitlines()
        assert max(map(len, lines)) <= 100  # to a pipe: 100 columns
        assert lines[:3] == [
            "prompt logprobs of the fixed text ...",  # first: a baseline of another tokenizer stops there
            "32 tasks, one request at a time ...",
            "the tasks again inside a burst of 64 concurrent requests ...",
        ]
        assert lines[3].startswith(f"smoke of standin at http://127.0.0.1:{healthy.served.port} (model glm-5")
        assert any(line.startswith("PASS  under-load  burst of 64: 64 right (100 %)") for line in lines)
        summary = next(line for line in lines if line.startswith("smoke passed:"))  # wrapped at 100 columns
        assert summary.startswith("smoke passed: 32/32 answers right, no garbage, burst of 64 agrees on 64/64")
        again = healthy.smoke("--baseline")  # no FILE: the recorded one
        assert again.returncode == 0 and "baseline |Δ| mean 0.0000 max 0.0000" in again.stdout

    def test_a_corrupt_baseline_or_one_of_another_model_is_refused(self, healthy, recorded, tmp_path):
        bad = tmp_path / "bad.json"
        bad.write_text("{not json")
        refused(healthy.smoke("--baseline", str(bad)), f"baseline {bad} is not JSON", "next: record a new one")
        bad.write_text(
            json.dumps({"format": baseline.FORMAT, "version": 1, "text": "x", "token_ids": [1], "logprobs": []})
        )
        refused(healthy.smoke("--baseline", str(bad)), f"baseline {bad} is corrupt")
        bad.write_text(json.dumps({"answers": {}}))
        refused(healthy.smoke("--baseline", str(bad)), "is not an sm120kit smoke baseline")
        refused(healthy.smoke("--baseline", str(tmp_path / "none.json")), "none.json: no such file")
        doc = json.loads(recorded.read_text())
        other = tmp_path / "other.json"
        other.write_text(json.dumps({**doc, "model": "Qwen/Qwen3-8B", "model_path": "Qwen/Qwen3-8B"}))
        refused(
            healthy.smoke("--baseline", str(other)),
            "was recorded from another model (Qwen/Qwen3-8B); this server serves glm-5",
            "nothing was compared",
        )
        other.write_text(json.dumps({**doc, "token_ids": [7, *doc["token_ids"][1:]]}))
        done = healthy.smoke("--baseline", str(other))
        refused(done, "tokenizes the fixed text differently", "first difference at token 0")
        assert "tasks, one request at a time" not in done.stdout  # found before the tasks were sent

    def test_no_server_a_bad_concurrency_and_no_target_are_refused(self, healthy, tmp_path):
        nobody = free_port()
        argv = [sys.executable, "-m", "sm120kit", "smoke"]
        run = lambda *a: subprocess.run([*argv, *a], capture_output=True, text=True, env=healthy.served.env)  # noqa: E731
        refused(run("--url", f"http://127.0.0.1:{nobody}"), f"no sglang server at http://127.0.0.1:{nobody}")
        refused(healthy.smoke("--concurrency", "10"), "--concurrency 10: allowed: an integer from 64 to 512")
        refused(healthy.smoke("--concurrency", "5000"), "--concurrency 5000")
        refused(run(), "smoke takes one profile, or --url without one")
        refused(run("--url", "localhost"), "--url 'localhost' is not http://HOST:PORT")
        refused(
            run("standin", "--url", "http://127.0.0.1:1", "--profile-dir", str(PROFILES)), "smoke takes one profile"
        )
        fresh = {"SM120KIT_STATE_DIR": str(tmp_path / "state")}
        refused(healthy.smoke("--baseline", env=fresh), "no baseline recorded for standin yet", "--record-baseline")


@pytest.fixture(scope="module")
def standin_module():
    """The stand-in's module, imported here: its request side in a thread of this process
    (the faults it reads from FAULTS at request time are set per test)."""
    spec = importlib.util.spec_from_file_location("sglang_standin_inproc", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.State.starting = False
    return module


@pytest.fixture
def inproc(standin_module, monkeypatch):
    """A stand-in HTTP server in this process, on a free port: (url, its FAULTS)."""
    monkeypatch.setattr(standin_module, "FAULTS", {})
    args = {"api_key": None, "served_name": "glm-5", "model_path": "standin/GLM-5-NVFP4", "tp": 1, "port": 0}
    with http_served(ThreadingHTTPServer(("127.0.0.1", 0), standin_module.handler(args))) as url:
        yield url, standin_module.FAULTS


@pytest.mark.parametrize(
    "mode, named",
    [
        ("repeat", "repeat in 96 of 96 outputs"),
        ("bang", "bang in 96 of 96 outputs"),
        ("empty", "empty in 96 of 96 outputs"),
        ("replacement", "replacement in 96 of 96 outputs"),
        ("stop", "stops-at-once in 96 of 96 outputs"),
    ],
)
def test_each_kind_of_garbage_fails_by_name(inproc, mode, named):
    url, faults = inproc
    faults["garbage"] = mode
    report = smoke(SmokeOptions(url=url))
    assert not report.passed and report.exit_code is ExitCode.FINDINGS
    failed = {f.split(":")[0] for f in report.failures}
    assert {"answers", "garbage", "under-load"} <= failed
    garbage = next(f for f in report.failures if f.startswith("garbage:"))
    assert named in garbage and f"{named.split()[0]} (alone) t00-add -> " in garbage
    assert report.summary().startswith("smoke FAILED: answers, garbage")
    assert report.as_json()["checks"][1]["detectors"][named.split()[0]] == 96


def test_shifted_logprobs_fail_against_the_baseline_and_a_small_drift_passes(inproc, tmp_path):
    url, faults = inproc
    recorded = tmp_path / "baseline.json"
    assert smoke(SmokeOptions(url=url, record_baseline=recorded)).recorded == recorded
    faults["logprob_shift"] = 0.2
    assert smoke(SmokeOptions(url=url)).passed  # without a baseline nothing says the numerics moved
    shifted = smoke(SmokeOptions(url=url, baseline=recorded))
    assert [f.split(";")[0] for f in shifted.failures] == [
        "baseline: |Δ logprob| mean 0.2000 (at most 0.05), max 0.2000 (at most 1) over 83 tokens"
    ]
    faults["logprob_shift"] = 0.01  # within the tolerance
    assert smoke(SmokeOptions(url=url, baseline=recorded)).passed
    faults["garbage"] = "bang"  # a failed smoke records nothing
    other = tmp_path / "not-recorded.json"
    failed = smoke(SmokeOptions(url=url, record_baseline=other))
    assert failed.recorded is None and not other.exists() and "baseline not recorded" in failed.note


def test_answers_wrong_only_under_load_fail_the_burst_alone(tmp_path, env_python):
    server = Server(tmp_path, env_python, {"wrong_under_load": 8})
    try:
        done = server.smoke("--wide")
    finally:
        server.stop()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PASS  answers     32/32 answers right" in done.stdout and "PASS  garbage" in done.stdout
    assert "FAIL  under-load  burst of 64:" in done.stdout
    # which task is the example depends on which requests overlapped on the machine at hand
    answers = {t.id: t.answer for t in tasks.generate(0)}
    example = re.search(r"e\.g\. (t\d\d-\w+): alone ' (\S+)', in the burst ' (\S+)'", done.stdout)
    assert example and example[2] == answers[example[1]] and example[3] != example[2], done.stdout
    assert done.stdout.splitlines()[-1].startswith("smoke FAILED: under-load (1 of 5 checks")


def test_the_requests_are_greedy_with_a_seed_that_an_older_release_is_spared(tmp_path):
    """sampling_seed is in SamplingParams from 0.5.9 on; a server whose SamplingParams(**kwargs)
    refuses it (a TypeError: 400 or 500) gets the requests without it."""
    from http.server import BaseHTTPRequestHandler

    from sm120kit.quality.client import Client

    bodies = []

    class Old(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            if "sampling_seed" in body["sampling_params"]:
                doc, code = {"error": {"message": "unexpected keyword argument 'sampling_seed'"}}, 400
            else:
                doc, code = (
                    {"text": " 42", "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "stop"}}},
                    200,
                )
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with http_served(ThreadingHTTPServer(("127.0.0.1", 0), Old)) as url:
        client = Client(url, seed=5)
        first, second = client.generate("Question: x", 16), client.generate("Question: y", 16)
    assert first.text == second.text == " 42" and first.finish == "stop" and client.seed is None
    assert bodies[0]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0, "sampling_seed": 5}
    assert [b["sampling_params"].get("sampling_seed") for b in bodies] == [5, None, None]


# -- bad input ----------------------------------------------------------------------------------


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == ExitCode.ERROR, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and all(w in done.stderr for w in words), done.stderr


def test_a_refused_key_is_an_error_and_the_right_one_passes(tmp_path, env_python):
    key = {"STANDIN_SMOKE_KEY": "k-right-0123456789"}
    server = Server(tmp_path, env_python, {}, sets=["server.api_key_env=STANDIN_SMOKE_KEY"], env=key)
    try:
        wrong = server.smoke(env={"STANDIN_SMOKE_KEY": "k-wrong-0123456789"})
        right = server.smoke()
    finally:
        server.stop()
    refused(wrong, "refuses the API key (401): nothing was checked")
    assert "k-wrong-0123456789" not in wrong.stderr + wrong.stdout
    assert right.returncode == 0, right.stdout + right.stderr


def test_options_for_a_profile():
    from sm120kit.profiles.loader import load_profile

    profile = load_profile("standin", [str(PROFILES)], ["engine.max_running_requests=2048", "server.port=31234"])
    options = options_for(profile, api_key=None)
    assert options == SmokeOptions(
        url="http://127.0.0.1:31234", concurrency=512, name="standin", model=("glm-5", "standin/GLM-5-NVFP4")
    )
    profile = load_profile("standin", [str(PROFILES)], ["engine.max_running_requests=8", "server.host=::1"])
    assert options_for(profile, api_key="k").url == "http://[::1]:30000" and options_for(profile).concurrency == 64
    assert "sk-secret" not in repr(options_for(profile, api_key="sk-secret-0123"))


# -- serve with health.smoke ---------------------------------------------------------------------


def test_serve_with_health_smoke_refuses_a_garbage_server(tmp_path, env_python):
    served = Served(tmp_path, env_python, {**FAST, "garbage": "bang"}, ["health.smoke=true"], ["--quiet"], {})
    try:
        code, out = served.run(timeout=90)
        assert code == ExitCode.FINDINGS, out
        kinds = [e["event"] for e in served.events()]
        assert "ready" not in kinds and kinds.count("started") == 1  # no restart
        [verdict] = served.events(EventKind.SMOKE.value)
        assert verdict["passed"] is False and any(f.startswith("garbage: bang in") for f in verdict["failures"])
        assert "not calling standin ready" in out and "gave up: the smoke failed" in out
        state = json.loads((served.dir / "state.json").read_text())
        assert state["status"] == "gave-up" and state["clean"] is True
        assert served.ours() == []
    finally:
        served.cleanup()


def test_serve_with_health_smoke_calls_a_healthy_server_ready_after_it(tmp_path, env_python):
    served = Served(tmp_path, env_python, FAST, ["health.smoke=true"], ["--quiet"], {}).start()
    try:
        served.wait("ready", timeout=SLOW_BOOT_S)
        kinds = [e["event"] for e in served.events()]
        assert kinds.index("smoke") < kinds.index("ready")
        assert served.events("smoke")[0]["passed"] is True
        assert served.signal() == 0
    finally:
        served.cleanup()


# -- review fixes ---------------------------------------------------------------------------------


def test_a_wrong_number_beside_the_right_one_or_a_decimal_does_not_pass():
    add = tasks.Task("t", tasks.Kind.ADD, "What is 17 + 25?", "42")
    assert add.check("17 + 25 = 42") and add.check("The sum of 17 and 25 is 42.")
    assert not any(add.check(t) for t in ("43 or 42", "Maybe 41, no: 42", "42.5", "4.42", "-42", "4200"))
    nxt = tasks.Task("t", tasks.Kind.NEXT, "What number comes next: 5, 8, 11, 14?", "17")
    assert nxt.check("5, 8, 11, 14, 17") and not nxt.check("15, 17")


def test_a_leading_think_block_is_skipped_and_an_unclosed_one_is_not_an_answer():
    add = tasks.Task("t", tasks.Kind.ADD, "What is 17 + 25?", "42")
    assert add.check("<think>\n17 + 25: 7 + 5 = 12, carry 1, so 42.\n</think>\n\n42")
    assert add.check("<think>\n\n</think>\n\n 42\n\nQuestion: What is 1 + 1?")
    assert tasks.answer_line("<think></think> 42") == "42"
    assert not add.check("<think>\nLet me add 17 and 25. 17 + 25 = 42")  # still thinking: no answer line


class Hangs:
    """A server that answers /v1/models and the first `answers` /generate requests, then
    holds every later one open without a reply (a hung scheduler)."""

    def __init__(self, answers: int) -> None:
        from http.server import BaseHTTPRequestHandler

        self.release = threading.Event()
        seen = [0]
        release = self.release

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def reply(self, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                seen[0] += 1
                if seen[0] > answers:
                    release.wait(30)
                self.reply({"text": " 1", "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "stop"}}})

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.handle_error = lambda *a: None  # a reply to a client that gave up: no noise
        self.serving = contextlib.ExitStack()
        self.url = self.serving.enter_context(http_served(server))

    def close(self) -> None:
        self.release.set()
        self.serving.close()


@pytest.mark.parametrize("answers", [0, 5])
def test_a_server_that_hangs_mid_run_ends_the_smoke_within_its_budget(answers):
    import time

    server = Hangs(answers)
    began = time.monotonic()
    try:
        report = smoke(SmokeOptions(url=server.url, timeout_s=0.5, budget_s=4.0))
    finally:
        server.close()
    took = time.monotonic() - began
    assert took < 4.0 + 3.0, took  # not 32 timeouts, nor the burst and the logprobs past the budget
    assert not report.passed and report.stalled and "timed out" in report.stalled
    assert report.as_json()["stalled"] == report.stalled


def test_a_key_the_server_wants_but_was_not_given_is_named(tmp_path):
    from sm120kit.errors import UserError
    from sm120kit.quality.client import Client

    class Wants(ThreadingHTTPServer):
        pass

    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with http_served(Wants(("127.0.0.1", 0), Handler)) as url:
        with pytest.raises(UserError) as none:
            Client(url).reach()
        with pytest.raises(UserError) as wrong:
            Client(url, api_key="k-0123456789").reach()
    assert "asks for an API key (401) and none was given" in none.value.message
    assert "refuses the API key (401)" in wrong.value.message and "k-0123456789" not in str(wrong.value.__dict__)


def test_a_baseline_message_names_the_model_once_and_the_command_to_record_one(tmp_path):
    from sm120kit.errors import UserError

    kept = baseline.Baseline("org/a", "org/a", None, "x y", [1, 2], [None, -1.0])
    with pytest.raises(UserError) as other:
        baseline.same_model(tmp_path / "b.json", kept, "org/b", "org/b")
    assert "another model (org/a); this server serves org/b:" in other.value.message
    assert other.value.hint.endswith("sm120kit smoke PROFILE --record-baseline FILE")
    with pytest.raises(UserError) as missing:
        baseline.load(tmp_path / "none.json", "--url http://127.0.0.1:30000")
    assert missing.value.hint.endswith(
        f"sm120kit smoke --url http://127.0.0.1:30000 --record-baseline {tmp_path / 'none.json'}"
    )


def test_a_smoke_the_server_did_not_answer_takes_the_hung_path_and_restarts():
    machine = generating_machine()
    actions = machine.smoke_done(1, False, "smoke FAILED: answers", ["answers: timed out"], answered=False)
    assert machine.smoke_failed is None and machine.status is not RunStatus.GAVE_UP
    assert any(type(a).__name__ == "Kill" for a in actions) and machine.attempt.end.kind is EventKind.HUNG
    assert "did not answer the smoke" in machine.attempt.end.detail


def test_a_baseline_compared_with_a_server_that_returns_no_logprobs_fails_and_reports(tmp_path):
    recorded = tmp_path / "b.json"
    kept = baseline.Baseline("m", None, None, baseline.FIXED_TEXT, [1, 2], [None, -1.0])
    baseline.save(recorded, kept)
    server = Hangs(1000)  # answers everything, with no meta_info.input_token_logprobs
    try:
        report = smoke(SmokeOptions(url=server.url, baseline=recorded))
    finally:
        server.close()
    doc = report.as_json()  # the failed baseline check is named as the others are
    assert doc["checks"][-1]["name"] == "baseline" and doc["checks"][-1]["passed"] is False
    assert "not compared: the prompt logprobs did not come back" in doc["checks"][-1]["detail"]


def test_the_thread_smoker_says_whether_the_server_answered():
    from sm120kit.serve.supervisor import ThreadSmoker

    woke = threading.Event()
    hung, nobody = Hangs(0), f"http://127.0.0.1:{free_port()}"
    try:
        for n, url in enumerate((hung.url, nobody), 1):
            woke.clear()
            smoker = ThreadSmoker(SmokeOptions(url=url, timeout_s=0.3, budget_s=3.0), woke.set)
            smoker.start(n)
            assert woke.wait(10)
            [(attempt, (passed, summary, failures, answered))] = smoker.results()
            assert attempt == n and not passed and not answered, (summary, failures)
    finally:
        hung.close()


def test_ps_says_a_starting_server_is_being_smoked():
    from sm120kit.serve.render import ps_row

    run = {"profile": "glm5-nvfp4", "status": "starting", "phase": "smoke", "running": True, "supervisor_pid": 1}
    assert ps_row(run)[1] == "starting (smoke)"
    assert ps_row({**run, "status": "ready"})[1] == "ready"  # the phase of the start is over
    assert ps_row({**run, "phase": "loading weights 50% (2/4 shards)"})[1] == "starting"


def test_a_baseline_that_cannot_be_written_is_refused_before_any_request_and_leaves_nothing(tmp_path):
    from sm120kit.errors import UserError

    where = tmp_path / "a-directory"
    where.mkdir()
    nobody = f"http://127.0.0.1:{free_port()}"  # refused first, before the server is asked anything
    with pytest.raises(UserError, match=r"cannot write the baseline .*a-directory: it is a directory"):
        smoke(SmokeOptions(url=nobody, record_baseline=where))
    with pytest.raises(OSError):
        baseline.save(where, baseline.Baseline("m", None, None, "x y", [1, 2], [None, -1.0]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory"]  # no temp file left


def test_a_profile_taken_for_the_baseline_file_is_explained():
    done = subprocess.run(
        [sys.executable, "-m", "sm120kit", "smoke", "--record-baseline", "glm5-nvfp4"], capture_output=True, text=True
    )
    refused(done, "smoke takes one profile", "--record-baseline took 'glm5-nvfp4' as its FILE")


def test_no_server_for_a_profile_names_the_serve_command():
    from sm120kit.errors import UserError

    with pytest.raises(UserError) as none:
        smoke(SmokeOptions(url=f"http://127.0.0.1:{free_port()}", name="glm5-nvfp4"))
    assert none.value.hint.startswith("start it first (sm120kit serve glm5-nvfp4)")
