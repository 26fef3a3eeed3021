"""serve's Prometheus endpoint (sm120kit.serve.metrics): real state.json files written by
RunRecord as a member's supervisor writes them, a real HTTP scrape, parsed with
prometheus_client's own text parser, before and after the state changes."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from sm120kit.errors import UserError
from sm120kit.node.nvml import MIB, NvmlUnavailable
from sm120kit.node.nvml_schema import Gpu
from sm120kit.serve.metrics import STATUSES, Member, start_metrics_server
from sm120kit.serve.rundir import RunRecord
from sm120kit.serve.status import RunStatus

PROFILE = "qwen3-x8"


ME = psutil.Process()


def scrape(server, accept: str | None = None) -> str:
    request = urllib.request.Request(server.url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert reply.status == 200
        return reply.read().decode()


def samples(server) -> dict[tuple[str, str], dict]:
    """(sample name, member) -> {"labels": ..., "value": ...}; sm120kit_status -> by status too."""
    found: dict = {}
    for family in text_string_to_metric_families(scrape(server)):
        assert family.name.startswith("sm120kit_")
        for s in family.samples:
            key = (s.name, s.labels["member"]) + ((s.labels["status"],) if "status" in s.labels else ())
            assert key not in found, f"duplicate series {key}"
            assert s.labels["profile"] == PROFILE
            found[key] = {"labels": s.labels, "value": s.value}
    return found


def value(found: dict, name: str, member: str, *status: str) -> float | None:
    hit = found.get((name, member, *status))
    return None if hit is None else hit["value"]


def status_of(found: dict, member: str) -> str:
    [word] = [w for w in STATUSES if value(found, "sm120kit_status", member, w) == 1]
    return word


@pytest.fixture
def processes():
    """Stand-ins for server processes (a real process each: its pid is what state.json holds)."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(["sleep", "60"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def supervised(run_dir, name: str, role: str, gpus: list[int], **fields) -> RunRecord:
    """A member's record as its supervisor's launch writes it; this test is its supervisor."""
    record = RunRecord(run_dir)
    record.update(
        profile=PROFILE,
        supervisor_pid=ME.pid,
        supervisor_started=ME.create_time(),
        status=RunStatus.LAUNCHING,
        since=time.time(),
        host="127.0.0.1",
        port=30001,
        restarts=0,
        last_health=None,
        member=name,
        role=role,
        gpus=gpus,
        url="http://127.0.0.1:30001",
        **fields,
    )
    return record


def health(ok: bool = True, seconds: float = 0.012, at: float | None = None) -> dict:
    return {"at": at or time.time(), "ok": ok, "detail": "200" if ok else "timed out", "seconds": seconds}


