"""The supervisor's decisions, apart from its effects (sm120kit.serve.supervisor carries
them out): what each thing that happens means for the run, what to record and say, and
what to do next.

Each thing that happens is a method call: time passed (tick), the server started, wrote a
progress line, answered a probe, died, or a stop signal came; each returns the actions to
take, in order. The machine reads its clock and nothing else of the world (its failure
signatures aside): no process, socket, log or NVML. So tests drive it, and the supervisor
through it, with a fake clock and a fake host.

    launching --tick--> (spawn) --started--> starting --probe 200--> ready
    ready --probe failed--> unhealthy --probe 200--> ready
    unhealthy --failures_before_restart in a row: hung--+
    starting --startup_timeout_s: start_timeout---------+--> (kill, diagnose) --> backoff
    starting, ready, unhealthy --exited: died-----------+         or gave-up (max_restarts;
                                                                  at once, exit 2, where a start
                                                                  died of a missing module)
    backoff --tick, when the delay is over--> (spawn) --started--> starting
    starting, ready, unhealthy --signalled--> stopping --stopped--> stopped
    launching, backoff --signalled--> stopped
    starting --probe 200, health.smoke--> (smoke) --passed--> ready
                                                  --failed--> stopping --stopped--> gave-up
                                                  --no answer--> (kill) as a hung server

TRANSITIONS is that diagram as data: the machine moves only along it, and a move off it
raises IllegalTransition (a bug of the machine or of what drives it, never a user's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sm120kit.exit_codes import ExitCode
from sm120kit.serve.clock import Clock, duration
from sm120kit.serve.diagnose import diagnose
from sm120kit.serve.probe import HEALTH_PATH, ProbeResult
from sm120kit.serve.status import EventKind, RunStatus
from sm120kit.textcheck import printable, without_escapes

if TYPE_CHECKING:
    from sm120kit.profiles.model import Health
    from sm120kit.serve.diagnose import Diagnosis
    from sm120kit.serve.procs import StopReport

PROGRESS_EVERY_S = 30.0  # a "still starting" line at least this often
PHASE_QUIET_S = 5.0  # shard-by-shard progress: a line every few seconds is enough
DEAD_STOP_TIMEOUT_S = 2.0  # what a dead launcher left gets SIGKILL this soon: nothing drains
LOG_TAIL_LINES = 15  # of the log's end, in the event of a failed run

# Where each status may go next (the diagram above). A failed run ends in backoff or gave-up
# from wherever it was; a probe failing again keeps it unhealthy; a failed smoke's stop ends
# as gave-up. The statuses only `ps` says (supervisor gone, damaged, unreadable) are never
# the machine's.
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.LAUNCHING: frozenset({RunStatus.STARTING, RunStatus.STOPPED}),
    RunStatus.STARTING: frozenset({RunStatus.READY, RunStatus.BACKOFF, RunStatus.GAVE_UP, RunStatus.STOPPING}),
    RunStatus.READY: frozenset({RunStatus.UNHEALTHY, RunStatus.BACKOFF, RunStatus.GAVE_UP, RunStatus.STOPPING}),
    RunStatus.UNHEALTHY: frozenset(
        {RunStatus.READY, RunStatus.UNHEALTHY, RunStatus.BACKOFF, RunStatus.GAVE_UP, RunStatus.STOPPING}
    ),
    RunStatus.BACKOFF: frozenset({RunStatus.STARTING, RunStatus.STOPPED}),
    RunStatus.STOPPING: frozenset({RunStatus.STOPPED}),
    RunStatus.STOPPED: frozenset({RunStatus.GAVE_UP}),
    RunStatus.GAVE_UP: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The machine was told something its status cannot follow (started() while ready, a
    stop signal after it stopped): a bug, said as an internal error, never a user's mistake."""


