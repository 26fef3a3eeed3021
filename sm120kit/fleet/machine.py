"""The fleet supervisor's decisions, apart from its effects (sm120kit.fleet.supervisor
carries them out): when to start the router, which workers the router's list should
hold, what the fleet's status is, when to give up, and what a stop proved.

Each thing that happens is a method call: a member's supervisor started, ended, or wrote
its state; time passed (tick); the router's worker API answered; a stop signal came; the
members' stop is over. Each returns the actions to take, in order; an action with an
outcome (a router call, the members' stop) is answered by the method its docstring names,
which returns the actions that follow. The machine reads its clock and nothing else of the
world: tests drive it with a fake clock and assert the actions (as with sm120kit.serve.machine).

    starting --a replica ready--> (spawn the router) --router ready, /readiness--> ready
    ready, starting --tick--> (worker list: a ready replica added, one not ready removed)
    every replica's supervisor ended, or the router's --> gave-up (stop, exit 1; 2 where
                                                          each ended for a missing module)
    any --signalled--> stopping --stopped--> stopped (exit 0, or 4 where something was left)

TRANSITIONS is that diagram as data: the status moves only along it, and a move off it
raises IllegalTransition (a bug of the machine or of what drives it), as serve's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sm120kit.exit_codes import ExitCode
from sm120kit.serve.clock import Clock
from sm120kit.serve.machine import Event, Exit, IllegalTransition, Say, Update, event, update
from sm120kit.serve.status import EventKind, RunStatus

RECONCILE_S = 2.0  # how often the router's worker list is read back
REGISTER_GRACE_S = 10.0  # the router registers a worker in a background job (it probes it first)

TRANSITIONS: dict[RunStatus | None, frozenset[RunStatus]] = {
    None: frozenset({RunStatus.STARTING}),  # launched
    RunStatus.STARTING: frozenset({RunStatus.READY, RunStatus.STOPPING}),
    RunStatus.READY: frozenset({RunStatus.STARTING, RunStatus.STOPPING}),
    RunStatus.STOPPING: frozenset({RunStatus.STOPPED, RunStatus.GAVE_UP}),
    RunStatus.STOPPED: frozenset(),
    RunStatus.GAVE_UP: frozenset(),
}


@dataclass
class Member:
    name: str  # "replica-0", "router"
    role: str  # "replica" | "router"
    dir: Path
    url: str  # where it answers
    ports: list[tuple[str, str, int]]  # its port plan, proven free after the fleet's stop
    pid: int | None = None  # its supervisor's, once started
    exit_code: int | None = None  # its supervisor's, once ended
    state: dict = field(default_factory=dict)  # its state.json as last read
    routed_at: float | None = None  # a replica: when it was added to the router's worker list (None: it is not)

    @property
    def alive(self) -> bool:
        return self.pid is not None and self.exit_code is None

    @property
    def ready(self) -> bool:
        return self.alive and self.state.get("status") == RunStatus.READY


# -- actions: what the supervisor is to do, in order (Say, Event, Update, Exit: as serve's) --


@dataclass(frozen=True)
class Spawn:
    """Start the member's supervisor, then tell spawned()."""

    member: str


@dataclass(frozen=True)
class Connect:
    """A new router server: talk to its worker API at host:port from now on."""

    host: str
    port: int


@dataclass(frozen=True)
class AskReady:
    """Ask the router's /readiness, then tell served(); a RouterError: router_failed()."""


@dataclass(frozen=True)
class ListWorkers:
    """Read the router's worker list, then tell listed(); a RouterError: router_failed()."""


@dataclass(frozen=True)
class AddWorker:
    """Add url to the router, then tell worker_added(); a RouterError: router_failed()."""

    url: str
    member: str | None  # None: a worker served elsewhere


@dataclass(frozen=True)
class RemoveWorker:
    """Take the replica out of the router, then tell worker_removed(); a RouterError: router_failed()."""

    url: str
    member: str


@dataclass(frozen=True)
class StopMembers:
    """The router, then the replicas, each stopping its server; then tell stopped() the
    fleet's ports still bound."""


Action = Say | Event | Update | Exit | Spawn | Connect | AskReady | ListWorkers | AddWorker | RemoveWorker | StopMembers


