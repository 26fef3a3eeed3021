"""sglang's real router (the `sglang-router` wheel from PyPI: a Rust binary that runs on a
CPU) in front of stand-in replicas (tests/fixtures/sglang_standin.py, a TEST FIXTURE),
driven by sm120kit.fleet.router: its options read from the installed release, its
command line, its worker API; requests through it, replicas added, removed, killed and
hung. Every process a test starts runs in a session of its own and is killed with it,
pass or fail; every port is picked free."""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import sglang_router  # the test extra's real router: missing, the run fails rather than skip it
from support.standin import STANDIN, free_port

from sm120kit.errors import UserError
from sm120kit.fleet.router import (
    LIVENESS_PATH,
    SUPPORTED,
    RouterClient,
    RouterOption,
    RouterRefused,
    RouterSchema,
    RouterUnavailable,
    read_router_schema,
    router_argv,
)
from sm120kit.target import Target

HOST = "127.0.0.1"
MODEL = "standin/model"
KEY = "fleet-secret"


@pytest.fixture(scope="module")
def schema() -> RouterSchema:
    """The options of the release the tests run: the one `-m sglang_router` imports (another
    can be tried with PYTHONPATH=its site-packages)."""
    found = read_router_schema(Target("the tests' python", [Path(sglang_router.__file__).resolve().parent.parent]))
    assert found is not None, "sglang-router is a test dependency"
    return found


def get(port: int, path: str, key: str | None = None, timeout: float = 5) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_for(what: str, check, timeout: float = 20):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            found = check()
        except (OSError, http.client.HTTPException, RouterUnavailable):
            found = None
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


class Fleet:
    """Stand-in replicas started directly (no supervisor) and the real router in front of
    them; kill() ends every process started, whatever happened."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.log = tmp_path / "requests.jsonl"  # the stand-ins' requests_log: who answered what
        self.procs: list[subprocess.Popen] = []
        self.replicas: dict[str, subprocess.Popen] = {}
        self.router: subprocess.Popen | None = None
        self.router_port = 0

    def replica(self, port: int | None = None, faults: dict | None = None, key: str | None = None) -> str:
        port = port or free_port()
        faults = {"load_s": 0.05, "warmup_s": 0.05, "requests_log": str(self.log), **(faults or {})}
        argv = [sys.executable, str(STANDIN), "--port", str(port), "--model-path", MODEL]
        proc = subprocess.Popen(
            argv + (["--api-key", key] if key else []),
            env={**os.environ, "SGLANG_STANDIN": json.dumps(faults)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        url = f"http://{HOST}:{port}"
        self.replicas[url] = proc
        wait_for(f"replica {url} ready", lambda: get(port, "/health")[0] == 200)
        return url

    def start_router(
        self, schema: RouterSchema, urls: list[str], api_key: str | None = None, **options
    ) -> RouterClient:
        self.router_port = free_port()
        # the router always runs a Prometheus exporter (default 0.0.0.0:29000): a free port of its own
        options = {"prometheus_port": free_port(), "log_level": "warn", **options}
        argv = router_argv(
            sys.executable, schema, options, host=HOST, port=self.router_port, worker_urls=urls, source="test"
        )
        argv += ["--api-key", api_key] if api_key else []  # never a profile's option (router_argv refuses it)
        with open(self.tmp / "router.log", "ab") as out:  # the child keeps its own copy
            self.router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(self.router)
        client = RouterClient(HOST, self.router_port, api_key=api_key)
        wait_for("the router's liveness", lambda: get(self.router_port, LIVENESS_PATH)[0] == 200)
        # registered (listed), then marked healthy: a moment apart
        wait_for("every worker registered and healthy", lambda: client.health() == dict.fromkeys(urls, True))
        return client

    def kill_replica(self, url: str) -> None:
        kill_session(self.replicas.pop(url))  # the launcher and its schedulers: a crash

    def kill(self) -> None:
        for proc in self.procs:
            kill_session(proc)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def generations(self, event: str, port: int | None = None) -> set[str]:
        """The rids of the /generate requests noted with this event ("start", "end"), at
        one replica (its port) or at any."""
        return {
            e["rid"]
            for e in self.events()
            if e["path"] == "/generate" and e["event"] == event and (port is None or e["port"] == port)
        }

    def answered(self, rids: list[str]) -> collections.Counter:
        """Which replica (port) answered each of these requests, counted. A stand-in notes
        "end" just after its last byte leaves, so the client may read it first: wait for all."""

        def ends() -> dict:
            found = {e["rid"]: e["port"] for e in self.events() if e["path"] == "/generate" and e["event"] == "end"}
            return found if set(rids) <= set(found) else None

        found = wait_for(f"the stand-ins' notes of {len(rids)} answers", ends, 5)
        return collections.Counter(found[rid] for rid in rids)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def send(fleet: Fleet, rids: list[str], **kw) -> list[str]:
    """Requests one after another through the router: what went wrong with any."""
    return [f"{rid}: {r}" for rid in rids if (r := generate(fleet.router_port, rid, **kw))]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the process and its session; then reap its children too, which conftest
    made ours (a subreaper), so that no zombie outlives the test."""
    try:
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGKILL)
    except (psutil.Error, ProcessLookupError):
        children = []
    proc.wait()
    end = time.monotonic() + 5
    for pid in children:
        while time.monotonic() < end:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # not ours, or reaped already
                break
            time.sleep(0.01)


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.kill()


