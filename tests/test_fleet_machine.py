"""The fleet supervisor's state machine, driven with a fake clock and a fake router: what
test_fleet.py proves against the real router and the sglang stand-ins (the router started
once a replica generates, replicas taken out and put back, giving up, the stop), without a
process, a socket or a real second going by. Each test asserts the machine's actions."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from support.clock import FAKE_EPOCH as EPOCH
from support.clock import FakeClock

from sm120kit.exit_codes import ExitCode
from sm120kit.fleet.machine import (
    RECONCILE_S,
    REGISTER_GRACE_S,
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
from sm120kit.serve.machine import Event, Exit, IllegalTransition, Say, Update
from sm120kit.serve.status import EventKind, RunStatus

ROUTER_URL = "http://127.0.0.1:30000"


class RouterError(Exception):
    pass


class FakeRouter:
    """The router's worker API as the machine's actions reach it."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.serving = True
        self.down = False  # every call fails
        self.calls: list[str] = []

    def call(self, what: str) -> None:
        self.calls.append(what)
        if self.down:
            raise RouterError("connection refused")


class Fleet:
    """A machine with the effects of sm120kit.fleet.supervisor faked: every action carried
    out as it carries them out, in order; `taken` holds them all, flat."""

    def __init__(self, replicas: int = 2, router: bool = True, remote: tuple[str, ...] = ()) -> None:
        self.clock, self.router = FakeClock(start=100.0), FakeRouter()
        members = [
            Member(f"replica-{i}", "replica", Path(f"r{i}"), f"http://127.0.0.1:{31000 + i}", [])
            for i in range(replicas)
        ]
        routed = (
            Member("router", "router", Path("router"), ROUTER_URL, [("router", "127.0.0.1", 30000)]) if router else None
        )
        self.machine = Machine("fleet", members, routed, list(remote), self.clock)
        self.pids = itertools.count(1000)
        self.taken: list = []
        self.exit: ExitCode | None = None

    def apply(self, actions: list) -> list:
        """The actions, and those their outcomes lead to, as they were taken."""
        start = len(self.taken)
        self._apply(actions)
        return self.taken[start:]

    def _apply(self, actions: list) -> bool:
        for action in actions:
            self.taken.append(action)
            if isinstance(action, Exit):
                self.exit = action.code
                return True
            if self._apply(self._outcome(action)):
                return True
        return False

    def _outcome(self, action) -> list:
        m, r = self.machine, self.router
        try:
            match action:
                case Spawn(name):
                    return m.spawned(name, next(self.pids))
                case AskReady():
                    r.call("ready")
                    return m.served(r.serving)
                case ListWorkers():
                    r.call("workers")
                    return m.listed(list(r.workers))
                case AddWorker(url, member):
                    r.call(f"add {url}")
                    r.workers.append(url)
                    return m.worker_added(url, member)
                case RemoveWorker(url, member):
                    r.call(f"remove {url}")
                    r.workers.remove(url)
                    return m.worker_removed(member)
        except RouterError as exc:
            return m.router_failed(str(exc))
        return []

    def tick(self, seconds: float = 0.25) -> list:
        self.clock.sleep(seconds)
        return self.apply(self.machine.tick())

    def state(self, name: str, status: RunStatus | None = None, **fields) -> None:
        self.machine.seen(name, {**({"status": status.value} if status else {}), **fields})

    def router_ready(self, server_pid: int = 7) -> None:
        self.state("router", RunStatus.READY, server_pid=server_pid, host="127.0.0.1", port=30000)

    def started(self) -> None:
        """Launched and started: a replica generates, the router is up and routes to it."""
        self.apply(self.machine.launch(1, EPOCH))
        self.apply(self.machine.start())
        for member in self.machine.replicas:
            self.state(member.name, RunStatus.READY)
        self.tick()
        self.router_ready()
        self.tick(RECONCILE_S)


