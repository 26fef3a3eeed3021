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
left, every port of the fleet free.

The decisions are sm120kit.fleet.machine's; this module carries them out: it spawns,
reaps and signals the members' supervisors, reads their records and lines, calls the
router's worker API, and writes the fleet's record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, TextIO

import psutil

from sm120kit.exit_codes import ExitCode
from sm120kit.fleet.machine import (
    Action,
    AddWorker,
    AskReady,
    Connect,
    ListWorkers,
    Machine,
    Member,
    RemoveWorker,
    Spawn,
    StopMembers,
)
from sm120kit.fleet.member import OUTPUT
from sm120kit.followup import complete
from sm120kit.serve import procs
from sm120kit.serve.clock import SYSTEM_CLOCK, Clock
from sm120kit.serve.host import LocalHost
from sm120kit.serve.machine import Event, Exit, Say, Update
from sm120kit.serve.rundir import RunRecord
from sm120kit.serve.status import EventKind, RunStatus

if TYPE_CHECKING:
    from sm120kit.fleet.router import RouterClient

TICK_S = 0.25  # how often the members' records are read
MEMBER_STOP_GRACE_S = 30.0  # past the server's own stop timeout: the member's proof of its stop


@dataclass
class MemberProcess:
    """A member's supervisor, and its lines, open for the fleet's output."""

    proc: subprocess.Popen
    output: BinaryIO
    partial: bytes = b""


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
        out: TextIO | None = None,
        host: LocalHost | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.record, self.stop_timeout_s, self.api_key = record, stop_timeout_s, api_key
        self.out = out or sys.stdout
        self.host = host or LocalHost()
        self.clock = clock
        self.machine = Machine(name, replicas, router, remote, clock)
        self.stop_signals: list[int] = []
        self._processes: dict[str, MemberProcess] = {}  # member name -> its supervisor, once started
        self._client: RouterClient | None = None  # the router's worker API, once the machine connects

    @property
    def members(self) -> list[Member]:
        return self.machine.members

    def say(self, text: str) -> None:
        at = time.strftime("%H:%M:%S", time.localtime(self.clock.time()))
        self.out.write(f"[fleet {at}] {complete(text)}\n")  # a command it names, for this serve
        self.out.flush()

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> ExitCode:
        self.host.listen(self.stop_signals.append)
        procs.become_subreaper()
        me = psutil.Process()
        self._apply(self.machine.launch(me.pid, me.create_time()))
        try:
            self._apply(self.machine.start())
            while (code := self._step()) is None:
                self.host.wait(TICK_S)
            return code
        except BaseException as exc:
            self.record.event(EventKind.SUPERVISOR_ERROR, error=f"{type(exc).__name__}: {exc}")
            self._stop_members()
            self.record.update(status=RunStatus.STOPPED, since=self.clock.time(), clean=False)
            raise

    def _step(self) -> ExitCode | None:
        """What happened since the last wake-up, told to the machine: a stop signal first."""
        if self.stop_signals:
            return self._apply(self.machine.signalled(signal.Signals(self.stop_signals[0]).name))
        self._reap()
        for m in self.members:
            self._read(m)
        return self._apply(self.machine.tick())

    def _apply(self, actions: list[Action]) -> ExitCode | None:
        """Carry out the machine's actions in order, and those that their outcomes lead to;
        the exit code once one says to exit."""
        for action in actions:
            if isinstance(action, Exit):
                return action.code
            if (code := self._apply(self._do(action))) is not None:
                return code
        return None

    def _do(self, action: Action) -> list[Action]:
        """One action; what the machine makes of its outcome."""
        match action:
            case Say(text):
                self.say(text)
            case Event(kind, fields):
                self.record.event(kind, **fields)
            case Update(fields):
                self.record.update(**fields)
            case Spawn(name):
                return self.machine.spawned(name, self._spawn(self.machine.member(name)))
            case Connect(host, port):
                from sm120kit.fleet.router import RouterClient

                self._client = RouterClient(host, port, self.api_key)
            case StopMembers():
                self._stop_members()
                return self.machine.stopped(self._ports_in_use())
            case AskReady() | ListWorkers() | AddWorker() | RemoveWorker():
                return self._call_router(action)
        return []

    def _call_router(self, action: AskReady | ListWorkers | AddWorker | RemoveWorker) -> list[Action]:
        """A call of the router's worker API; a failed one is tried again on the next tick
        (the router's own probes decide its fate)."""
        from sm120kit.fleet.router import RouterError

        client = self._client
        assert client is not None, "the machine calls the router only after a Connect"
        try:
            match action:
                case AskReady():
                    return self.machine.served(client.ready())
                case ListWorkers():
                    return self.machine.listed(client.workers())
                case AddWorker(url, member):
                    client.add_worker(url)
                    return self.machine.worker_added(url, member)
                case RemoveWorker(url, member):
                    client.remove_worker(url)
                    return self.machine.worker_removed(member)
        except RouterError as exc:
            return self.machine.router_failed(str(exc))
        return []

    # -- members -----------------------------------------------------------------------

    def _spawn(self, m: Member) -> int:
        m.dir.mkdir(parents=True, exist_ok=True)
        (m.dir / "state.json").unlink(missing_ok=True)  # the last run's: not this one's state
        out = m.dir / OUTPUT
        with open(out, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sm120kit.fleet.member", str(m.dir)],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SM120KIT_FLEET_PID": str(os.getpid())},
                start_new_session=True,  # a terminal's Ctrl-C reaches the fleet, which stops them in order
                close_fds=True,
            )
        self._processes[m.name] = MemberProcess(proc, open(out, "rb"))  # noqa: SIM115 (closed when the member has ended)
        return proc.pid

    def _reap(self) -> None:
        reaped = procs.reap()
        for m in self.members:
            if m.alive and m.pid in reaped:
                status = reaped[m.pid]
                code, how = procs.exit_description(status)
                exit_code = code if code is not None else 128 + os.WTERMSIG(status)  # as a shell says it
                self._processes[m.name].proc.returncode = exit_code
                self._read(m)
                self._processes[m.name].output.close()
                self._apply(self.machine.exited(m.name, exit_code, how))

    def _read(self, m: Member) -> None:
        """The member's state.json and its supervisor's new lines (shown as the member's)."""
        from sm120kit.serve.rundir import read_state

        self.machine.seen(m.name, read_state(m.dir))
        process = self._processes.get(m.name)
        if process is None or process.output.closed:
            return
        data = process.partial + process.output.read()
        *lines, process.partial = data.split(b"\n")
        for line in lines:
            self.out.write(f"{m.name} | {line.decode('utf-8', errors='replace')}\n")
        self.out.flush()

    # -- the stop ----------------------------------------------------------------------

    def _stop_members(self) -> None:
        """The router, then the replicas: SIGTERM to each member's supervisor, which stops
        its server as `serve` does; a second stop signal is passed on (hurry)."""
        began = min(len(self.stop_signals), 1)  # the signal that began the stop (none: giving up)
        router, replicas = self.machine.router, self.machine.replicas
        for group in ([router] if router else [], replicas):
            live = [m for m in group if m.alive]
            if not live:
                continue
            self._signal(live, signal.SIGTERM)
            deadline = self.clock.monotonic() + self.stop_timeout_s + MEMBER_STOP_GRACE_S
            hurried: set[str] = set()
            while any(m.alive for m in live) and self.clock.monotonic() < deadline:
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
                if m.alive and m.pid is not None:  # stuck: SIGKILL; its server dies with it (PR_SET_PDEATHSIG)
                    self.say(f"{m.name}'s supervisor did not stop in time: SIGKILL")
                    procs.stop(m.pid, None, 5.0, pids={m.pid})
                    self._reap()

    def _ports_in_use(self) -> list[str]:
        """The fleet's ports still bound after the stop, of the members that were started."""
        return [
            f"{port} ({m.name}: {what})"
            for m in self.members
            if m.pid is not None
            for what, host, port in m.ports
            if procs.port_in_use(host, port)
        ]

    def _signal(self, members: list[Member], sig: int) -> None:
        for m in members:
            if m.pid is None:  # never started: nothing to signal
                continue
            try:
                os.kill(m.pid, sig)
            except ProcessLookupError:
                pass