def generate(port: int, rid: str, stream: bool = False, tokens: int = 4, key: str | None = None) -> str | None:
    """One /generate through the router: None when the whole answer came, else what went wrong."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    text = f"{hashlib.sha256(rid.encode()).hexdigest()[:16]} {rid}"  # prompts that share no prefix
    body = {"text": text, "rid": rid, "stream": stream, "sampling_params": {"max_new_tokens": tokens}}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST", "/generate", json.dumps(body), headers)
        response = conn.getresponse()
        raw = response.read().decode()
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if response.status != 200:
        return f"{response.status} {raw[:200]}"
    if stream:
        events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"]:  # a stream cut short still ends its chunked body cleanly
            return f"stream cut after {len(events)} events"
        raw = events[-2]
    done = json.loads(raw)["meta_info"]["completion_tokens"]
    return None if done == tokens else f"{done} of {tokens} tokens"


# --- the options, read from the installed release -------------------------------------------


def test_the_schema_read_from_source_is_what_argparse_builds(schema):
    """The static read of router_args.py agrees with the parser the release builds itself:
    every flag, which are switches, and the fixed choices."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert {o.flag for o in schema.options.values()} == set(actions)
    for key, option in schema.options.items():
        action = actions[option.flag]
        assert key == action.dest or option.flag == "--tls-cert-path" or option.flag == "--tls-key-path"
        assert (option.kind == "switch") == (action.nargs == 0), key
        if option.choices is not None:
            assert tuple(action.choices) == option.choices, key
    assert {"random", "round_robin", "cache_aware", "power_of_two"} <= set(schema.options["policy"].choices)
    assert schema.options["tool_call_parser"].choices is None  # a registry read at run time: any value


def test_the_installed_release_is_one_sm120kit_drives(schema):
    assert schema.version in SUPPORTED


def test_the_argv_carries_the_profile_options(schema):
    argv = router_argv(
        "/venv/bin/python",
        schema,
        {"policy": "round_robin", "health_check_interval_secs": 5, "disable_retries": True, "dp_aware": False},
        host="10.0.0.1",
        port=30000,
        worker_urls=["http://10.0.0.1:30001", "http://10.0.0.1:30002"],
        source="fleet.toml",
    )
    assert argv[:7] == [
        "/venv/bin/python",
        "-m",
        "sglang_router.launch_router",
        "--host",
        "10.0.0.1",
        "--port",
        "30000",
    ]
    assert argv[7:] == [
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        "5",
        "--disable-retries",  # a switch set false is left out
        "--prometheus-host",  # the metrics exporter binds no wider than the router
        "10.0.0.1",
        "--worker-urls",
        "http://10.0.0.1:30001",
        "http://10.0.0.1:30002",
    ]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"polcy": "round_robin"},
            "fleet.router.polcy: the installed sglang-router {v} has no such option (did you mean `policy`?)",
        ),
        ({"health-check-interval-secs": 5}, "did you mean `health_check_interval_secs`?"),
        ({"policy": "fastest"}, "fleet.router.policy: 'fastest' is not one of random, round_robin"),
        (
            {"health_check_interval_secs": "5"},
            "fleet.router.health_check_interval_secs: '5' is not an integer (sglang-router {v}",
        ),
        ({"cache_threshold": True}, "fleet.router.cache_threshold: True is not a number"),
        ({"disable_retries": "yes"}, "fleet.router.disable_retries: --disable-retries is a switch: true or false"),
        ({"port": 1}, "fleet.router.port: sm120kit sets --port itself"),
        ({"worker_urls": ["http://x:1"]}, "fleet.router.worker_urls: sm120kit sets --worker-urls itself"),
        ({"prefill": ["http://x:1"]}, "fleet.router.prefill: --prefill takes repeated groups"),
        ({"api_key": "literal"}, "fleet.router.api_key: a key does not belong in a profile"),
        ({"prometheus_port": 70000}, "fleet.router.prometheus_port = 70000 is not a port (1-65535)"),
    ],
)
def test_a_bad_router_option_names_the_file_the_key_and_the_release(schema, options, said):
    with pytest.raises(UserError) as caught:
        router_argv("/venv/bin/python", schema, options, host=HOST, port=1, worker_urls=[], source="/p/fleet.toml")
    message = str(caught.value)
    assert message.startswith("/p/fleet.toml: fleet.router.") and said.format(v=schema.version) in message
    assert caught.value.hint  # the next step: the release's --help, or what to remove


