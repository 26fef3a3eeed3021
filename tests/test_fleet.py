"""A fleet end to end: `sm120kit serve standin-fleet` starts three replicas of the sglang
stand-in (tests/fixtures/sglang_standin.py, a TEST FIXTURE: the real server needs GPUs),
each under its own supervisor, and the REAL sglang router (the sglang-router wheel from
PyPI; it runs on a CPU) in front of them. Real signals, sockets and process trees; every
port is one the test picked free."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from support.serve import MY_FAILURE
from support.standin import PROFILES, REPLICAS, Fleet, make_env_python

from sm120kit.serve import procs

VERSION = "0.5.23"


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("fleet-env"), VERSION)


@pytest.fixture
def fleet(tmp_path, env_python):
    made: list[Fleet] = []

    def make(faults: dict | None = None, sets=(), extra=(), replica_ports=None) -> Fleet:
        f = Fleet(tmp_path / f"fleet-{len(made)}", env_python, faults or {}, sets, extra, replica_ports)
        made.append(f)
        return f

    yield make
    for f in made:
        f.cleanup()
        for p in psutil.process_iter():  # the router and the members, should a test fail midway
            try:
                if str(f.dir) in " ".join(p.cmdline()) or f"--port {f.port}" in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass


def generate(
    port: int, text: str = "Count: one two", timeout: float = 10, stream: bool = False, tokens: int = 4, key=None
) -> int:
    """One generation through the router: its HTTP status; 0 for no answer, or for a stream
    that broke off before its `data: [DONE]` (its replica died under it)."""
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body = json.dumps({"text": text, "sampling_params": params, "stream": stream}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            answer = r.read()
            return r.status if not stream or b"data: [DONE]" in answer else 0
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, http.client.HTTPException):
        return 0


class Load:
    """Requests through the router from a few threads until stopped: how many, and which failed."""

    def __init__(self, port: int, threads: int = 4) -> None:
        self.port, self.results, self.stopping = port, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        stream = False
        while not self.stopping.is_set():
            self.results.append(generate(self.port, stream=stream, tokens=16))
            stream = not stream  # a stream cut off mid-answer cannot be retried by the router: half are

    def stop(self) -> tuple[int, int]:
        self.stopping.set()
        for t in self.threads:
            t.join(15)
        return len(self.results), sum(1 for r in self.results if r != 200)


def wait_for(predicate, timeout: float, what: str, fleet: Fleet) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not in {timeout} s: {what}; events: {[e['event'] for e in fleet.events()]}\n{fleet.output}")


def test_a_replica_killed_under_load_is_taken_out_restarted_and_routed_again(fleet):
    f = fleet({"request_tokens_per_s": 40}).start()  # an answer of 16 tokens takes 0.4 s: some are in flight
    f.wait("ready", timeout=60)
    wait_for(lambda: all(f.routed(n) == 1 for n in REPLICAS), 30, "every replica routed", f)
    for _ in range(30):
        assert generate(f.port) == 200
    assert set(f.generations_by_port()) == set(f.replica_ports)  # through the router, every replica answers

    before = f.metrics()
    assert before[("sm120kit_ready", "replica-1")] == 1 and before[("sm120kit_restarts_total", "replica-1")] == 0
    assert before[("sm120kit_up", "router")] == 1

    load = Load(f.port, threads=6)
    time.sleep(1.0)
    victim = f.member_state("replica-1")["server_pid"]
    in_flight = len(procs.members(victim, None) and [1])  # the replica is up and serving
    assert in_flight
    killed_at = time.monotonic()
    psutil.Process(victim).kill()
    wait_for(lambda: f.events("unrouted"), 15, "replica-1 taken out of the router", f)
    wait_for(lambda: f.routed("replica-1") == 2, 60, "replica-1 restarted and routed again", f)
    restored_after = time.monotonic() - killed_at
    time.sleep(1.5)
    sent, failed = load.stop()
    # only what was in flight on the dead replica may fail: a handful, not the load
    on_victim = [e for e in f.answered() if e["port"] == f.replica_ports[1] and e["path"] == "/generate"]
    cut = sum(e["event"] == "start" for e in on_victim) - sum(e["event"] == "end" for e in on_victim)
    # only what was in flight on the dead replica may fail: never more than it left unfinished
    assert sent > 20 and failed <= cut, (sent, failed, cut)
    print(
        f"\nload through the router: {sent} requests (half streamed), {failed} failed, {cut} left unfinished on "
        f"the killed replica; it was routed again {restored_after:.1f} s after the kill"
    )
    assert f.member_state("replica-1")["restarts"] == 1
    assert [e["member"] for e in f.events("unrouted")] == ["replica-1"]

    served_before = f.generations_by_port().get(f.replica_ports[1], 0)
    for _ in range(30):
        assert generate(f.port) == 200
    assert f.generations_by_port()[f.replica_ports[1]] > served_before  # it serves again, through the router

    after = f.metrics()
    assert after[("sm120kit_restarts_total", "replica-1")] == 1 and after[("sm120kit_ready", "replica-1")] == 1
    assert after[("sm120kit_restarts_total", "replica-0")] == 0

    ps = subprocess.run(
        [sys.executable, "-m", "sm120kit", "ps", "--json"], capture_output=True, text=True, env=f.env, timeout=30
    )
    rows = {r["profile"]: r for r in json.loads(ps.stdout)["runs"]}
    assert {"standin-fleet", "standin-fleet/router", *(f"standin-fleet/{n}" for n in REPLICAS)} <= set(rows)
    assert rows["standin-fleet/replica-1"]["restarts"] == 1 and rows["standin-fleet"]["status"] == "ready"

    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output
    stopped = f.events("stopped")[-1]
    assert stopped["clean"] and stopped["members"] == {"replica-0": 0, "replica-1": 0, "replica-2": 0, "router": 0}
    exits = [e["member"] for e in f.events("member_exited")]
    assert exits[0] == "router"  # the router first: no new requests while the replicas drain
    assert not f.ours()
    assert not any(procs.port_in_use("127.0.0.1", p) for p in [f.port, *f.replica_ports, f.metrics_port])


def test_a_hung_replica_is_taken_out_and_put_back_when_it_generates_again(fleet):
    port = None

    def faults(ports):
        return {"by_args": [{"args": f"--port {ports[2]}", "faults": {"hang_after_ready_s": 2}}]}

    f = fleet()
    f.env["SGLANG_STANDIN"] = json.dumps({"requests_log": str(f.requests_log), **faults(f.replica_ports)})
    f.start()
    port = f.port
    f.wait("ready", timeout=60)
    wait_for(lambda: f.events("unrouted"), 30, "the hung replica taken out", f)
    assert f.events("unrouted")[0]["member"] == "replica-2"
    wait_for(lambda: f.routed("replica-2") >= 2, 60, "replica-2 restarted and routed again", f)
    assert f.member_state("replica-2")["restarts"] >= 1
    for _ in range(10):  # the others serve meanwhile
        assert generate(port) == 200
    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output
    assert not f.ours()


def test_a_fleet_with_an_api_key_needs_it_and_never_shows_it(fleet):
    key = f"fleet-key-{uuid.uuid4().hex}"
    f = fleet(sets=["server.api_key_env=FLEET_KEY"])
    f.env["FLEET_KEY"] = key
    seen, watching = [], threading.Event()

    def watch() -> None:  # every process list while the fleet starts: the key in none of them
        while not watching.is_set():
            for p in psutil.process_iter(["cmdline"]):
                if key in " ".join(p.info["cmdline"] or ()):
                    seen.append(p.info["cmdline"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    f.start()
    f.wait("ready", timeout=60)
    wait_for(lambda: all(f.routed(n) == 1 for n in REPLICAS), 30, "every replica routed, with the key", f)
    assert generate(f.port, key=key) == 200 and generate(f.port) == 401  # the router wants it, and has it
    psutil.Process(f.member_state("router")["server_pid"]).kill()  # a restart starts it the same way
    wait_for(lambda: all(f.routed(n) == 2 for n in REPLICAS), 60, "routed again by the new router", f)
    watching.set()
    watcher.join()
    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output
    assert not seen, seen
    assert key not in f.output
    records = [p for p in f.dir.rglob("*") if p.is_file() and not p.name.startswith("server.log")]
    assert records and not [p for p in records if key.encode() in p.read_bytes()]


def test_a_router_that_dies_is_restarted_and_every_ready_replica_added_again(fleet):
    f = fleet().start()
    f.wait("ready", timeout=60)
    wait_for(lambda: all(f.routed(n) == 1 for n in REPLICAS), 30, "every replica routed", f)
    psutil.Process(f.member_state("router")["server_pid"]).kill()
    wait_for(lambda: all(f.routed(n) == 2 for n in REPLICAS), 60, "every replica routed by the new router", f)
    assert f.member_state("router")["restarts"] == 1 and not f.events("unrouted")
    wait_for(lambda: generate(f.port) == 200, 15, "the new router serving", f)
    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output
    assert not f.ours()


def test_a_router_only_fleet_routes_to_replicas_served_by_another(fleet):
    """Two nodes' worth on one: this profile's replicas served by `--replicas-only` (no
    router), and `--router-only` (its own state directory, as another node's would be) in
    front of them at the same ports."""
    replicas = fleet(extra=["--replicas-only"]).start()
    replicas.wait("ready", timeout=60)
    wait_for(
        lambda: all(replicas.member_state(n)["status"] == "ready" for n in REPLICAS), 30, "replicas ready", replicas
    )
    assert not (replicas.dir / "router").exists()
    router = fleet(extra=["--router-only"], replica_ports=replicas.replica_ports).start()
    router.wait("ready", timeout=60)
    wait_for(lambda: len(router.events("routed")) == 3, 30, "the three URLs routed", router)
    wait_for(lambda: generate(router.port) == 200, 30, "the router serving", router)
    for _ in range(20):
        assert generate(router.port) == 200
    assert set(replicas.generations_by_port()) == set(replicas.replica_ports)
    assert not any((router.dir / n).exists() for n in REPLICAS)  # started nothing of its own
    assert router.signal(signal.SIGTERM, timeout=60) == 0, router.output
    assert replicas.signal(signal.SIGTERM, timeout=60) == 0, replicas.output
    assert not replicas.ours()


def test_bench_serve_starts_the_fleet_measures_through_the_router_and_stops_it(fleet, tmp_path):
    f = fleet()
    argv = [a if a != "serve" else "bench" for a in f.argv]
    argv = [a for a in argv if a not in ("--metrics-port", str(f.metrics_port))]
    argv[argv.index("bench") + 2 : argv.index("bench") + 2] = ["--serve"]
    argv += ["--concurrency", "4", "--prompts-per-level", "6", "--input-len", "16", "--output-len", "8"]
    argv += ["--out", str(tmp_path / "r")]
    done = subprocess.run(argv, capture_output=True, text=True, env=f.env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped the server (sm120kit serve exit code 0)" in done.stdout
    [level] = json.loads((tmp_path / "r" / "run.json").read_text())["levels"]
    assert level["concurrency"] == 4
    assert sum(f.generations_by_port().values()) >= 24 and len(f.generations_by_port()) == 3  # through the router
    assert f.events("stopped")[-1]["clean"] and not f.ours()


def test_health_smoke_runs_on_every_replica_before_it_is_routed(fleet):
    f = fleet(sets=["health.smoke=true"]).start()
    f.wait("ready", timeout=90)
    wait_for(lambda: all(f.routed(n) == 1 for n in REPLICAS), 60, "every replica routed", f)
    for n in REPLICAS:
        events = [json.loads(line) for line in (f.dir / n / "events.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert kinds.index("smoke") < kinds.index("ready"), (n, kinds)
        assert next(e for e in events if e["event"] == "smoke")["passed"], n
    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output


def test_a_fleet_supervisor_killed_outright_leaves_its_members_to_stop_clean(fleet):
    f = fleet().start()
    f.wait("ready", timeout=60)
    members = [f.member_state(n)["supervisor_pid"] for n in (*REPLICAS, "router")]
    f.proc.kill()  # no chance to stop anything: each member gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
    f.proc.wait()
    wait_for(lambda: not f.ours(), 30, "every stand-in process gone", f)
    wait_for(lambda: not any(_running(pid) for pid in members), 30, "every member supervisor gone", f)
    for n in (*REPLICAS, "router"):
        assert f.member_state(n)["status"] == "stopped" and f.member_state(n)["clean"], n


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_second_ctrl_c_hurries_the_router_and_then_the_replicas(fleet):
    f = fleet({"ignore_sigterm": True}, sets=["health.stop_timeout_s=20"]).start()  # a drain that never ends
    f.wait("ready", timeout=60)
    began = time.monotonic()
    f.proc.send_signal(signal.SIGINT)
    # the first taken (two pending at once would be one): then the second is a second Ctrl-C
    f.wait("stopping", timeout=30)
    assert f.signal(signal.SIGINT, timeout=60) == 0, f.output  # SIGKILLed in time: nothing was left
    assert time.monotonic() - began < 12, f.output  # not 20 s for the replicas, after the router
    for n in REPLICAS:
        stopped = [json.loads(line) for line in (f.dir / n / "events.jsonl").read_text().splitlines()][-1]
        assert stopped["event"] == "stopped" and stopped["clean"] and stopped["sigkilled"], n
    assert not f.ours()


def test_a_metrics_port_that_is_a_fleet_port_is_refused_before_anything_starts(fleet):
    f = fleet()
    f.argv[f.argv.index("--metrics-port") + 1] = str(f.replica_ports[1])
    code, output = f.run()
    assert code == 2, output
    assert f"--metrics-port {f.replica_ports[1]} is the server's too (replica-1's server.port)" in output
    assert not f.events("member_started")


def test_a_member_supervisor_killed_outright_takes_its_replica_out_and_the_rest_serve_on(fleet):
    f = fleet().start()
    f.wait("ready", timeout=60)
    wait_for(lambda: all(f.routed(n) == 1 for n in REPLICAS), 30, "every replica routed", f)
    psutil.Process(f.member_state("replica-0")["supervisor_pid"]).kill()
    wait_for(lambda: f.events("unrouted"), 15, "replica-0 taken out", f)
    assert f.events("member_exited")[0] == {**f.events("member_exited")[0], "member": "replica-0", "exit_code": 137}
    assert "its supervisor was killed; the replica is out of the fleet" in f.output
    for _ in range(10):
        assert generate(f.port) == 200
    assert f.signal(signal.SIGTERM, timeout=60) == 0, f.output  # its server died with it: nothing left
    wait_for(lambda: not f.ours(), 15, "no stand-in process left", f)


def test_the_fleet_gives_up_when_every_replica_does_and_leaves_nothing(fleet):
    f = fleet({"die_loading": "RuntimeError: CUDA error: an illegal instruction was encountered"})
    code, output = f.run(timeout=120)
    assert code == 1, output
    assert f.events("gave_up") and f.events("stopped")[-1]["clean"]
    assert not f.events("member_started") or all(e["member"] != "router" for e in f.events("member_started"))
    assert not f.ours()


def test_a_replicas_death_is_diagnosed_with_the_known_failures_of_the_patch_dirs(fleet, tmp_path):
    """serve --patch-dir DIR of a fleet: each replica's supervisor knows DIR's failures too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "known-failures.toml").write_text(MY_FAILURE)
    f = fleet(
        {"die_loading": "RuntimeError: boom at line 12"}, sets=["health.max_restarts=0"], extra=["--patch-dir", mine]
    )
    code, output = f.run(timeout=120)
    assert code == 1, output
    deaths = [
        json.loads(line)
        for line in (f.dir / "replica-0" / "events.jsonl").read_text().splitlines()
        if '"gave_up"' in line
    ]
    assert deaths and "boom-sm120" in deaths[0]["deaths"][0], deaths
    assert not f.ours()


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (['fleet.router.polcy="round_robin"'], "fleet.router.polcy"),
        (['fleet.replica=[{gpus="0"}, {gpus="0"}, {gpus="2"}]'], "GPU 0 is in replica-0 and in replica-1"),
        (['fleet.replica=[{url="10.0.0.2:30001"}, {}, {}]'], "is not a worker URL"),
        (["fleet.replica=[{}, {}, {}, {}]", "fleet.replicas=4"], "replica-3 uses GPU 3, but node.gpus = 3"),
    ],
)
def test_bad_fleet_input_is_exit_2_and_starts_nothing(fleet, sets, expected):
    f = fleet(sets=sets)  # a later --set of fleet.replica replaces the test's list of free ports
    code, output = f.run()
    assert code == 2, output
    assert expected in output and "Traceback" not in output
    assert not f.dir.exists() or not any(f.dir.iterdir())


def test_dry_run_of_the_shipped_eight_replica_profile(env_python):
    out = subprocess.run(
        [
            *(sys.executable, "-m", "sm120kit", "serve", "qwen3-30b-a3b-nvfp4-x8", "--dry-run"),
            *("--python", str(env_python), "--no-patch-check"),  # an unpatched environment: the render is the point
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for k in range(8):
        assert f"# replica-{k}: GPU {k}, http://127.0.0.1:{30001 + k}" in out.stdout
        assert f"CUDA_VISIBLE_DEVICES={k}" in out.stdout
    router = out.stdout.split("# router (sglang-router ")[1]
    assert "-m sglang_router.launch_router \\\n  --host 127.0.0.1 \\\n  --port 30000" in router
    assert "--policy cache_aware" in router and "--prometheus-host 127.0.0.1" in router


def test_a_one_server_profile_refuses_router_only(env_python):
    out = subprocess.run(
        [sys.executable, "-m", "sm120kit", "serve", "standin", "--router-only", "--profile-dir", str(PROFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "need a [fleet] table" in out.stderr
