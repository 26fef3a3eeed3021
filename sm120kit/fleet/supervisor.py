"""Keeps a fleet up: every replica served here and the router are members, each supervised
by `serve`'s own Supervisor in a process of its own (sm120kit.fleet.member: its log,
readiness by generation, probes, restarts with backoff, crash-loop limit, diagnosis, the
stop's proof). This process starts them, starts the router when the first replica is
ready, and keeps the router's worker list true to the replicas' states: a replica that
stops being ready (died, hung, restarting) is taken out through the router's worker API,
and put back when it generates again; after a router restart every ready replica is added
again. It gives up when every replica here, or the router, has given up.

Stop (a signal, or giving up): the router first (no new requests), then the replicas,
all at once, each draining and proving its own stop; then the fleet's proof: no member
left, every port of the fleet free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import psutil

from sm120kit.exit_codes import ExitCode
from sm120kit.fleet.member import OUTPUT
from sm120kit.serve import procs
from sm120kit.serve.host import LocalHost
from sm120kit.serve.rundir import RunRecord
from sm120kit.serve.status import EventKind, RunStatus

TICK_S = 0.25  # how often the members' records are read
RECONCILE_S = 2.0  # how often the router's worker list is read back
REGISTER_GRACE_S = 10.0  # the router registers a worker in a background job (it probes it first)
MEMBER_STOP_GRACE_S = 30.0  # past the server's own stop timeout: the member's proof of its stop


@dataclass
class Member:
    name: str  # "replica-0", "router"
    role: str  # "replica" | "router"
    dir: Path
    url: str  # where it answers
    ports: list[tuple[str, str, int]]  # its port plan, proven free after the fleet's stop
    proc: subprocess.Popen | None = None
    exit_code: int | None = None
    state: dict = field(default_factory=dict)
    routed_at: float | None = None  # a replica: when it was added to the router's worker list (None: it is not)
    output: BinaryIO | None = None
    partial: bytes = b""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None

    @property
    def ready(self) -> bool:
        return self.alive and self.state.get("status") == RunStatus.READY


class Fleet:
    def __init__(
        self,
        name: str,
        replicas: list[Member],
        router: Member | None,
        remote: list[str],  # worker URLs served elsewhere: routed to, never started
        record: RunRecord,
        stop_timeout_s: float,
        api_key: str | None = None,
        out=None,
        host: LocalHost | None = None,
    ) -> None:
        self.name, self.replicas, self.router, self.remote = name, replicas, router, remote
        self.record, self.stop_timeout_s, self.api_key = record, stop_timeout_s, api_key
        self.out = out or sys.stdout
        self.host = host or LocalHost()
        self.stop_signals: list[int] = []
        self._router_server: int | None = None  # the router server pid the worker list was built for
        self._remote_routed: dict[str, float] = {}  # URL served elsewhere -> when it was added
        self._client = None
        self._reconciled = 0.0
        self._serving = False  # the router's /readiness: it has a healthy worker to send to
        self._announced: set[str] = set()  # URLs served elsewhere whose routing was said

    @property
    def members(self) -> list[Member]:
        return [*self.replicas, *([self.router] if self.router else [])]

    def say(self, text: str) -> None:
        self.out.write(f"[fleet {time.strftime('%H:%M:%S')}] {text}\n")
        self.out.flush()

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> ExitCode:
        self.host.listen(self.stop_signals.append)
        procs.become_subreaper()
        me = psutil.Process()
        self.record.update(
            profile=self.name,
            role="fleet",
            status=RunStatus.STARTING,
            since=time.time(),
            supervisor_pid=me.pid,
            supervisor_started=me.create_time(),
            members=[m.name for m in self.members],
            url=self.router.url if self.router else None,
            host=urlsplit(self.router.url).hostname if self.router else "-",  # where `ps` says it serves
            port=urlsplit(self.router.url).port if self.router else None,
            restarts=0,
        )
        try:
            for m in self.replicas:
                self._spawn(m)
            if not self.replicas and self.router:  # --router-only: the replicas are elsewhere
                self._spawn(self.router)
            while (code := self._step()) is None:
                self.host.wait(TICK_S)
            return code
        except BaseException as exc:
            self.record.event(EventKind.SUPERVISOR_ERROR, error=f"{type(exc).__name__}: {exc}")
            self._stop_members()
            self.record.update(status=RunStatus.STOPPED, since=time.time(), clean=False)
            raise

    def _step(self) -> ExitCode | None:
        if self.stop_signals:
            sig = signal.Signals(self.stop_signals[0]).name
            self.say(f"{sig}: stopping the fleet (the router first, then the replicas)")
            self.record.event(EventKind.STOPPING, signal=sig)
            return self._stop(gave_up=False)
        self._reap()
        for m in self.members:
            self._read(m)
        if self.router is not None:
            if self.router.proc is None and any(m.ready for m in self.replicas):
                self._spawn(self.router)
            if self.router.alive:
                self._route()
        gone = [m for m in self.replicas if m.exit_code is not None]
        if self.replicas and len(gone) == len(self.replicas):
            return self._give_up("every replica's supervisor has ended (crash-loop limit)", gone)
        if self.router is not None and self.router.exit_code is not None:
            return self._give_up("the router's supervisor has ended (crash-loop limit)", [self.router])
        ready = sum(m.ready for m in self.replicas)
        # ready: a replica here generates and, with a router, the router has a worker to send to
        # (its /readiness: registration is a job of its own, and --router-only's workers are elsewhere)
        routing = self.router is None or (self.router.ready and self._serving)
        status = RunStatus.READY if routing and (ready or not self.replicas) else RunStatus.STARTING
        if status is RunStatus.READY and self.record.state.get("status") != status:
            where = self.router.url if self.router else ", ".join(m.url for m in self.replicas if m.ready)
            served = f"{ready} of {len(self.replicas)} replica(s) here generate" if self.replicas else ""
            elsewhere = f"{len(self.remote)} served elsewhere" if self.remote else ""
            self.say(f"ready: {'; '.join(w for w in (served, elsewhere) if w)}; serving at {where}")
            self.record.event(EventKind.READY, replicas=ready, url=where)
        restarts = sum(m.state.get("restarts", 0) for m in self.members)
        if (self.record.state.get("status"), self.record.state.get("ready_replicas")) != (status, ready):
            self.record.update(
                status=status,
                since=time.time() if self.record.state.get("status") != status else self.record.state["since"],
                ready_replicas=ready,
                restarts=restarts,
            )
        elif self.record.state.get("restarts") != restarts:
            self.record.update(restarts=restarts)
        return None

    # -- members -----------------------------------------------------------------------

    def _spawn(self, m: Member) -> None:
        m.dir.mkdir(parents=True, exist_ok=True)
        (m.dir / "state.json").unlink(missing_ok=True)  # the last run's: not this one's state
        out = m.dir / OUTPUT
        with open(out, "wb") as fh:
            m.proc = subprocess.Popen(
                [sys.executable, "-m", "sm120kit.fleet.member", str(m.dir)],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SM120KIT_FLEET_PID": str(os.getpid())},
                start_new_session=True,  # a terminal's Ctrl-C reaches the fleet, which stops them in order
                close_fds=True,
            )
        m.output = open(out, "rb")  # noqa: SIM115 (closed when the member has ended)
        self.record.event(EventKind.MEMBER_STARTED, member=m.name, pid=m.proc.pid)
        if m.role == "router":
            self.say(f"starting the router at {m.url}")

    def _reap(self) -> None:
        reaped = procs.reap()
        for m in self.members:
            if m.alive and m.proc.pid in reaped:
                status = reaped[m.proc.pid]
                code, how = procs.exit_description(status)
                m.exit_code = code if code is not None else 128 + os.WTERMSIG(status)  # as a shell says it
                m.proc.returncode = m.exit_code
                self._read(m)
                m.output.close()
                self.say(f"{m.name}'s supervisor ended ({how}): {_meaning(m.exit_code)}")
                self.record.event(EventKind.MEMBER_EXITED, member=m.name, exit_code=m.exit_code)

    def _read(self, m: Member) -> None:
        """The member's state.json and its supervisor's new lines (shown as the member's)."""
        from sm120kit.serve.rundir import read_state

        m.state = read_state(m.dir) or m.state
        if m.output is None or m.output.closed:
            return
        data = m.partial + m.output.read()
        *lines, m.partial = data.split(b"\n")
        for line in lines:
            self.out.write(f"{m.name} | {line.decode('utf-8', errors='replace')}\n")
        self.out.flush()

    # -- the router's worker list ------------------------------------------------------

    def _route(self) -> None:
        from sm120kit.fleet.router import RouterClient, RouterError

        router = self.router
        if not router.ready:
            return
        if router.state.get("server_pid") != self._router_server:  # a new router: an empty worker list
            self._router_server = router.state.get("server_pid")
            self._remote_routed.clear()
            self._serving = False
            for m in self.replicas:
                m.routed_at = None
            self._client = RouterClient(router.state["host"], router.state["port"], self.api_key)
        try:
            self._reconcile()
            for url in self.remote:
                if url not in self._remote_routed:
                    self._client.add_worker(url)
                    self._remote_routed[url] = time.monotonic()
                    if url not in self._announced:  # added again while the router cannot register it: said once
                        self._announced.add(url)
                        self.record.event(EventKind.ROUTED, member=url, url=url)
                        self.say(f"routing to {url} (served elsewhere; the router's health checks watch it)")
            for m in self.replicas:
                if m.ready and m.routed_at is None:
                    self._client.add_worker(m.url)
                    m.routed_at = time.monotonic()
                    self.record.event(EventKind.ROUTED, member=m.name, url=m.url)
                    self.say(f"{m.name} is ready: routing to it ({m.url})")
                elif m.routed_at is not None and not m.ready:
                    self._client.remove_worker(m.url)
                    m.routed_at = None
                    status = m.state.get("status") if m.alive else "ended"
                    self.record.event(EventKind.UNROUTED, member=m.name, url=m.url, status=str(status))
                    self.say(f"{m.name} is not ready ({status}): taken out of the router")
            if not self._serving:
                self._serving = self._client.ready()
        except RouterError as exc:  # tried again on the next tick; the router's own probes decide its fate
            self.say(f"the router's worker API: {exc}")

    def _reconcile(self) -> None:
        """Read the router's worker list back now and then: a worker whose registration job
        failed (it went away while the router probed it) is added again."""
        now = time.monotonic()
        if now - self._reconciled < RECONCILE_S:
            return
        self._reconciled = now
        self._serving = self._client.ready()
        listed = {u.rstrip("/") for u in self._client.workers()}
        for m in self.replicas:
            if m.routed_at is not None and now - m.routed_at > REGISTER_GRACE_S and m.url not in listed:
                m.routed_at = None
        for url, added in list(self._remote_routed.items()):
            if now - added > REGISTER_GRACE_S and url not in listed:
                del self._remote_routed[url]

    # -- the end -----------------------------------------------------------------------

    def _give_up(self, why: str, ended: list[Member]) -> ExitCode:
        """FINDINGS once stopped clean; ERROR where each member that ended did with ERROR
        (its server lacks a module: no restart of the fleet mends that either)."""
        self.say(f"giving up: {why}")
        self.record.event(EventKind.GAVE_UP, reason=why)
        code = self._stop(gave_up=True)
        if code is ExitCode.OK and all(m.exit_code == ExitCode.ERROR for m in ended):
            return ExitCode.ERROR
        return ExitCode.FINDINGS if code is ExitCode.OK else code

    def _stop(self, gave_up: bool) -> ExitCode:
        began = time.monotonic()
        self.record.update(status=RunStatus.STOPPING, since=time.time())
        self._stop_members()
        ports = [
            f"{port} ({m.name}: {what})"
            for m in self.members
            if m.proc is not None
            for what, host, port in m.ports
            if procs.port_in_use(host, port)
        ]
        left = [m.name for m in self.members if m.alive]
        unclean = [m.name for m in self.members if m.exit_code == ExitCode.UNCLEAN]
        clean = not (ports or left or unclean)
        self.record.event(
            EventKind.STOPPED,
            clean=clean,
            members={m.name: m.exit_code for m in self.members if m.proc is not None},
            ports_in_use=ports,
            members_left=left,
            seconds=round(time.monotonic() - began, 3),
        )
        status = RunStatus.GAVE_UP if gave_up else RunStatus.STOPPED
        self.record.update(status=status, since=time.time(), clean=clean, ready_replicas=0)
        if clean:
            self.say(f"fleet stopped in {time.monotonic() - began:.1f} s: every member stopped clean, every port free")
            return ExitCode.OK
        problems = ([f"ports still bound: {', '.join(ports)}"] if ports else []) + (
            [f"members that did not stop: {', '.join(left)}"] if left else []
        )
        problems += [f"members whose stop was not clean: {', '.join(unclean)} (see their own lines)"] if unclean else []
        self.say("fleet stopped UNCLEAN: " + "; ".join(problems))
        return ExitCode.UNCLEAN

    def _stop_members(self) -> None:
        """The router, then the replicas: SIGTERM to each member's supervisor, which stops
        its server as `serve` does; a second stop signal is passed on (hurry)."""
        began = min(len(self.stop_signals), 1)  # the signal that began the stop (none: giving up)
        for group in ([self.router] if self.router else [], self.replicas):
            live = [m for m in group if m.alive]
            if not live:
                continue
            self._signal(live, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s + MEMBER_STOP_GRACE_S
            hurried: set[str] = set()
            while any(m.alive for m in live) and time.monotonic() < deadline:
                if len(self.stop_signals) > began:  # another Ctrl-C, now or while an earlier group stopped
                    # their second SIGTERM (hurry), once they have taken the first: two at once would be one
                    taken = [
                        m
                        for m in live
                        if m.alive and m.name not in hurried and m.state.get("status") == RunStatus.STOPPING
                    ]
                    self._signal(taken, signal.SIGTERM)
                    hurried.update(m.name for m in taken)
                self.host.wait(TICK_S)
                self._reap()
                for m in live:
                    self._read(m)
            for m in live:
                if m.alive:  # its supervisor is stuck: SIGKILL; its server dies with it (PR_SET_PDEATHSIG)
                    self.say(f"{m.name}'s supervisor did not stop in time: SIGKILL")
                    procs.stop(m.proc.pid, None, 5.0, pids={m.proc.pid})
                    self._reap()

    def _signal(self, members: list[Member], sig: int) -> None:
        for m in members:
            try:
                os.kill(m.proc.pid, sig)
            except ProcessLookupError:
                pass


def _meaning(code: int) -> str:
    if code > 128:  # killed (the OOM killer, kill -9): its server died with it (PR_SET_PDEATHSIG)
        return "its supervisor was killed; the replica is out of the fleet until the fleet is restarted"
    return {
        ExitCode.OK: "stopped clean",
        ExitCode.FINDINGS: "gave up (crash-loop limit) or failed its smoke",
        ExitCode.ERROR: "refused to start, or its server lacks a module (a restart cannot mend that)",
        ExitCode.UNCLEAN: "stopped, but something of its server was left",
    }.get(code, f"exit code {code}")