def test_a_release_outside_the_supported_range_is_refused(schema):
    newer = RouterSchema("0.4.0", schema.options)
    with pytest.raises(UserError, match=r"sglang-router 0\.4\.0 is not a release sm120kit drives") as caught:
        router_argv("/venv/bin/python", newer, {}, host=HOST, port=1, worker_urls=[], source="/p/fleet.toml")
    assert "/venv/bin/python -m pip install 'sglang-router" in caught.value.hint


def test_the_schema_comes_from_the_target_files_not_an_import(tmp_path):
    """A --site directory with another release: its own router_args.py is read (an older
    release lacks an option the installed one has); no sglang-router there: None."""
    site = tmp_path / "site-packages"
    assert read_router_schema(Target("empty", [site])) is None
    (site / "sglang_router").mkdir(parents=True)
    info = site / "sglang_router-0.2.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-router\nVersion: 0.2.4\n\n")
    (site / "sglang_router" / "router_args.py").write_text(
        "class RouterArgs:\n"
        "    def add_cli_args(parser, use_router_prefix=False):\n"
        "        prefix = 'router-' if use_router_prefix else ''\n"
        "        parser.add_argument('--host', type=str)\n"
        "        parser.add_argument(f'--{prefix}policy', type=str, choices=['random', 'round_robin'])\n"
        "        parser.add_argument(f'--{prefix}disable-retries', action='store_true')\n"
    )
    old = read_router_schema(Target("site", [site]))
    assert old.version == "0.2.4" and old.options["policy"] == RouterOption(
        "--policy", "value", "str", ("random", "round_robin")
    )
    with pytest.raises(
        UserError, match=r"fleet\.router\.disable_health_check: the installed sglang-router 0\.2\.4 has no such"
    ):
        router_argv("py", old, {"disable_health_check": True}, host=HOST, port=1, worker_urls=[], source="f.toml")


# --- the real router in front of stand-in replicas --------------------------------------------


# Not cache_aware (the router's default): below its balance thresholds (64 requests apart)
# a prompt that matches no earlier one goes to the least loaded worker, the first on a tie,
# so requests one at a time all go to one replica (cache_aware.rs); it spreads under load.
@pytest.mark.parametrize("policy", ["round_robin", "random", "power_of_two"])
def test_requests_through_the_router_reach_every_replica(fleet, schema, policy):
    urls = [fleet.replica() for _ in range(3)]
    client = fleet.start_router(schema, urls, policy=policy)
    assert get(fleet.router_port, LIVENESS_PATH) == (200, b"OK") and client.ready()
    assert client.health() == dict.fromkeys(urls, True)
    rids = [f"r{i}" for i in range(30)]
    assert not send(fleet, rids)
    answered = fleet.answered(rids)
    assert set(answered) == {port_of(u) for u in urls}, answered
    calls = {(e["method"], e["path"]) for e in fleet.events()}  # what the router asks of a worker
    assert {("GET", "/health"), ("GET", "/server_info"), ("GET", "/model_info")} <= calls