@dataclass(frozen=True)
class Policy:
    startup_timeout_s: float
    probe_interval_s: float
    probe_timeout_s: float
    failures_before_restart: int
    max_restarts: int
    backoff_initial_s: float
    backoff_max_s: float
    stop_timeout_s: float
    stable_after_s: float
    startup_probe_interval_s: float = 1.0
    smoke: bool = False  # health.smoke: the smoke decides "ready"

    @classmethod
    def from_health(cls, health: Health) -> Policy:
        return cls(**{f: getattr(health, f) for f in cls.__dataclass_fields__ if hasattr(health, f)})

    def backoff(self, failures: int) -> float:
        return min(self.backoff_initial_s * 2 ** (failures - 1), self.backoff_max_s)


@dataclass
class ServerSpec:
    """What to run and how to reach it."""

    name: str
    argv: list[str] = field(repr=False)  # with the API key in place: never logged (nor in a repr)
    shown_argv: list[str]  # with the key as "$NAME"
    env: dict[str, str] = field(repr=False)
    host: str  # where to probe
    port: int
    ports: list[tuple[str, str, int]]  # the port plan, proven free after a stop
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None  # its name: what is written wherever the key would be
    check_gpus: bool = True
    gpus: tuple[int, ...] | None = None  # the GPUs it may use (a fleet's replica); None: all of them
    probe_path: str = HEALTH_PATH  # a router answers its own liveness path, not a generation


# -- actions: what the supervisor is to do, in order ------------------------------------


@dataclass(frozen=True)
class Say:
    text: str


@dataclass(frozen=True)
class Event:
    """A line of events.jsonl."""

    kind: EventKind
    fields: dict


@dataclass(frozen=True)
class Update:
    """Fields of state.json."""

    fields: dict


@dataclass(frozen=True)
class Spawn:
    """Start the server, then tell started()."""


@dataclass(frozen=True)
class Probe:
    attempt: int


@dataclass(frozen=True)
class Kill:
    """End the failed start (no drain) within timeout, then tell after_end() its log's tail."""

    timeout: float


@dataclass(frozen=True)
class Stop:
    """Stop the server for good (it drains), then tell stopped() what is left."""


@dataclass(frozen=True)
class Smoke:
    """Run the smoke against the server of that start, then tell smoke_done() its result."""

    attempt: int


@dataclass(frozen=True)
class Exit:
    code: ExitCode


Action = Say | Event | Update | Spawn | Probe | Smoke | Kill | Stop | Exit


def event(kind: EventKind, **fields: Any) -> Event:
    return Event(kind, fields)


def update(**fields: Any) -> Update:
    return Update(fields)


# -- the state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class End:
    """Why a start is being ended."""

    kind: EventKind  # DIED, HUNG or START_TIMEOUT
    detail: str
    exit_code: int | None
    at: float  # when the supervisor saw it (the wall clock)


@dataclass
class Attempt:
    """One start of the server, from its spawn until it is ended."""

    number: int
    started: float
    next_probe: float
    next_note: float  # the next "still starting" line
    ready_at: float | None = None
    phase: str = "launching"
    phase_said_at: float = 0.0
    failures_in_row: int = 0
    smoking: bool = False  # it generates; the smoke runs: not ready yet
    end: End | None = None