@pytest.fixture
def serve():
    servers = []

    def start(members, read_gpus=None, host="127.0.0.1", port=0):
        server = start_metrics_server(host, port, PROFILE, members, read_gpus=read_gpus)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def test_a_restart_is_seen_as_it_happens(tmp_path, processes, serve):
    first = processes()
    replica = supervised(tmp_path / "replica-0", "replica-0", "replica", [0])
    replica.update(status=RunStatus.STARTING, since=time.time(), server_pid=first.pid, restarts=0)
    members = [Member("replica-0", "replica", tmp_path / "replica-0")]
    server = serve(lambda: members)

    found = samples(server)
    assert value(found, "sm120kit_up", "replica-0") == 1
    assert value(found, "sm120kit_ready", "replica-0") == 0
    assert status_of(found, "replica-0") == "starting"
    assert value(found, "sm120kit_restarts_total", "replica-0") == 0
    assert value(found, "sm120kit_since_ready_seconds", "replica-0") == 0
    assert value(found, "sm120kit_probe_ok", "replica-0") is None  # no probe of a ready server yet
    info = found[("sm120kit_member_info", "replica-0")]
    assert info["value"] == 1
    assert info["labels"] == {
        "profile": PROFILE,
        "member": "replica-0",
        "role": "replica",
        "url": "http://127.0.0.1:30001",
        "gpus": "0",
    }

    probed = time.time()
    replica.update(status=RunStatus.READY, since=time.time() - 100, last_health=health(seconds=0.25, at=probed))
    found = samples(server)
    assert value(found, "sm120kit_up", "replica-0") == 1
    assert value(found, "sm120kit_ready", "replica-0") == 1
    assert status_of(found, "replica-0") == "ready"
    assert 100 <= value(found, "sm120kit_since_ready_seconds", "replica-0") < 110
    assert value(found, "sm120kit_probe_ok", "replica-0") == 1
    assert value(found, "sm120kit_probe_latency_seconds", "replica-0") == 0.25
    assert value(found, "sm120kit_probe_timestamp_seconds", "replica-0") == pytest.approx(probed)

    # The server dies; its supervisor has not reaped it yet (a zombie): not up, not ready.
    first.kill()
    deadline = time.monotonic() + 5
    while psutil.Process(first.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    found = samples(server)
    assert value(found, "sm120kit_up", "replica-0") == 0
    assert value(found, "sm120kit_ready", "replica-0") == 0
    first.wait()

    # What the supervisor writes on the way to a restart (machine.py), step by step.
    replica.update(status=RunStatus.BACKOFF, since=time.time(), server_pid=None, restarts=1)
    found = samples(server)
    assert (value(found, "sm120kit_up", "replica-0"), value(found, "sm120kit_ready", "replica-0")) == (0, 0)
    assert status_of(found, "replica-0") == "backoff"
    assert value(found, "sm120kit_restarts_total", "replica-0") == 1
    assert value(found, "sm120kit_since_ready_seconds", "replica-0") == 0

    second = processes()
    replica.update(status=RunStatus.STARTING, since=time.time(), server_pid=second.pid, restarts=1)
    found = samples(server)
    assert (value(found, "sm120kit_up", "replica-0"), value(found, "sm120kit_ready", "replica-0")) == (1, 0)

    replica.update(status=RunStatus.READY, since=time.time(), last_health=health())
    found = samples(server)
    assert (value(found, "sm120kit_up", "replica-0"), value(found, "sm120kit_ready", "replica-0")) == (1, 1)
    assert value(found, "sm120kit_restarts_total", "replica-0") == 1
    assert 0 <= value(found, "sm120kit_since_ready_seconds", "replica-0") < 10  # reset by the restart

    # A failed probe: unhealthy, still up, not ready; the last probe says why.
    replica.update(status=RunStatus.UNHEALTHY, last_health=health(ok=False, seconds=5.0))
    found = samples(server)
    assert (value(found, "sm120kit_up", "replica-0"), value(found, "sm120kit_ready", "replica-0")) == (1, 0)
    assert status_of(found, "replica-0") == "unhealthy"
    assert value(found, "sm120kit_probe_ok", "replica-0") == 0
    assert value(found, "sm120kit_probe_latency_seconds", "replica-0") == 5.0


def test_members_are_read_at_each_scrape(tmp_path, processes, serve):
    """A fleet's members come and go between scrapes: members() is asked every time."""
    members = [Member(PROFILE, "server", tmp_path / "one")]
    server = serve(lambda: list(members))
    found = samples(server)
    assert status_of(found, PROFILE) == "absent"
    assert value(found, "sm120kit_up", PROFILE) == 0

    router = supervised(tmp_path / "router", "router", "router", [])
    router.update(status=RunStatus.READY, since=time.time(), server_pid=processes().pid, last_health=health())
    members.append(Member("router", "router", tmp_path / "router"))
    found = samples(server)
    assert found[("sm120kit_up", "router")]["labels"]["role"] == "router"
    assert value(found, "sm120kit_ready", "router") == 1
    assert status_of(found, PROFILE) == "absent"


def test_a_dead_or_stopped_supervisor_is_down(tmp_path, processes, serve):
    gone = processes()
    gone_started = psutil.Process(gone.pid).create_time()
    gone.kill()
    gone.wait()
    server_proc = processes()
    crashed = supervised(tmp_path / "crashed", "replica-0", "replica", [0])
    crashed.update(
        status=RunStatus.READY,
        supervisor_pid=gone.pid,
        supervisor_started=gone_started,
        server_pid=server_proc.pid,  # the orphan it left still runs: the supervisor is what is gone
        restarts=3,
        last_health=health(),
    )
    reused = supervised(tmp_path / "reused", "replica-1", "replica", [1])  # our pid, another start time
    reused.update(status=RunStatus.READY, supervisor_started=ME.create_time() - 1000, server_pid=server_proc.pid)
    stopped = supervised(tmp_path / "stopped", "replica-2", "replica", [2])
    stopped.update(status=RunStatus.STOPPED, supervisor_pid=gone.pid, supervisor_started=gone_started, server_pid=None)
    members = [
        Member("replica-0", "replica", tmp_path / "crashed"),
        Member("replica-1", "replica", tmp_path / "reused"),
        Member("replica-2", "replica", tmp_path / "stopped"),
    ]
    found = samples(serve(lambda: members))
    for name in ("replica-0", "replica-1", "replica-2"):
        assert value(found, "sm120kit_up", name) == 0
        assert value(found, "sm120kit_ready", name) == 0
        assert value(found, "sm120kit_since_ready_seconds", name) == 0
        assert value(found, "sm120kit_probe_ok", name) is None  # a dead supervisor's last probe is history
    assert status_of(found, "replica-0") == str(RunStatus.SUPERVISOR_GONE)
    assert status_of(found, "replica-1") == str(RunStatus.SUPERVISOR_GONE)
    assert status_of(found, "replica-2") == "stopped"
    assert value(found, "sm120kit_restarts_total", "replica-0") == 3


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[1, 2]",
        '{"profile": "x", "status": "ready", "supervisor_pid": "123"}',  # a pid that is text
        '{"status": "ready"}',  # no supervisor_pid
    ],
)
def test_a_damaged_state_is_down_not_an_error(tmp_path, processes, serve, content):
    good = supervised(tmp_path / "good", "replica-0", "replica", [0])
    good.update(status=RunStatus.READY, server_pid=processes().pid, last_health=health())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "state.json").write_text(content)
    members = [
        Member("replica-0", "replica", tmp_path / "good"),
        Member("replica-1", "replica", tmp_path / "bad"),
        Member("replica-2", "replica", tmp_path / "never-written"),
    ]
    found = samples(serve(lambda: members))
    assert value(found, "sm120kit_ready", "replica-0") == 1  # the others are still reported
    assert status_of(found, "replica-1") == "damaged"
    assert status_of(found, "replica-2") == "absent"
    for name in ("replica-1", "replica-2"):
        assert value(found, "sm120kit_up", name) == 0
        assert value(found, "sm120kit_ready", name) == 0
        assert value(found, "sm120kit_restarts_total", name) is None