def test_workers_are_added_and_removed_through_the_client(fleet, schema):
    """Both are jobs in the router; `wait` returns once they show. A removed worker gets
    no new requests, and finishes the ones it is streaming."""
    a = fleet.replica(faults={"request_tokens_per_s": 5})  # 20 tokens: 4 s, removed meanwhile
    b, c = fleet.replica(), fleet.replica()
    client = fleet.start_router(schema, [a, b], policy="round_robin")
    client.add_worker(c, wait=10)
    client.add_worker(c, wait=10)  # again: nothing changes
    assert sorted(client.workers()) == sorted([a, b, c])
    streams: dict[str, str | None] = {}
    rids = [f"stream{i}" for i in range(3)]  # one each, round robin
    threads = [
        threading.Thread(target=lambda r=r: streams.update({r: generate(fleet.router_port, r, True, 20)})) for r in rids
    ]
    for t in threads:
        t.start()
    on_a = wait_for("a stream under way on a", lambda: fleet.generations("start", port_of(a)), 30)
    client.remove_worker(a, wait=10)
    assert not on_a & fleet.generations("end", port_of(a))  # removed while it streamed
    for t in threads:
        t.join()
    assert streams == dict.fromkeys(rids) and fleet.answered(rids)[port_of(a)] == 1
    client.remove_worker(a, wait=10)  # not there: not an error
    client.remove_worker("http://127.0.0.1:1", wait=1)
    assert sorted(client.workers()) == sorted([b, c])
    rids = [f"r{i}" for i in range(12)]
    assert not send(fleet, rids)
    assert fleet.answered(rids) == {port_of(b): 6, port_of(c): 6}


def test_a_worker_that_never_answers_is_not_registered(fleet, schema):
    """Registration is a background job that retries a worker that does not answer: the
    client's wait gives up and says what the job is doing."""
    client = fleet.start_router(schema, [fleet.replica()])
    dead = f"http://{HOST}:{free_port()}"
    with pytest.raises(RouterRefused, match=rf"did not register {dead} as healthy within 1\.5 s") as caught:
        client.add_worker(dead, wait=1.5)
    assert "its job: processing" in str(caught.value) or schema.version.startswith("0.2.")
    assert dead not in client.workers()


def test_the_client_says_when_the_router_is_not_there_or_wants_a_key(fleet, schema):
    with pytest.raises(RouterUnavailable, match=r"the router at http://127\.0\.0\.1:\d+ does not answer"):
        RouterClient(HOST, free_port(), timeout=1).workers()
    url = fleet.replica(key=KEY)
    client = fleet.start_router(schema, [url], api_key=KEY)
    for call in (lambda c: c.workers(), lambda c: c.add_worker(url), lambda c: c.remove_worker(url)):
        with pytest.raises(RouterRefused, match=r"401.*it wants the API key it was started with"):
            call(RouterClient(HOST, fleet.router_port))
    # the key guards the worker API and the requests, not the probes; the router passes it on
    assert get(fleet.router_port, LIVENESS_PATH)[0] == 200 and get(fleet.router_port, "/readiness")[0] == 200
    assert generate(fleet.router_port, "nokey").startswith("401")
    assert generate(fleet.router_port, "withkey", key=KEY) is None  # the replica wants the key too
    assert client.workers() == [url]