def of(kind, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def said(actions: list) -> str:
    return "\n".join(a.text for a in of(Say, actions))


def events(actions: list) -> list[EventKind]:
    return [a.kind for a in of(Event, actions)]


def test_startup_starts_the_replicas_then_the_router_once_one_generates_then_routes_to_it():
    f = Fleet()
    launch = f.apply(f.machine.launch(1, EPOCH))
    assert launch == [
        Update(
            {
                "profile": "fleet",
                "role": "fleet",
                "status": RunStatus.STARTING,
                "since": EPOCH + 100,
                "supervisor_pid": 1,
                "supervisor_started": EPOCH,
                "members": ["replica-0", "replica-1", "router"],
                "url": ROUTER_URL,
                "host": "127.0.0.1",
                "port": 30000,
                "restarts": 0,
            }
        )
    ]
    start = f.apply(f.machine.start())
    assert of(Spawn, start) == [Spawn("replica-0"), Spawn("replica-1")]
    assert events(start) == [EventKind.MEMBER_STARTED] * 2

    assert of(Spawn, f.tick()) == []  # nothing generates yet: no router
    f.state("replica-0", RunStatus.STARTING)
    f.state("replica-1", RunStatus.READY)
    spawned = f.tick()
    assert of(Spawn, spawned) == [Spawn("router")]
    assert f"starting the router at {ROUTER_URL}" in said(spawned)
    assert of(Update, spawned)[-1].fields["ready_replicas"] == 1
    assert f.machine.status is RunStatus.STARTING  # the router does not route yet

    f.router_ready()
    routed = f.tick(RECONCILE_S)
    assert [a for a in routed if not isinstance(a, (Say, Event, Update))] == [
        Connect("127.0.0.1", 30000),
        AskReady(),
        ListWorkers(),
        AddWorker("http://127.0.0.1:31001", "replica-1"),
    ]
    assert events(routed) == [EventKind.ROUTED, EventKind.READY]
    assert "ready: 1 of 2 replica(s) here generate; serving at " + ROUTER_URL in said(routed)
    assert of(Update, routed)[-1].fields == {
        "status": RunStatus.READY,
        "since": EPOCH + f.clock.now,
        "ready_replicas": 1,
        "restarts": 0,
    }
    assert f.tick() == []  # nothing changed: nothing to do, nothing said

    f.state("replica-0", RunStatus.READY)
    second = f.tick()
    assert of(AddWorker, second) == [AddWorker("http://127.0.0.1:31000", "replica-0")]
    assert events(second) == [EventKind.ROUTED]  # ready already: said once
    assert of(Update, second)[-1].fields["ready_replicas"] == 2


def test_a_router_that_is_not_serving_yet_is_asked_again_and_the_fleet_is_not_ready():
    f = Fleet(replicas=1)
    f.router.serving = False
    f.started()
    assert f.router.calls == ["ready", "workers", "add http://127.0.0.1:31000", "ready"]
    assert f.machine.status is RunStatus.STARTING
    f.router.serving = True
    assert EventKind.READY in events(f.tick())  # asked again on the next tick
    assert f.machine.status is RunStatus.READY


def test_a_replica_that_stops_being_ready_is_taken_out_and_put_back():
    f = Fleet()
    f.started()
    f.state("replica-0", RunStatus.UNHEALTHY, restarts=0)
    out = f.tick()
    assert of(RemoveWorker, out) == [RemoveWorker("http://127.0.0.1:31000", "replica-0")]
    assert of(Event, out)[0].fields == {"member": "replica-0", "url": "http://127.0.0.1:31000", "status": "unhealthy"}
    assert "replica-0 is not ready (unhealthy): taken out of the router" in said(out)
    assert f.machine.status is RunStatus.READY  # the other one serves on

    f.state("replica-0", RunStatus.READY, restarts=1)
    back = f.tick()
    assert of(AddWorker, back) == [AddWorker("http://127.0.0.1:31000", "replica-0")]
    assert of(Update, back)[-1].fields["restarts"] == 1


def test_a_member_that_dies_is_said_taken_out_and_the_rest_serve_on():
    f = Fleet()
    f.started()
    ended = f.apply(f.machine.exited("replica-1", 137, "killed by SIGKILL"))
    assert "replica-1's supervisor ended (killed by SIGKILL): its supervisor was killed" in said(ended)
    assert of(Event, ended) == [Event(EventKind.MEMBER_EXITED, {"member": "replica-1", "exit_code": 137})]
    out = f.tick()
    assert of(RemoveWorker, out) == [RemoveWorker("http://127.0.0.1:31001", "replica-1")]
    assert of(Event, out)[0].fields["status"] == "ended"
    assert of(Update, out)[-1].fields["ready_replicas"] == 1
    assert f.exit is None


@pytest.mark.parametrize(
    ("codes", "exit_code"),
    [((ExitCode.FINDINGS, ExitCode.FINDINGS), ExitCode.FINDINGS), ((ExitCode.ERROR, ExitCode.ERROR), ExitCode.ERROR)],
)
def test_when_every_replica_has_exhausted_its_restarts_the_fleet_gives_up(codes, exit_code):
    f = Fleet()
    f.started()
    for member, code in zip(("replica-0", "replica-1"), codes, strict=True):
        f.state(member, RunStatus.GAVE_UP)
        f.apply(f.machine.exited(member, code, f"exit code {code.value}"))
    out = f.tick()
    assert "giving up: every replica's supervisor has ended (crash-loop limit)" in said(out)
    assert events(out) == [EventKind.UNROUTED, EventKind.UNROUTED, EventKind.GAVE_UP]  # taken out first
    assert out[-2:] == [Update({"status": RunStatus.STOPPING, "since": EPOCH + f.clock.now}), StopMembers()]

    f.apply(f.machine.exited("router", 0, "exit code 0"))  # the stop, as the supervisor carries it out
    f.clock.sleep(1.5)
    end = f.apply(f.machine.stopped([]))
    stopped = of(Event, end)[0]
    assert stopped.kind is EventKind.STOPPED and stopped.fields["clean"] is True
    assert stopped.fields["members"] == {"replica-0": codes[0], "replica-1": codes[1], "router": 0}
    assert stopped.fields["seconds"] == 1.5
    assert of(Update, end)[0].fields["status"] is RunStatus.GAVE_UP
    assert "fleet stopped in 1.5 s: every member stopped clean, every port free" in said(end)
    assert f.exit is exit_code


def test_a_router_that_dies_is_given_up_on_and_a_restarted_one_gets_every_ready_replica_again():
    f = Fleet()
    f.started()
    f.router_ready(server_pid=8)  # the router's server restarted: its worker list is empty
    again = f.tick(RECONCILE_S)
    assert of(Connect, again) == [Connect("127.0.0.1", 30000)]
    assert of(AddWorker, again) == [
        AddWorker("http://127.0.0.1:31000", "replica-0"),
        AddWorker("http://127.0.0.1:31001", "replica-1"),
    ]

    f.apply(f.machine.exited("router", ExitCode.FINDINGS, "exit code 1"))
    out = f.tick()
    assert "giving up: the router's supervisor has ended (crash-loop limit)" in said(out)
    assert out[-1] == StopMembers()
    for replica in ("replica-0", "replica-1"):  # the stop, as the supervisor carries it out
        f.apply(f.machine.exited(replica, ExitCode.OK, "exit code 0"))
    f.apply(f.machine.stopped([]))
    assert f.exit is ExitCode.FINDINGS


def test_a_worker_the_router_lost_is_added_again_after_the_grace_and_a_failed_call_is_retried():
    f = Fleet(replicas=1, remote=("http://10.0.0.2:30000",))
    f.started()
    first = f.taken
    assert events(first).count(EventKind.ROUTED) == 2
    assert "routing to http://10.0.0.2:30000 (served elsewhere" in said(first)

    f.router.workers.clear()  # its registration jobs failed
    assert of(AddWorker, f.tick(RECONCILE_S)) == []  # within the grace: the job may still be running
    readded = f.tick(REGISTER_GRACE_S)
    assert of(AddWorker, readded) == [
        AddWorker("http://10.0.0.2:30000", None),
        AddWorker("http://127.0.0.1:31000", "replica-0"),
    ]
    assert events(readded) == [EventKind.ROUTED]  # the one served elsewhere is said once

    f.router.down = True
    f.state("replica-0", RunStatus.UNHEALTHY)
    failed = f.tick(RECONCILE_S)
    assert "the router's worker API: connection refused" in said(failed)
    assert of(Update, failed)[-1].fields["ready_replicas"] == 0  # the status is settled all the same
    f.router.down = False
    assert of(RemoveWorker, f.tick()) == [RemoveWorker("http://127.0.0.1:31000", "replica-0")]


def test_a_stop_signal_stops_the_fleet_and_says_what_was_left():
    f = Fleet()
    f.started()
    f.clock.sleep(5)
    out = f.apply(f.machine.signalled("SIGINT"))
    assert said(out) == "SIGINT: stopping the fleet (the router first, then the replicas)"
    assert out[1:] == [
        Event(EventKind.STOPPING, {"signal": "SIGINT"}),
        Update({"status": RunStatus.STOPPING, "since": EPOCH + f.clock.now}),
        StopMembers(),
    ]
    f.apply(f.machine.exited("router", ExitCode.OK, "exit code 0"))
    f.apply(f.machine.exited("replica-0", ExitCode.UNCLEAN, "exit code 4"))  # replica-1 is stuck
    end = f.apply(f.machine.stopped(["30000 (router: router)"]))
    assert of(Event, end)[0].fields["members_left"] == ["replica-1"]
    assert of(Update, end)[0].fields == {
        "status": RunStatus.STOPPED,
        "since": EPOCH + f.clock.now,
        "clean": False,
        "ready_replicas": 0,
    }
    assert said(end) == (
        "fleet stopped UNCLEAN: ports still bound: 30000 (router: router); members that did not stop: replica-1; "
        "members whose stop was not clean: replica-0 (see their own lines)"
    )
    assert f.exit is ExitCode.UNCLEAN


def test_a_fleet_without_a_router_is_ready_when_a_replica_generates_and_a_clean_stop_is_exit_0():
    f = Fleet(router=False)
    f.apply(f.machine.launch(1, EPOCH))
    f.apply(f.machine.start())
    f.state("replica-0", RunStatus.READY)
    out = f.tick()
    assert "ready: 1 of 2 replica(s) here generate; serving at http://127.0.0.1:31000" in said(out)
    f.apply(f.machine.signalled("SIGTERM"))
    for replica in ("replica-0", "replica-1"):
        f.apply(f.machine.exited(replica, ExitCode.OK, "exit code 0"))
    f.apply(f.machine.stopped([]))
    assert f.exit is ExitCode.OK


def test_a_move_off_the_diagram_is_a_bug_and_moves_nothing():
    """Before, the fleet machine took whatever it was told: a stop signal after the stop went
    from stopped to stopping, and the record said so. Now a move off TRANSITIONS raises (the
    fleet supervisor records it and stops its members) and the status stays where it was."""
    f = Fleet()
    with pytest.raises(IllegalTransition, match="from None to stopping"):
        f.machine.signalled("SIGTERM")  # before the launch
    f.started()
    f.apply(f.machine.signalled("SIGTERM"))
    f.apply(f.machine.stopped([]))
    assert f.machine.status is RunStatus.STOPPED
    for late in (lambda: f.machine.signalled("SIGINT"), lambda: f.machine.stopped([])):
        with pytest.raises(IllegalTransition, match="from stopped to "):
            late()
        assert f.machine.status is RunStatus.STOPPED
    with pytest.raises(AttributeError):
        f.machine.status = RunStatus.READY  # moved by the machine alone