def gpu(index: int, total_mib: int, used_mib: int) -> Gpu:
    return Gpu(
        index=index,
        name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        compute_capability="12.0",
        memory_total_mib=total_mib,
        memory_used_mib=used_mib,
        memory_free_mib=total_mib - used_mib,
    )


def test_gpu_memory_held_is_summed_over_the_members_gpus(tmp_path, processes, serve):
    node = [gpu(0, 97887, 90000), gpu(1, 97887, 85000), gpu(2, 97887, 500)]
    replica = supervised(tmp_path / "replica-0", "replica-0", "replica", [0, 1])
    replica.update(status=RunStatus.READY, server_pid=processes().pid)
    backoff = supervised(tmp_path / "replica-1", "replica-1", "replica", [2])
    backoff.update(status=RunStatus.BACKOFF, server_pid=None)  # down, yet what its GPU holds is reported
    supervised(tmp_path / "router", "router", "router", [])
    elsewhere = supervised(tmp_path / "replica-2", "replica-2", "replica", [7])  # not a GPU of this node
    elsewhere.update(status=RunStatus.READY, server_pid=processes().pid)
    members = [
        Member("replica-0", "replica", tmp_path / "replica-0"),
        Member("replica-1", "replica", tmp_path / "replica-1"),
        Member("router", "router", tmp_path / "router"),
        Member("replica-2", "replica", tmp_path / "replica-2"),
    ]
    reads = []

    def read_gpus():
        reads.append(1)
        return node

    server = serve(lambda: members, read_gpus=read_gpus)
    found = samples(server)
    assert value(found, "sm120kit_gpu_memory_used_bytes", "replica-0") == (90000 + 85000) * MIB
    assert value(found, "sm120kit_gpu_memory_used_bytes", "replica-1") == 500 * MIB
    assert value(found, "sm120kit_gpu_memory_used_bytes", "router") == 0
    assert value(found, "sm120kit_gpu_memory_used_bytes", "replica-2") is None
    assert len(reads) == 1  # NVML once per scrape, not once per member

    node[0] = gpu(0, 97887, 1000)  # the replica's server let go of GPU 0
    found = samples(server)
    assert value(found, "sm120kit_gpu_memory_used_bytes", "replica-0") == (1000 + 85000) * MIB