@pytest.mark.parametrize(
    ("stream", "back"), [(False, "api"), (True, "breaker")], ids=["whole-readded", "streamed-breaker"]
)
def test_a_killed_replica_costs_only_its_streams_in_flight(fleet, schema, stream, back):
    """20 requests of 2 s each over 2 replicas; one is killed once it is answering. The
    router retries a request whose answer has not begun elsewhere (a whole answer is sent
    at its end, so none fails), but cannot retry a stream already under way: each stream
    the dead replica was serving ends early (still a 200, without [DONE]), and only those
    fail (one that had sent nothing yet is retried on the other replica). Its health
    checks take it out of the rotation. Restarted at the same URL it is healthy again, but
    its circuit breaker, opened by the failed attempts, keeps requests from it until
    cb_timeout_duration_secs (60 s by default) have passed: removing it and adding it back
    through the worker API starts it afresh ("api"), or a short timeout lets it back by
    itself ("breaker")."""
    slow = {"request_tokens_per_s": 20}
    urls = [fleet.replica(faults=slow), fleet.replica(faults=slow)]
    victim = urls[1]
    checks = {"health_check_interval_secs": 1, "health_failure_threshold": 1, "health_success_threshold": 1}
    breaker = {"cb_timeout_duration_secs": 1} if back == "breaker" else {}
    client = fleet.start_router(schema, urls, policy="round_robin", health_check_timeout_secs=2, **checks, **breaker)
    results: dict[str, str | None] = {}

    def one(rid: str) -> None:
        results[rid] = generate(fleet.router_port, rid, stream=stream, tokens=40)

    threads = [threading.Thread(target=one, args=(f"r{i}",)) for i in range(20)]
    for t in threads:
        t.start()
    port = port_of(victim)
    wait_for("a request under way on the victim", lambda: fleet.generations("start", port), 30)
    time.sleep(0.3)  # its first tokens out (written at once): a stream the router cannot retry
    fleet.kill_replica(victim)
    for t in threads:
        t.join()
    cut = fleet.generations("start", port) - fleet.generations("end", port)  # in flight on the dead replica
    failed = {rid for rid, r in results.items() if r}
    assert len(results) == 20 and cut  # the kill hit requests in flight
    if stream:
        assert failed and failed <= cut and all("stream cut" in results[r] for r in failed), (failed, cut, results)
    else:
        assert not failed, results
    # one cut before its first byte left was retried: answered whole by the other replica
    # (whose note of an answer's end may trail the answer: wait for it)
    retried = cut - failed
    wait_for(
        f"{sorted(retried)} answered by the other replica",
        lambda: retried <= fleet.generations("end", port_of(urls[0])),
        5,
    )
    print(f"\n{'streamed' if stream else 'whole'}: {len(cut)} in flight on the killed replica, {len(failed)} failed")

    wait_for("the dead replica marked unhealthy", lambda: client.health() == {urls[0]: True, victim: False}, 10)
    if back == "api":
        client.remove_worker(victim, wait=5)
    assert not send(fleet, [f"after{i}" for i in range(6)])
    fleet.replica(port=port, faults=slow)  # restarted at the same URL, as the supervisor does
    if back == "api":
        client.add_worker(victim, wait=10)
    wait_for("the restarted replica healthy again", lambda: client.health() == dict.fromkeys(urls, True), 10)
    time.sleep(1.1 if back == "breaker" else 0)  # the open circuit's timeout
    rids = [f"back{i}" for i in range(4)]
    assert not send(fleet, rids, tokens=1)
    assert fleet.answered(rids)[port] >= 1  # it serves again


def test_a_hung_replica_is_taken_out_by_the_router_health_checks(fleet, schema):
    """A replica whose /health stops answering (a stuck scheduler) fails the router's
    checks by timeout: unhealthy, so no requests, while the other serves."""
    good = fleet.replica()
    trigger = fleet.tmp / "hang"
    hung = fleet.replica(faults={"hang_when": str(trigger)})  # healthy until the file exists
    client = fleet.start_router(
        schema,
        [good, hung],
        policy="round_robin",
        health_check_interval_secs=1,
        health_failure_threshold=1,
        health_check_timeout_secs=1,
    )  # both registered and healthy
    trigger.touch()
    wait_for("the hung replica marked unhealthy", lambda: client.health() == {good: True, hung: False}, 15)
    rids = [f"r{i}" for i in range(6)]
    assert not send(fleet, rids)
    assert fleet.answered(rids) == {port_of(good): 6}


def test_sigterm_stops_the_router_at_once_for_new_requests_after_its_streams(fleet, schema):
    """The fleet's stop begins with the router: on SIGTERM it stops listening at once
    (new connections are refused), lets the requests under way finish (up to
    shutdown_grace_period_secs, 180 s by default), then exits 0."""
    client = fleet.start_router(schema, [fleet.replica(faults={"request_tokens_per_s": 20})])
    streams: dict[str, str | None] = {}
    thread = threading.Thread(target=lambda: streams.update(s=generate(fleet.router_port, "s", True, 60)))  # 3 s
    thread.start()
    wait_for("the stream under way at the replica", lambda: "s" in fleet.generations("start"), 30)
    fleet.router.send_signal(signal.SIGTERM)

    def refused() -> str | None:
        try:
            client.workers()
        except RouterUnavailable as exc:
            return str(exc) if "ConnectionRefusedError" in str(exc) else None
        return None

    end = time.monotonic() + 10
    while not (said := refused()) and time.monotonic() < end:
        time.sleep(0.05)
    assert said, "the router still takes new connections 10 s after SIGTERM"
    assert "s" not in fleet.generations("end"), "refused only once its stream had ended"  # at once: not after it
    assert fleet.router.wait(timeout=15) == 0
    thread.join()
    assert streams == {"s": None}
