"""The supervisor's own state in the Prometheus text format: `serve --metrics-port N` (or
`server.metrics_port`) serves GET /metrics on host:N, for one server or for every member of
a fleet (its replicas and its router). Each scrape reads the members' state.json as their
supervisors last wrote it (nothing is cached), and, where the node has a driver, NVML's
memory in use on the members' GPUs. sglang's own metrics (`--enable-metrics`) are served by
each sglang server on its own port, /metrics; scrape both (docs/serve.md, Metrics). The endpoint
has no authentication: bind it to an address that only your Prometheus reaches.

Every metric carries the labels profile (the profile served), member ("replica-0",
"router", or the profile's name for a single server) and role ("replica", "router",
"server"):

    sm120kit_up                        gauge    1: the member's supervisor is alive and its
                                                server process is running (started, not
                                                exited); 0 otherwise, and for a member whose
                                                state.json is not written yet or cannot be
                                                read (damaged, unreadable).
    sm120kit_ready                     gauge    1: up, and its status is "ready" (it generates
                                                and its probes pass); 0 otherwise.
    sm120kit_status                    gauge    one sample per status, label status: 1 for the
                                                member's status now, 0 for the others.
                                                Statuses: launching, starting, ready, unhealthy,
                                                backoff, stopping, stopped, gave-up, as the
                                                supervisor writes them; "supervisor gone" (its
                                                supervisor died without stopping: as `ps` says),
                                                "damaged" (state.json is no record a supervisor
                                                writes), "unreadable" (state.json cannot be
                                                read: its permissions, an I/O error), "absent"
                                                (no state.json yet).
    sm120kit_restarts_total            counter  restarts of the member's server by this
                                                supervisor (state.json's "restarts"); it goes
                                                back to 0 when a new supervisor starts.
    sm120kit_since_ready_seconds       gauge    seconds since the server's current run became
                                                ready, while it is ready; 0 when it is not
                                                (unhealthy included). A run that passes probes
                                                again counts from its first ready; a restart
                                                starts it over.
    sm120kit_probe_ok                  gauge    1: the supervisor's last liveness probe passed;
                                                0: it failed. Only while the supervisor is alive
                                                and once the server has been ready.
    sm120kit_probe_latency_seconds     gauge    how long that last probe took.
    sm120kit_probe_timestamp_seconds   gauge    when that last probe ended (Unix time): a value
                                                that stops moving is a supervisor that stopped
                                                probing.
    sm120kit_gpu_memory_used_bytes     gauge    memory in use (NVML: total - free, the
                                                driver's own reservation included, whoever
                                                holds it) summed over the member's GPUs
                                                (state.json's "gpus"): 0 for the router. Kept
                                                while the member is down: memory that stays held
                                                is what to look at then. Absent without NVML.
    sm120kit_member_info               info     always 1; labels url (where the member answers)
                                                and gpus ("0,1": the NVML indices it may use).
                                                (The text format 0.0.4 types it gauge.)

While a member's state.json is absent, damaged or unreadable it has up 0, ready 0, its
status and its member_info (url and gpus empty), and no other sample: such a file is never
an error of the scrape.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psutil

from sm120kit.errors import UserError
from sm120kit.serve import procs
from sm120kit.serve.record_schema import DamagedRecord, read_run_state
from sm120kit.serve.rundir import _supervisor_alive
from sm120kit.serve.status import TERMINAL, RunStatus

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from prometheus_client.metrics_core import Metric

    from sm120kit.node.nvml_schema import Gpu

MIB = 1 << 20
LABELS = ["profile", "member", "role"]
ABSENT = "absent"  # no state.json yet: the member's supervisor has not written one
STATUSES = [str(s) for s in RunStatus] + [ABSENT]
PATH = "/metrics"


@dataclass(frozen=True)
class Member:
    name: str  # "replica-0", "router", or the profile's name for a single serve
    role: str  # "replica" | "router" | "server"
    run_dir: Path  # holds its state.json (written by its supervisor; may not exist yet)


@dataclass
class _Seen:
    """One member at one scrape."""

    member: Member
    state: dict | None  # None: absent or damaged
    status: str
    alive: bool  # its supervisor
    running: bool  # its server process


def _read(member: Member) -> _Seen:
    path = member.run_dir / "state.json"
    try:
        state = read_run_state(path)
    except FileNotFoundError:
        return _Seen(member, None, ABSENT, False, False)
    except DamagedRecord:
        return _Seen(member, None, str(RunStatus.DAMAGED), False, False)
    except OSError:  # its permissions, an I/O error: the record may be sound
        return _Seen(member, None, str(RunStatus.UNREADABLE), False, False)
    alive = _supervisor_alive(state)
    status = state["status"]
    if not alive and status not in TERMINAL:
        status = str(RunStatus.SUPERVISOR_GONE)  # as `ps` says it
    return _Seen(member, state, status, alive, alive and _server_running(state))


def _server_running(state: dict) -> bool:
    """The server_pid of state.json is a live process started by this supervisor (not a
    zombie, not a later process that reused the pid)."""
    pid = state.get("server_pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
        return proc.status() != psutil.STATUS_ZOMBIE and started >= (state.get("supervisor_started") or 0) - 1.0
    except psutil.Error:
        return False


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _gpus(state: dict) -> list[int] | None:
    gpus = state.get("gpus")
    if isinstance(gpus, list) and all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
        return gpus
    return None


class _Collector:
    """Reads the members at each scrape (prometheus_client calls collect() per request)."""

    def __init__(
        self, profile: str, members: Callable[[], list[Member]], read_gpus: Callable[[], list[Gpu]] | None
    ) -> None:
        self.profile = profile
        self.members = members
        self.read_gpus = read_gpus

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the members are read at scrape time

    def _in_use(self, seen: list[_Seen]) -> dict[int, int] | None:
        """GPU index -> bytes in use; None without NVML (or with no member on a GPU)."""
        if self.read_gpus is None or not any(s.state and _gpus(s.state) is not None for s in seen):
            return None
        try:
            return {gpu.index: gpu.in_use_mib * MIB for gpu in self.read_gpus()}
        except Exception:  # NvmlUnavailable, a GPU lost mid-read: no GPU samples, the rest stands
            return None

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        now = time.time()
        seen = [_read(m) for m in self.members()]
        in_use = self._in_use(seen)

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS + list(extra))

        up = gauge("sm120kit_up", "1: the member's supervisor is alive and its server process runs.")
        ready = gauge("sm120kit_ready", "1: the member is up and ready (it generates; its probes pass).")
        status = gauge("sm120kit_status", "1 for the member's status now, 0 for the others.", ["status"])
        restarts = CounterMetricFamily(
            "sm120kit_restarts", "Restarts of the member's server by its supervisor.", labels=LABELS
        )
        since_ready = gauge("sm120kit_since_ready_seconds", "Seconds since the server became ready; 0: not ready.")
        probe_ok = gauge("sm120kit_probe_ok", "1: the last liveness probe passed; 0: it failed.")
        probe_latency = gauge("sm120kit_probe_latency_seconds", "How long the last liveness probe took.")
        probe_at = gauge("sm120kit_probe_timestamp_seconds", "When the last liveness probe ended (Unix time).")
        gpu_memory = gauge(
            "sm120kit_gpu_memory_used_bytes", "Memory in use (NVML) on the member's GPUs, summed over them."
        )
        info = InfoMetricFamily("sm120kit_member", "Where the member answers and the GPUs it may use.", labels=LABELS)

        for s in seen:
            labels = [self.profile, s.member.name, s.member.role]
            is_ready = s.running and s.status == RunStatus.READY
            up.add_metric(labels, 1 if s.running else 0)
            ready.add_metric(labels, 1 if is_ready else 0)
            for word in STATUSES if s.status in STATUSES else [*STATUSES, s.status]:  # a word a newer one wrote
                status.add_metric([*labels, word], 1 if word == s.status else 0)
            state = s.state
            if state is None:
                info.add_metric(labels, {"url": "", "gpus": ""})
                continue
            gpus = _gpus(state)
            url = state.get("url")
            info.add_metric(
                labels,
                {"url": url if isinstance(url, str) else "", "gpus": ",".join(map(str, gpus or []))},
            )
            restarts.add_metric(labels, _number(state.get("restarts")) or 0)
            since = _number(state.get("since"))
            since_ready.add_metric(labels, max(0.0, now - since) if is_ready and since is not None else 0)
            health = state.get("last_health")
            if s.alive and isinstance(health, dict):
                if isinstance(health.get("ok"), bool):
                    probe_ok.add_metric(labels, 1 if health["ok"] else 0)
                if (seconds := _number(health.get("seconds"))) is not None:
                    probe_latency.add_metric(labels, seconds)
                if (at := _number(health.get("at"))) is not None:
                    probe_at.add_metric(labels, at)
            if in_use is not None and gpus is not None and all(g in in_use for g in gpus):
                gpu_memory.add_metric(labels, sum(in_use[g] for g in gpus))

        yield from (up, ready, status, restarts, since_ready, probe_ok, probe_latency, probe_at, gpu_memory, info)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """A scrape every 15 s is not news: nothing on stderr."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight does not hold the supervisor's exit
    allow_reuse_port = False  # a second server on the port is an error, not a silent share