@pytest.mark.parametrize("read_gpus", [None, "unavailable"])
def test_without_nvml_there_is_no_gpu_sample(tmp_path, processes, serve, read_gpus):
    def unavailable():
        raise NvmlUnavailable("no NVIDIA driver: NVML cannot start (NVML Shared Library Not Found)")

    replica = supervised(tmp_path / "replica-0", "replica-0", "replica", [0])
    replica.update(status=RunStatus.READY, server_pid=processes().pid)
    server = serve(
        lambda: [Member("replica-0", "replica", tmp_path / "replica-0")], read_gpus=read_gpus and unavailable
    )
    found = samples(server)
    assert value(found, "sm120kit_gpu_memory_used_bytes", "replica-0") is None
    assert value(found, "sm120kit_ready", "replica-0") == 1


def test_openmetrics_scrape_parses_too(tmp_path, processes, serve):
    """Prometheus asks for OpenMetrics first; prometheus_client answers in it: valid there too."""
    replica = supervised(tmp_path / "replica-0", "replica-0", "replica", [0])
    replica.update(status=RunStatus.READY, server_pid=processes().pid, last_health=health())
    server = serve(lambda: [Member("replica-0", "replica", tmp_path / "replica-0")], read_gpus=lambda: [gpu(0, 10, 5)])
    text = scrape(server, accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert text.rstrip().endswith("# EOF")
    types = {f.name: f.type for f in openmetrics_families(text)}
    assert types["sm120kit_restarts"] == "counter"
    assert types["sm120kit_member"] == "info"
    assert types["sm120kit_up"] == "gauge"


def test_only_metrics_is_served(tmp_path, serve):
    server = serve(list)
    assert server.url.endswith(f":{server.port}/metrics")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=5)
    assert refused.value.code == 404
    assert "/metrics" in refused.value.read().decode()
    assert scrape(server).strip().startswith("# HELP")  # no members: the families, no samples


def metrics_threads() -> int:
    return sum(t.name == "sm120kit-metrics" for t in threading.enumerate())


def test_a_port_in_use_is_a_user_error(serve):
    with socket.socket() as other:  # another program's listener, on a port this test chose
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        before = metrics_threads()
        with pytest.raises(UserError) as taken:
            start_metrics_server("127.0.0.1", port, PROFILE, list)
        assert f"metrics port {port}" in taken.value.message
        assert f"pid {os.getpid()}" in taken.value.message  # what holds it, where psutil can tell
        assert "--metrics-port" in taken.value.hint
        assert metrics_threads() == before  # nothing left running

    first = serve(list)
    with pytest.raises(UserError, match=f"metrics port {first.port}"):
        start_metrics_server("127.0.0.1", first.port, PROFILE, list)  # no silent sharing (SO_REUSEPORT)
    assert scrape(first)


def test_a_host_that_is_not_here_is_a_user_error():
    with pytest.raises(UserError) as bad:
        start_metrics_server("192.0.2.1", 0, PROFILE, list)  # TEST-NET-1: never an address of this node
    assert "192.0.2.1" in bad.value.message
    assert "server.host" in bad.value.hint


def test_close_frees_the_port(serve):
    server = start_metrics_server("127.0.0.1", 0, PROFILE, list)
    port = server.port
    assert scrape(server)
    server.close()
    server.close()  # a second close does nothing
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    again = serve(list, port=port)  # the same port binds again at once
    assert again.port == port
    assert scrape(again)