class Machine:
    def __init__(
        self, name: str, replicas: list[Member], router: Member | None, remote: list[str], clock: Clock
    ) -> None:
        self.name, self.replicas, self.router, self.remote, self.clock = name, replicas, router, remote, clock
        self._status: RunStatus | None = None  # as the fleet's state.json says; moved by _enter() alone
        self.since: float | None = None
        self.ready_replicas: int | None = None
        self.restarts = 0
        self.router_server: int | None = None  # the router server pid the worker list was built for
        self.remote_routed: dict[str, float] = {}  # URL served elsewhere -> when it was added
        self.reconciled = 0.0  # when the router's worker list was last read back
        self.serving = False  # the router's /readiness: it has a healthy worker to send to
        self.announced: set[str] = set()  # URLs served elsewhere whose routing was said
        self._reconciling = False  # the /readiness asked for is the read-back's, not the round's last
        self._stop_began = 0.0
        self._gave_up: list[Member] | None = None  # giving up: the members that ended

    @property
    def status(self) -> RunStatus | None:
        return self._status

    def _enter(self, status: RunStatus) -> None:
        """Move to `status`, along TRANSITIONS only."""
        if status not in TRANSITIONS[self._status]:
            raise IllegalTransition(f"the fleet machine cannot go from {self._status} to {status}")
        self._status, self.since = status, self.clock.time()

    @property
    def members(self) -> list[Member]:
        return [*self.replicas, *([self.router] if self.router else [])]

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    # -- what happens ----------------------------------------------------------------

    def launch(self, supervisor_pid: int, supervisor_started: float) -> list[Action]:
        self._enter(RunStatus.STARTING)
        router = self.router
        return [
            update(
                profile=self.name,
                role="fleet",
                status=RunStatus.STARTING,
                since=self.since,
                supervisor_pid=supervisor_pid,
                supervisor_started=supervisor_started,
                members=[m.name for m in self.members],
                url=router.url if router else None,
                host=urlsplit(router.url).hostname if router else "-",  # where `ps` says it serves
                port=urlsplit(router.url).port if router else None,
                restarts=0,
            )
        ]

    def start(self) -> list[Action]:
        """The replicas served here; a router alone (--router-only: the replicas are elsewhere)."""
        if not self.replicas and self.router:
            return [Spawn(self.router.name)]
        return [Spawn(m.name) for m in self.replicas]

    def spawned(self, name: str, pid: int) -> list[Action]:
        m = self.member(name)
        m.pid = pid
        actions: list[Action] = [event(EventKind.MEMBER_STARTED, member=name, pid=pid)]
        if m.role == "router":
            actions.append(Say(f"starting the router at {m.url}"))
        return actions

    def seen(self, name: str, state: dict | None) -> None:
        """The member's state.json as read now (None: none yet, or being replaced)."""
        m = self.member(name)
        m.state = state or m.state

    def exited(self, name: str, exit_code: int, how: str) -> list[Action]:
        """The member's supervisor ended (exit_code as a shell says it: 128 + a signal)."""
        m = self.member(name)
        m.exit_code = exit_code
        return [
            Say(f"{name}'s supervisor ended ({how}): {_meaning(exit_code)}"),
            event(EventKind.MEMBER_EXITED, member=name, exit_code=exit_code),
        ]

    def signalled(self, name: str) -> list[Action]:
        return [
            Say(f"{name}: stopping the fleet (the router first, then the replicas)"),
            event(EventKind.STOPPING, signal=name),
            *self._stop(),
        ]

    def tick(self) -> list[Action]:
        """Time passed (the members' states are read): start the router once a replica is
        ready; keep its worker list true; then the fleet's status, or giving up."""
        router = self.router
        if router is None:
            return self._settle()
        actions: list[Action] = []
        if router.pid is None and any(m.ready for m in self.replicas):
            actions.append(Spawn(router.name))
        elif not router.alive:
            return self._settle()
        if router.state.get("status") != RunStatus.READY:  # alive (or about to be): ready is its state's word
            return actions + self._settle()
        if router.state.get("server_pid") != self.router_server:  # a new router: an empty worker list
            self.router_server = router.state.get("server_pid")
            self.remote_routed.clear()
            self.serving = False
            for m in self.replicas:
                m.routed_at = None
            actions.append(Connect(router.state["host"], router.state["port"]))
        now = self.clock.monotonic()
        if now - self.reconciled >= RECONCILE_S:  # read the worker list back now and then
            self.reconciled, self._reconciling = now, True
            return [*actions, AskReady()]
        return actions + self._route_next()

    # -- the router's worker API answers ---------------------------------------------

    def served(self, serving: bool) -> list[Action]:
        """The router's /readiness."""
        self.serving = serving
        if self._reconciling:
            self._reconciling = False
            return [ListWorkers()]
        return self._settle()

    def listed(self, urls: list[str]) -> list[Action]:
        """The router's worker list: a worker whose registration job failed (it went away
        while the router probed it) is added again."""
        now, listed = self.clock.monotonic(), {u.rstrip("/") for u in urls}
        for m in self.replicas:
            if m.routed_at is not None and now - m.routed_at > REGISTER_GRACE_S and m.url not in listed:
                m.routed_at = None
        for url, added in list(self.remote_routed.items()):
            if now - added > REGISTER_GRACE_S and url not in listed:
                del self.remote_routed[url]
        return self._route_next()

    def worker_added(self, url: str, member: str | None) -> list[Action]:
        now = self.clock.monotonic()
        actions: list[Action] = []
        if member is None:
            self.remote_routed[url] = now
            if url not in self.announced:  # added again while the router cannot register it: said once
                self.announced.add(url)
                actions = [
                    event(EventKind.ROUTED, member=url, url=url),
                    Say(f"routing to {url} (served elsewhere; the router's health checks watch it)"),
                ]
        else:
            m = self.member(member)
            m.routed_at = now
            actions = [
                event(EventKind.ROUTED, member=m.name, url=m.url),
                Say(f"{m.name} is ready: routing to it ({m.url})"),
            ]
        return actions + self._route_next()

    def worker_removed(self, member: str) -> list[Action]:
        m = self.member(member)
        m.routed_at = None
        status = m.state.get("status") if m.alive else "ended"
        return [
            event(EventKind.UNROUTED, member=m.name, url=m.url, status=str(status)),
            Say(f"{m.name} is not ready ({status}): taken out of the router"),
            *self._route_next(),
        ]

    def router_failed(self, detail: str) -> list[Action]:
        """A call of the worker API failed: tried again on the next tick (the router's own
        probes decide its fate)."""
        self._reconciling = False
        return [Say(f"the router's worker API: {detail}"), *self._settle()]

    # -- the end ---------------------------------------------------------------------

    def stopped(self, ports_in_use: list[str]) -> list[Action]:
        """The members' stop is over: clean only when no member is left, none stopped
        unclean, and no port of the fleet is bound."""
        took = self.clock.monotonic() - self._stop_began
        left = [m.name for m in self.members if m.alive]
        unclean = [m.name for m in self.members if m.exit_code == ExitCode.UNCLEAN]
        clean = not (ports_in_use or left or unclean)
        self._enter(RunStatus.GAVE_UP if self._gave_up is not None else RunStatus.STOPPED)
        self.ready_replicas = 0
        actions: list[Action] = [
            event(
                EventKind.STOPPED,
                clean=clean,
                members={m.name: m.exit_code for m in self.members if m.pid is not None},
                ports_in_use=ports_in_use,
                members_left=left,
                seconds=round(took, 3),
            ),
            update(status=self.status, since=self.since, clean=clean, ready_replicas=0),
        ]
        if clean:
            actions.append(Say(f"fleet stopped in {took:.1f} s: every member stopped clean, every port free"))
            code = ExitCode.OK
        else:
            problems = [f"ports still bound: {', '.join(ports_in_use)}"] if ports_in_use else []
            problems += [f"members that did not stop: {', '.join(left)}"] if left else []
            problems += (
                [f"members whose stop was not clean: {', '.join(unclean)} (see their own lines)"] if unclean else []
            )
            actions.append(Say("fleet stopped UNCLEAN: " + "; ".join(problems)))
            code = ExitCode.UNCLEAN
        if self._gave_up is not None:
            # FINDINGS once stopped clean; ERROR where each member that ended did with ERROR
            # (its server lacks a module: no restart of the fleet mends that either)
            if code is ExitCode.OK and all(m.exit_code == ExitCode.ERROR for m in self._gave_up):
                code = ExitCode.ERROR
            elif code is ExitCode.OK:
                code = ExitCode.FINDINGS
        return [*actions, Exit(code)]

    # -- the parts -------------------------------------------------------------------

    def _route_next(self) -> list[Action]:
        """The next call that makes the router's worker list true (workers served
        elsewhere, then the replicas in order); once none is left, the round's last
        /readiness (while it has none to send to), then the fleet's status."""
        for url in self.remote:
            if url not in self.remote_routed:
                return [AddWorker(url, None)]
        for m in self.replicas:
            if m.ready and m.routed_at is None:
                return [AddWorker(m.url, m.name)]
            if m.routed_at is not None and not m.ready:
                return [RemoveWorker(m.url, m.name)]
        if not self.serving:
            return [AskReady()]  # answered by served(): then _settle()
        return self._settle()

    def _settle(self) -> list[Action]:
        """The fleet's status from its members': ready when a replica here generates and,
        with a router, the router has a worker to send to (its /readiness: registration is
        a job of its own, and --router-only's workers are elsewhere); or giving up."""
        gone = [m for m in self.replicas if m.exit_code is not None]
        if self.replicas and len(gone) == len(self.replicas):
            return self._give_up("every replica's supervisor has ended (crash-loop limit)", gone)
        if self.router is not None and self.router.exit_code is not None:
            return self._give_up("the router's supervisor has ended (crash-loop limit)", [self.router])
        ready = sum(m.ready for m in self.replicas)
        routing = self.router is None or (self.router.ready and self.serving)
        status = RunStatus.READY if routing and (ready or not self.replicas) else RunStatus.STARTING
        actions: list[Action] = []
        if status is RunStatus.READY and self.status != status:
            where = self.router.url if self.router else ", ".join(m.url for m in self.replicas if m.ready)
            served = f"{ready} of {len(self.replicas)} replica(s) here generate" if self.replicas else ""
            elsewhere = f"{len(self.remote)} served elsewhere" if self.remote else ""
            actions += [
                Say(f"ready: {'; '.join(w for w in (served, elsewhere) if w)}; serving at {where}"),
                event(EventKind.READY, replicas=ready, url=where),
            ]
        restarts = sum(m.state.get("restarts", 0) for m in self.members)
        if (self.status, self.ready_replicas) != (status, ready):
            if self.status != status:
                self._enter(status)
            self.ready_replicas, self.restarts = ready, restarts
            actions.append(update(status=status, since=self.since, ready_replicas=ready, restarts=restarts))
        elif self.restarts != restarts:
            self.restarts = restarts
            actions.append(update(restarts=restarts))
        return actions

    def _give_up(self, why: str, ended: list[Member]) -> list[Action]:
        self._gave_up = ended
        return [Say(f"giving up: {why}"), event(EventKind.GAVE_UP, reason=why), *self._stop()]

    def _stop(self) -> list[Action]:
        self._stop_began = self.clock.monotonic()
        self._enter(RunStatus.STOPPING)
        return [update(status=RunStatus.STOPPING, since=self.since), StopMembers()]


_EXIT_MEANINGS: dict[int, str] = {  # a member supervisor's exit code: what it says of the replica
    ExitCode.OK: "stopped clean",
    ExitCode.FINDINGS: "gave up (crash-loop limit) or failed its smoke",
    ExitCode.ERROR: "refused to start, or its server lacks a module (a restart cannot mend that)",
    ExitCode.UNCLEAN: "stopped, but something of its server was left",
}


def _meaning(code: int) -> str:
    if code > 128:  # killed (the OOM killer, kill -9): its server died with it (PR_SET_PDEATHSIG)
        return "its supervisor was killed; the replica is out of the fleet until the fleet is restarted"
    return _EXIT_MEANINGS.get(code, f"exit code {code}")