class MetricsServer:
    """GET /metrics on host:port, served by a daemon thread until close()."""

    def __init__(self, httpd: _Server, host: str) -> None:
        self._httpd = httpd
        # shutdown() waits for the loop's next look at its flag: every 0.05 s, not the default 0.5 s
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="sm120kit-metrics", daemon=True
        )
        self._closed = False
        self.host = host
        self.port: int = httpd.server_address[1]  # the one bound (port 0 asks for a free one)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PATH}"

    def close(self) -> None:
        """Stop serving and free the port; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _only_metrics(app: WSGIApplication) -> WSGIApplication:
    def route(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in (PATH, f"{PATH}/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"sm120kit serves its metrics at {PATH}\n".encode()]

    return route


def start_metrics_server(
    host: str,
    port: int,
    profile: str,
    members: Callable[[], list[Member]],
    read_gpus: Callable[[], list[Gpu]] | None = None,
) -> MetricsServer:
    """Serve the members' metrics on host:port (0: any free port; MetricsServer.port says
    which). members() is called at every scrape; read_gpus (sm120kit.node.nvml.read_gpus:
    GPUs with .index and .in_use_mib) too, once per scrape, where a member has GPUs.
    Raises UserError when host:port cannot be bound; nothing is left running then."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)  # not the global one: no process/platform collectors
    registry.register(_Collector(profile, members, read_gpus))
    app = _only_metrics(make_wsgi_app(registry))

    class Server(_Server):
        pass

    try:
        family, *_, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
        Server.address_family = family
        httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=_Quiet)  # an IP address: a str
    except OSError as exc:
        raise _bind_error(host, port, exc) from None
    return MetricsServer(httpd, host)


def _bind_error(host: str, port: int, exc: OSError) -> UserError:
    hint = "pass another port with --metrics-port N (or set server.metrics_port in the profile)"
    if exc.errno == errno.EADDRINUSE:
        holder = procs.port_holder(port)
        return UserError(
            f"metrics port {port} on {host} is in use (held by {holder})",
            f"stop what holds it, or {hint}",
        )
    if exc.errno == errno.EACCES:
        return UserError(f"metrics port {port} on {host}: permission denied (ports below 1024 need root)", hint)
    return UserError(
        f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
        "check server.host in the profile (an address of this node), or " + hint,
    )