class Machine:
    def __init__(
        self, spec: ServerSpec, policy: Policy, clock: Clock, log: str, events: str, patch_dirs: tuple[str, ...] = ()
    ) -> None:
        self.spec, self.policy, self.clock = spec, policy, clock
        self.log, self.events = log, events  # the record's paths, for what is said
        self.patch_dirs = patch_dirs  # --patch-dir: their known failures diagnose a death too
        self._status = RunStatus.LAUNCHING  # as state.json says; moved by _enter() alone
        self.attempt: Attempt | None = None  # the current start
        self.attempts = 0  # starts so far
        self.failures = 0  # consecutive failed runs: the crash-loop count
        self.restarts = 0
        self.deaths: list[str] = []
        self.probing = False  # a probe is out (of this start or of the one before)
        self.restart_at = 0.0  # in backoff: when the next start is due
        self.smoke_failed: str | None = None  # the smoke's summary, once one failed: the run ends

    @property
    def status(self) -> RunStatus:
        return self._status

    def _enter(self, status: RunStatus) -> None:
        """Move to `status`, along TRANSITIONS only."""
        if status not in TRANSITIONS[self._status]:
            raise IllegalTransition(f"the serve machine cannot go from {self._status} to {status}")
        self._status = status

    @property
    def starting(self) -> bool:
        return self.attempt is not None and self.attempt.ready_at is None

    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}{self.spec.probe_path}"

    def wake_at(self) -> float:
        """When tick() has something to do (a probe's answer or a signal comes earlier)."""
        if self.attempt is None:
            return self.restart_at
        if self.probing or self.attempt.smoking:
            return self.clock.monotonic() + self.policy.probe_interval_s
        return self.attempt.next_probe

    # -- what happens ----------------------------------------------------------------

    def launch(self, supervisor_pid: int, supervisor_started: float, subreaper: bool) -> list[Action]:
        return [
            update(
                profile=self.spec.name,
                supervisor_pid=supervisor_pid,
                supervisor_started=supervisor_started,
                status=RunStatus.LAUNCHING,
                since=self.clock.time(),
                host=self.spec.host,
                port=self.spec.port,
                log=self.log,
                events=self.events,
                restarts=0,
                last_health=None,
                subreaper=subreaper,
            )
        ]

    def tick(self) -> list[Action]:
        """Time passed: a start that is due, the startup deadline, a probe that is due."""
        now, p = self.clock.monotonic(), self.policy
        if self.status in (RunStatus.LAUNCHING, RunStatus.BACKOFF):
            return [Spawn()] if now >= self.restart_at else []
        run = self.attempt
        if run is None or run.end or run.smoking:  # the smoke's own request timeouts bound it
            return []
        actions: list[Action] = []
        if run.ready_at is None:
            if now - run.started > p.startup_timeout_s:
                detail = f"not generating after {duration(p.startup_timeout_s)} (last: {run.phase})"
                return self._end(run, EventKind.START_TIMEOUT, detail)
            if now >= run.next_note:
                run.next_note = now + PROGRESS_EVERY_S
                spent = f"{duration(now - run.started)} of {duration(p.startup_timeout_s)}"
                actions.append(Say(f"still starting: {run.phase} ({spent})"))
        if not self.probing and now >= run.next_probe:
            starting_interval = min(p.startup_probe_interval_s, p.probe_interval_s)
            run.next_probe = now + (p.probe_interval_s if run.ready_at is not None else starting_interval)
            self.probing = True
            actions.append(Probe(run.number))
        return actions

    def started(self, pid: int, marker: str) -> list[Action]:
        self._enter(RunStatus.STARTING)
        now = self.clock.monotonic()
        self.attempts += 1
        n = self.attempts
        self.attempt = Attempt(n, now, next_probe=now, next_note=now + PROGRESS_EVERY_S)
        return [
            event(EventKind.STARTED, attempt=n, pid=pid, argv=self.spec.shown_argv, log=self.log),
            update(
                status=RunStatus.STARTING,
                since=self.clock.time(),
                server_pid=pid,
                marker=marker,
                attempt=n,
                restarts=self.restarts,
            ),
            Say(
                f"started {self.spec.name}: pid {pid} (attempt {n}); ready when it {self._answers()}, "
                f"within {duration(self.policy.startup_timeout_s)}; log {self.log}"
            ),
        ]

    def progress(self, phase: str) -> list[Action]:
        """A milestone in the log of a starting server."""
        run, now = self.attempt, self.clock.monotonic()
        if run is None or run.ready_at is not None:  # not starting
            return []
        same_kind = phase.split()[:2] == run.phase.split()[:2]
        run.phase = phase
        if same_kind and now - run.phase_said_at < PHASE_QUIET_S and "100%" not in phase:
            return []
        run.phase_said_at = now
        return [
            event(EventKind.PROGRESS, phase=phase, elapsed_s=round(now - run.started, 1)),
            update(phase=phase),
            Say(f"starting: {phase} ({duration(now - run.started)})"),
        ]

    def probe_done(self, attempt: int, result: ProbeResult) -> list[Action]:
        """Starting: the first 200 makes it ready (503 and refusals just mean "not yet").
        Ready: count failures in a row; enough of them make it hung."""
        self.probing = False
        run, p = self.attempt, self.policy
        if run is None or run.number != attempt or run.end:
            return []  # the answer for a start that is over
        if run.ready_at is None:
            if not result.ok:
                return []
            return self._smoke(run) if self.policy.smoke else self._ready(run, result)
        actions: list[Action] = [update(last_health=self._health(result))]
        if result.ok:
            if run.failures_in_row:
                self._enter(RunStatus.READY)
                actions += [
                    update(status=RunStatus.READY),
                    Say(f"probe ok again after {run.failures_in_row} failure(s)"),
                ]
            run.failures_in_row = 0
            return actions
        run.failures_in_row += 1
        self._enter(RunStatus.UNHEALTHY)
        actions += [
            event(
                EventKind.PROBE_FAILED,
                detail=result.detail,
                consecutive=run.failures_in_row,
                limit=p.failures_before_restart,
            ),
            update(status=RunStatus.UNHEALTHY),
            Say(f"probe failed: {result.detail} ({run.failures_in_row}/{p.failures_before_restart})"),
        ]
        if run.failures_in_row >= p.failures_before_restart:
            detail = f"{self.url()} failed {run.failures_in_row} probes in a row (last: {result.detail})"
            actions += self._end(run, EventKind.HUNG, detail)
        return actions

    def _ready(self, run: Attempt, result: ProbeResult) -> list[Action]:
        run.ready_at = self.clock.monotonic()
        self._enter(RunStatus.READY)
        after = round(run.ready_at - run.started, 1)
        return [
            update(
                status=RunStatus.READY,
                since=self.clock.time(),
                ready_after_s=after,
                last_health=self._health(result),
            ),
            event(EventKind.READY, after_s=after),
            Say(
                f"ready: {self.spec.name} {self._answers()} (after {duration(after)}); "
                f"probing {self.url()} every {self.policy.probe_interval_s:g}s"
            ),
        ]

    def _smoke(self, run: Attempt) -> list[Action]:
        run.smoking, run.phase = True, "smoke"
        return [
            update(phase="smoke"),
            Say(f"{self.spec.name} generates; running the smoke (health.smoke) before calling it ready"),
            Smoke(run.number),
        ]

    def smoke_done(
        self, attempt: int, passed: bool, summary: str, failures: list[str], answered: bool = True
    ) -> list[Action]:
        """The smoke's verdict on a start: passed, it is ready; failed, the server answers
        wrong, which a restart would not mend: stop it for good and exit FINDINGS. A smoke
        the server stopped answering (`answered` false: its requests timed out or were
        refused) says it hung, not that it answers wrong: the hung path (restart, backoff,
        the crash-loop limit), as failed probes would take."""
        run = self.attempt
        if run is None or run.number != attempt or run.end or not run.smoking or self.status is not RunStatus.STARTING:
            return []  # the verdict on a start that is over, or that is being stopped
        run.smoking = False
        record = event(
            EventKind.SMOKE, attempt=attempt, passed=passed, summary=summary, failures=failures, answered=answered
        )
        if not passed and not answered:
            hung = f"it did not answer the smoke ({summary})"
            return [record, update(phase="did not answer the smoke"), *self._end(run, EventKind.HUNG, hung)]
        if passed:
            ok = ProbeResult(True, 200, "smoke passed", 0.0)
            return [record, update(phase="smoke passed"), Say(summary), *self._ready(run, ok)]
        self.smoke_failed = summary
        self._enter(RunStatus.STOPPING)
        return [
            record,
            update(status=RunStatus.STOPPING, since=self.clock.time(), smoke=summary),
            Say(
                f"{summary}\n    " + "\n    ".join(failures) + f"\nnot calling {self.spec.name} ready: stopping it "
                "(no restart: a server that answers wrong is not mended by one)"
            ),
            Stop(),
        ]

    def exited(self, how: str, exit_code: int | None) -> list[Action]:
        """The server's launcher is gone ("exit code 1", "killed by SIGKILL")."""
        if self.attempt is None or self.attempt.end:
            return []
        return self._end(self.attempt, EventKind.DIED, how, exit_code)

    def after_end(self, log_tail: str) -> list[Action]:
        """The failed start is over: diagnose it from its log, then restart or give up."""
        run, now = self.attempt, self.clock.monotonic()
        assert run is not None and run.end is not None, "after_end follows the Kill of an ended start"
        end = run.end
        found = diagnose(log_tail, patch_dirs=self.patch_dirs)
        lines = [line for line in map(without_escapes, log_tail.replace("\r", "\n").splitlines()) if line.strip()]
        last = [printable(line) for line in lines[-LOG_TAIL_LINES:]]  # quoted onto a terminal
        when = (
            f"while starting ({run.phase})"
            if run.ready_at is None
            else f"{duration(now - run.ready_at)} after it was ready"
        )
        what = {
            EventKind.DIED: f"the server died {when}: {end.detail}",
            EventKind.HUNG: f"the server hung {when}: {end.detail}",
        }.get(end.kind, f"the server did not start: {end.detail}")
        actions: list[Action] = [
            event(
                end.kind,
                detail=end.detail,
                exit_code=end.exit_code,
                noticed_at=end.at,
                ran_s=round(now - run.started, 1),
                ready=run.ready_at is not None,
                phase=run.phase,
                diagnoses=[d.as_json() for d in found],
                log_tail=last,
            ),
            Say(what),
        ]
        actions += [Say(f"diagnosis: {d.title}\n    log:    {d.line}\n    advice: {d.advice}") for d in found]
        if not found:
            actions.append(
                Say("no known SM120 failure signature in the log; its last lines:\n    " + "\n    ".join(last[-8:]))
            )
        self.deaths.append(f"attempt {run.number}: {what}" + (f" [{', '.join(d.id for d in found)}]" if found else ""))
        if run.ready_at is None and found and not any(d.restart for d in found):
            return actions + self._incomplete(found)
        return actions + self._restart_or_give_up(run)

    def _restart_or_give_up(self, run: Attempt) -> list[Action]:
        now = self.clock.monotonic()
        if run.ready_at is not None and now - run.ready_at >= self.policy.stable_after_s:
            self.failures = 0  # it ran well for long enough: not a crash loop
        self.failures += 1
        self.attempt = None
        if self.failures > self.policy.max_restarts:
            return self._give_up()
        delay = self.policy.backoff(self.failures)
        self.restarts += 1
        self._enter(RunStatus.BACKOFF)
        self.restart_at = now + delay
        return [
            event(EventKind.RESTARTING, in_s=delay, failures=self.failures, limit=self.policy.max_restarts),
            update(status=RunStatus.BACKOFF, since=self.clock.time(), server_pid=None, restarts=self.restarts),
            Say(f"restarting in {delay:g}s (restart {self.failures} of at most {self.policy.max_restarts} in a row)"),
        ]

    def signalled(self, name: str) -> list[Action]:
        """A stop signal (SIGINT, SIGTERM, SIGHUP): stop, whatever the state."""
        actions: list[Action] = [
            event(EventKind.STOPPING, signal=name),
            update(status=RunStatus.STOPPING, since=self.clock.time()),
        ]
        if self.attempt is None:
            self._enter(RunStatus.STOPPED)
            return [
                *actions,
                event(EventKind.STOPPED, clean=True, processes=0),
                update(status=RunStatus.STOPPED, since=self.clock.time(), server_pid=None),
                Say(f"stopped on {name}: no server was running"),
                Exit(ExitCode.OK),
            ]
        self._enter(RunStatus.STOPPING)
        return [
            *actions,
            Say(
                f"stopping on {name}: SIGTERM to sglang's launcher (it drains requests), then to the rest; "
                f"SIGKILL after {duration(self.policy.stop_timeout_s)} (a second Ctrl-C: now)"
            ),
            Stop(),
        ]

    def stopped(
        self, report: StopReport, ports_taken: list[str], on_gpu: list[str] | None, gpu_s: float | None
    ) -> list[Action]:
        """What the stop left: clean only when no process, port or GPU memory of the run is."""
        clean = report.clean and not ports_taken and not on_gpu
        self._enter(RunStatus.STOPPED)
        self.attempt = None
        killed = f", {len(report.killed)} needed SIGKILL" if report.killed else ""
        if not ports_taken:
            ports = "ports " + ", ".join(str(port) for _, _, port in self.spec.ports) + " free"
        else:
            ports = f"STILL BOUND: {', '.join(ports_taken)}"
        if on_gpu is None:
            gpu = ""
        elif not on_gpu:
            gpu = f"; no process of ours on the GPUs (NVML, {gpu_s:.1f}s later)"
        else:
            gpu = f"; STILL ON A GPU: {', '.join(on_gpu)}"
        actions: list[Action] = [
            event(
                EventKind.STOPPED,
                clean=clean,
                ports_taken=ports_taken,
                on_gpu=on_gpu,
                gpu_released_after_s=gpu_s,
                **report.as_json(),
            ),
            update(status=RunStatus.STOPPED, since=self.clock.time(), server_pid=None, clean=clean),
            Say(f"stopped: {report.processes} processes ended in {report.seconds:.1f}s{killed}; {ports}{gpu}"),
        ]
        if report.left:
            actions.append(Say("LEFT RUNNING: " + "; ".join(p.line() for p in report.left)))
        if self.smoke_failed and clean:  # the run ends as a failed one: gave up, exit 1
            self._enter(RunStatus.GAVE_UP)
            return [
                *actions,
                update(status=RunStatus.GAVE_UP, since=self.clock.time()),
                Say(f"gave up: the smoke failed; log: {self.log}; events: {self.events}"),
                Exit(ExitCode.FINDINGS),
            ]
        return [*actions, Exit(ExitCode.OK if clean else ExitCode.UNCLEAN)]

    # -- the parts -------------------------------------------------------------------

    def _end(self, run: Attempt, kind: EventKind, detail: str, exit_code: int | None = None) -> list[Action]:
        run.end = End(kind, detail, exit_code, self.clock.time())
        if kind is EventKind.DIED:
            return [Kill(DEAD_STOP_TIMEOUT_S)]
        return [Say(f"killing the server: {detail}"), Kill(self.policy.stop_timeout_s)]

    def _incomplete(self, found: list[Diagnosis]) -> list[Action]:
        """A start that failed for what no restart mends (a module the environment lacks):
        stop, exit ERROR, as a refused preflight does (a unit's RestartPreventExitStatus=2
        does not start it again)."""
        self.attempt = None
        self._enter(RunStatus.GAVE_UP)
        why = "; ".join(d.title for d in found)
        return [
            event(EventKind.GAVE_UP, failures=self.failures + 1, deaths=list(self.deaths), restart=False, reason=why),
            update(status=RunStatus.GAVE_UP, since=self.clock.time(), server_pid=None),
            Say(
                f"not restarting {self.spec.name}: {why}; no restart mends that. Complete the environment, then "
                f"`sm120kit serve {self.spec.name} --check` (its imports check finds this before a start)"
                f"\n    log: {self.log}; events: {self.events}"
            ),
            Exit(ExitCode.ERROR),
        ]

    def _give_up(self) -> list[Action]:
        self._enter(RunStatus.GAVE_UP)
        return [
            event(EventKind.GAVE_UP, failures=self.failures, deaths=list(self.deaths)),
            update(status=RunStatus.GAVE_UP, since=self.clock.time(), server_pid=None),
            Say(
                f"giving up: {self.failures} failed runs in a row (health.max_restarts = {self.policy.max_restarts}):"
                "\n    " + "\n    ".join(self.deaths) + f"\n    log: {self.log}; events: {self.events}"
            ),
            Exit(ExitCode.FINDINGS),
        ]

    def _answers(self) -> str:
        """What its ready means: a server generates; a router answers its liveness path."""
        return "generates" if self.spec.probe_path == HEALTH_PATH else f"answers {self.spec.probe_path}"

    def _health(self, result: ProbeResult) -> dict:
        return {"at": self.clock.time(), "ok": result.ok, "detail": result.detail, "seconds": round(result.seconds, 3)}
