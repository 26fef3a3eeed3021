"""The supervisor's state machine, driven with a fake clock, a fake host and fake probes:
every transition that tests/serve/ proves against the sglang stand-in, without a
process, a socket or a real second going by. The supervisor runs as it does in
production (sm120kit.serve.supervisor over sm120kit.serve.machine) and writes its real
record into tmp_path; only time, the machine it runs on and the server's answers are
made up (World), as each test's Script says.

A server that dies of a missing module is not restarted: serve exits 2, which a unit's
RestartPreventExitStatus=2 does not retry."""

from __future__ import annotations

import heapq
import io
import itertools
import json
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from support.clock import FAKE_EPOCH as EPOCH
from support.clock import FakeClock
from support.serve import TRACEBACK

from sm120kit.exit_codes import ExitCode
from sm120kit.node import nvml
from sm120kit.node.nvml_schema import Gpu
from sm120kit.profiles.model import Health
from sm120kit.serve import procs
from sm120kit.serve.machine import (
    TRANSITIONS,
    IllegalTransition,
    Kill,
    Machine,
    Policy,
    Probe,
    Say,
    ServerSpec,
    Spawn,
    Update,
)
from sm120kit.serve.probe import ProbeResult
from sm120kit.serve.rundir import RunRecord
from sm120kit.serve.status import TERMINAL, EventKind, RunStatus
from sm120kit.serve.supervisor import Supervisor

LAST_MOMENT = 10_000.0  # a scenario still running then never ends: the test fails


OK = ProbeResult(True, 200, "200", 0.01)


STARTING = ProbeResult(False, 503, "503 (starting or shutting down)", 0.01)


REFUSED = ProbeResult(False, None, "connection refused", 0.0)


LOADING = "[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=94.50 GB\n"


OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"


NCCL = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error\n"


ILLEGAL = "RuntimeError: CUDA error: an illegal instruction was encountered\n"


SECRET = "sk-live-0123456789abcdef"


POLICY = Policy(
    startup_timeout_s=60,
    probe_interval_s=1.0,
    probe_timeout_s=2.0,
    failures_before_restart=2,
    max_restarts=2,
    backoff_initial_s=0.2,
    backoff_max_s=0.5,
    stop_timeout_s=10,
    stable_after_s=600,
)


@dataclass(frozen=True)
class Script:
    """How one start of the fake server goes; times are seconds after its spawn."""

    log: tuple[tuple[float, str], ...] = ()  # what it writes to its log, and when
    ready_at: float | None = 1.0  # probes answer 200 from then on, 503 before
    dies_at: float | None = None
    wait_status: int = signal.SIGKILL  # how it dies (sglang SIGKILLs itself)
    hung: tuple[float, float] | None = None  # probes sent in [from, until) fail as `hung_answer` says
    hung_answer: ProbeResult = STARTING
    processes: int = 4  # a launcher, two schedulers, a detokenizer
    ignores_sigterm: bool = False
    drain_s: float = 0.0
    leaves: tuple[procs.Proc, ...] = ()  # still there after SIGKILL


@dataclass
class FakeServer:
    pid: int
    script: Script
    began: float
    alive: bool = True
    returncode: int | None = None  # set by the supervisor, as on a Popen


class World:
    """A fake clock, host and prober in one. Time moves only when the supervisor waits or
    sleeps; what is due meanwhile happens in order (and ends a wait, as a signal, SIGCHLD
    or a probe's answer ends the real one). Each start of the server follows a Script,
    the last one over and over."""

    def __init__(self, *scripts: Script) -> None:
        self.now = 0.0
        self.scripts = scripts or (Script(),)
        self.servers: list[FakeServer] = []
        self.stops: list[dict] = []  # what each stop was asked to do
        self.bound: set[int] = set()  # ports still bound after a stop
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._finished: dict[int, int] = {}
        self._answers: list[tuple[int, ProbeResult]] = []
        self._on_stop: Callable[[int], None] | None = None

    def at(self, when: float, what: Callable[[], None]) -> None:
        heapq.heappush(self._due, (when, next(self._order), what))

    def signal(self, when: float, signum: int = signal.SIGINT) -> None:
        self.at(when, lambda: self._on_stop(signum))

    def _run_until(self, until: float) -> None:
        assert until < LAST_MOMENT, "the scenario never ends"
        while self._due and self._due[0][0] <= until:
            when, _, what = heapq.heappop(self._due)
            self.now = max(self.now, when)
            what()
        self.now = max(self.now, until)

    # -- Clock ---------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return EPOCH + self.now

    def sleep(self, seconds: float) -> None:
        self._run_until(self.now + seconds)

    # -- Host ----------------------------------------------------------------------------

    def listen(self, on_stop: Callable[[int], None]) -> None:
        self._on_stop = on_stop

    def wait(self, seconds: float) -> None:
        until = self.now + seconds
        self._run_until(min(until, self._due[0][0]) if self._due else until)

    def wake(self) -> None:
        pass

    def become_subreaper(self) -> bool:
        return True

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> FakeServer:
        script = self.scripts[min(len(self.servers), len(self.scripts) - 1)]
        server = FakeServer(1000 * (len(self.servers) + 1), script, self.now)
        self.servers.append(server)
        Path(log_path).touch()
        for after, text in script.log:
            self.at(self.now + after, lambda text=text: self._write(server, log_path, text))
        if script.dies_at is not None:
            self.at(self.now + script.dies_at, lambda: self._die(server))
        return server

    def _write(self, server: FakeServer, log_path: str, text: str) -> None:
        if server.alive:
            with open(log_path, "a") as fh:
                fh.write(text)

    def _die(self, server: FakeServer) -> None:
        if server.alive:
            server.alive = False
            self._finished[server.pid] = server.script.wait_status

    def reap(self) -> dict[int, int]:
        found, self._finished = self._finished, {}
        return found

    def sample(self) -> None:
        pass

    def _server(self, pid: int) -> FakeServer:
        return next(s for s in self.servers if s.pid == pid)

    def members(self, pgid: int) -> set[int]:
        server = self._server(pgid)
        return set(range(pgid, pgid + server.script.processes)) if server.alive else set()

    def stop(self, pgid: int, timeout: float, hurry: Callable[[], bool], drain: bool) -> procs.StopReport:
        server, began = self._server(pgid), self.now
        self.stops.append({"pid": pgid, "timeout": timeout, "drain": drain})
        if not server.alive:
            return procs.StopReport()
        pids, killed = self.members(pgid), []
        if server.script.ignores_sigterm:
            deadline = self.now + timeout
            while self.now < deadline and not hurry():
                self.sleep(0.02)
            killed = sorted(pids)
        elif drain:
            self.sleep(server.script.drain_s)
        server.alive = False
        return procs.StopReport(len(pids), killed, list(server.script.leaves), self.now - began)

    def port_in_use(self, host: str, port: int) -> bool:
        return port in self.bound

    def read_gpus(self) -> list[Gpu]:
        raise nvml.NvmlUnavailable("no NVML in a fake world")

    # -- Prober --------------------------------------------------------------------------

    def start(self, attempt: int) -> None:
        server, sent = self.servers[-1], self.now - self.servers[-1].began
        hung = server.script.hung is not None and server.script.hung[0] <= sent < server.script.hung[1]
        took = server.script.hung_answer.seconds if hung else OK.seconds

        def answer() -> None:
            ready = server.script.ready_at is not None and self.now - server.began >= server.script.ready_at
            result = REFUSED if not server.alive else server.script.hung_answer if hung else OK if ready else STARTING
            self._answers.append((attempt, result))

        self.at(self.now + took, answer)

    def results(self) -> list[tuple[int, ProbeResult]]:
        found, self._answers = self._answers, []
        return found


class Recorded(RunRecord):
    """The run's record, with the status of every update kept in order."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.statuses: list[str] = []

    def update(self, **fields) -> None:
        if "status" in fields:
            self.statuses.append(fields["status"])
        super().update(**fields)

    def read(self, kind: str | None = None) -> list[dict]:
        found = [json.loads(line) for line in self.events.read_text().splitlines()]
        return [e for e in found if kind is None or e["event"] == kind]

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.read()]

    def state_json(self) -> dict:
        return json.loads(self.state_file.read_text())


SPEC = ServerSpec(
    "fake", ["sglang"], ["sglang"], {}, "127.0.0.1", 30000, [("server.port", "127.0.0.1", 30000)], check_gpus=False
)


@dataclass
class Outcome:
    code: int
    record: Recorded
    out: str


def supervise(tmp_path: Path, world: World, spec: ServerSpec = SPEC, echo: bool = False, **policy) -> Outcome:
    record = Recorded(tmp_path / "run")
    out = io.StringIO()
    supervisor = Supervisor(
        spec, replace(POLICY, **policy), record, out=out, echo=echo, clock=world, host=world, prober=world
    )
    return Outcome(supervisor.run(), record, out.getvalue())


S = RunStatus


def test_ready_only_when_it_generates_with_progress_then_a_clean_stop(tmp_path):
    loading = (
        (0.1, LOADING),
        (0.5, "Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:01<00:01,  1.00it/s]\r"),
        (1.0, "Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:02<00:00,  1.00it/s]\n"),
        (1.5, "[2026-11-29 10:00:36 TP0] Load weight end. elapsed=1.50 s\n"),
        (2.5, "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)\n"),
        (3.0, "The server is fired up and ready to roll!\n"),
    )
    world = World(Script(log=loading, ready_at=3.0))
    world.signal(10.0)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK
    assert done.record.statuses == [S.LAUNCHING, S.STARTING, S.READY, S.STOPPING, S.STOPPED]
    phases = [e["phase"] for e in done.record.read("progress")]  # 50% follows 0% too soon to be said
    assert phases == [
        "loading weights",
        "loading weights 100% (4/4 shards)",
        "weights loaded",
        "HTTP server up, warming up",
        "warmup done",
    ]
    [ready] = done.record.read("ready")
    assert ready["after_s"] >= 3.0 and done.record.read("probe_failed") == []  # 503 while starting is not a failure
    [stopped] = done.record.read("stopped")
    assert stopped["clean"] and stopped["processes"] == 4 and stopped["sigkilled"] == []
    assert stopped["ports_taken"] == [] and stopped["on_gpu"] is None
    assert world.stops == [{"pid": 1000, "timeout": 10, "drain": True}]
    assert "starting: loading weights (0s)" in done.out and "ready: fake generates (after 3s)" in done.out
    assert "stopping on SIGINT: SIGTERM to sglang's launcher" in done.out
    assert "stopped: 4 processes ended in 0.0s; ports 30000 free" in done.out
    state = done.record.state_json()
    assert state["status"] == "stopped" and state["server_pid"] is None and state["clean"] is True
    assert state["last_health"]["ok"] is True and state["last_health"]["at"] > EPOCH + 9  # every probe is recorded


def test_a_slow_start_is_waited_for_and_said(tmp_path):
    world = World(Script(log=((1.0, LOADING),), ready_at=70.0))
    world.signal(80.0)
    done = supervise(tmp_path, world, startup_timeout_s=120)
    assert done.code == ExitCode.OK and done.record.read("probe_failed") == []
    assert "still starting: loading weights (30s of 2m00s)" in done.out
    assert "still starting: loading weights (1m00s of 2m00s)" in done.out
    assert done.record.read("ready")[0]["after_s"] >= 70


def test_the_live_tail_is_echoed_with_the_key_redacted(tmp_path):
    spec = replace(SPEC, api_key=SECRET, api_key_env="K")
    key_line = f"server_args=ServerArgs(model_path='m', api_key='{SECRET}')\n"
    world = World(Script(log=((0.1, key_line), (0.2, LOADING))))
    world.signal(5.0)
    done = supervise(tmp_path, world, spec=spec, echo=True)
    assert done.code == ExitCode.OK
    assert "api_key='$K')" in done.out and SECRET not in done.out
    assert done.record.read("started")[0]["argv"] == ["sglang"]
    record = "".join(p.read_text() for p in done.record.dir.iterdir() if not p.name.startswith("server.log"))
    assert SECRET not in record


def test_death_while_loading_is_diagnosed_and_a_crash_loop_of_one_gives_up(tmp_path):
    world = World(Script(log=((0.1, LOADING), (0.4, OOM)), dies_at=0.5))
    done = supervise(tmp_path, world, max_restarts=0)
    assert done.code == ExitCode.FINDINGS
    assert done.record.statuses == [S.LAUNCHING, S.STARTING, S.GAVE_UP]
    [died] = done.record.read("died")
    assert not died["ready"] and died["exit_code"] is None and died["detail"] == "killed by SIGKILL"
    assert [d["id"] for d in died["diagnoses"]] == ["cuda-out-of-memory"] and died["log_tail"][-1] == OOM.strip()
    assert died["phase"] == "loading weights" and died["noticed_at"] == EPOCH + 0.5
    assert world.stops == [{"pid": 1000, "timeout": 2.0, "drain": False}]  # what a dead launcher left
    assert "the server died while starting (loading weights): killed by SIGKILL" in done.out
    assert "diagnosis: " in done.out and "advice:" in done.out
    assert "giving up: 1 failed runs in a row (health.max_restarts = 0)" in done.out
    assert done.record.state_json()["status"] == "gave-up"


def test_a_death_without_a_known_signature_shows_the_last_lines(tmp_path):
    world = World(Script(log=((0.1, "something odd\n"),), dies_at=0.5, wait_status=1 << 8))
    done = supervise(tmp_path, world, max_restarts=0)
    assert done.record.read("died")[0]["exit_code"] == 1 and "exit code 1" in done.out
    assert "no known SM120 failure signature in the log; its last lines:\n    something odd" in done.out


def test_backoff_doubles_until_the_crash_loop_limit(tmp_path):
    world = World(Script(log=((0.1, OOM),), dies_at=0.5))
    done = supervise(tmp_path, world, max_restarts=3)
    assert done.code == ExitCode.FINDINGS
    assert [e["in_s"] for e in done.record.read("restarting")] == [0.2, 0.4, 0.5]
    starts = [s.began for s in world.servers]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= 0.5 + delay for gap, delay in zip(gaps, [0.2, 0.4, 0.5]))  # it ran 0.5 s, then waited
    [gave_up] = done.record.read("gave_up")
    assert gave_up["failures"] == 4 and len(gave_up["deaths"]) == 4
    assert all("cuda-out-of-memory" in d for d in gave_up["deaths"])
    assert done.record.statuses == [S.LAUNCHING] + [S.STARTING, S.BACKOFF] * 3 + [S.STARTING, S.GAVE_UP]
    assert "giving up: 4 failed runs in a row (health.max_restarts = 3)" in done.out
    assert "restarting in 0.4s (restart 2 of at most 3 in a row)" in done.out
    logs = sorted(p.name for p in done.record.dir.iterdir() if p.name.startswith("server.log"))
    assert logs == ["server.log", "server.log.1", "server.log.2", "server.log.3"]


def test_a_crash_then_a_good_start(tmp_path):
    world = World(Script(log=((0.1, NCCL),), dies_at=0.5), Script())
    seen = []
    world.at(5.0, lambda: seen.append(json.loads((tmp_path / "run" / "state.json").read_text())))
    world.signal(6.0, signal.SIGTERM)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK
    assert done.record.kinds()[:4] == ["started", "died", "restarting", "started"]
    assert done.record.read("died")[0]["diagnoses"][0]["id"] == "nccl"
    [state] = seen
    assert state["status"] == "ready" and state["restarts"] == 1 and state["attempt"] == 2
    assert state["last_health"]["ok"] and state["server_pid"] == 2000


def test_death_after_ready_restarts(tmp_path):
    world = World(Script(log=((4.9, ILLEGAL),), dies_at=5.0, wait_status=1 << 8), Script())
    world.signal(12.0)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK
    [died] = done.record.read("died")
    assert died["ready"] and died["exit_code"] == 1 and died["diagnoses"][0]["id"] == "illegal-instruction"
    assert "the server died 4s after it was ready: exit code 1" in done.out
    assert len(done.record.read("ready")) == 2


@pytest.mark.parametrize(("max_restarts", "code"), [(2, ExitCode.OK), (0, ExitCode.FINDINGS)])
def test_a_death_seen_with_a_stop_signal_is_recorded_as_a_death(tmp_path, max_restarts, code):
    """It died, and the stop came before the supervisor woke (bench's stop right after the
    level that killed it): a death, not a clean stop; then the stop, or the crash-loop limit."""
    world = World(Script(log=((4.9, ILLEGAL),), dies_at=5.0, wait_status=1 << 8))
    world.signal(5.0, signal.SIGTERM)
    done = supervise(tmp_path, world, max_restarts=max_restarts)
    assert done.code == code
    [died] = done.record.read("died")
    assert died["ready"] and died["exit_code"] == 1 and died["diagnoses"][0]["id"] == "illegal-instruction"
    assert len(world.servers) == 1 and done.record.state_json()["server_pid"] is None
    if max_restarts:
        assert "stopped on SIGTERM: no server was running" in done.out
    else:
        assert done.record.read("gave_up") and not done.record.read("stopping")


def test_a_hung_server_is_killed_and_restarted(tmp_path):
    hangs = Script(hung=(3.0, 1e9), hung_answer=ProbeResult(False, 503, "503 (starting or shutting down)", 1.0))
    world = World(hangs, Script())
    world.signal(20.0)
    done = supervise(tmp_path, world)
    failures = done.record.read("probe_failed")
    assert [f["consecutive"] for f in failures] == [1, 2] and failures[0]["detail"].startswith("503")
    [hung] = done.record.read("hung")
    assert hung["ready"] and "failed 2 probes in a row" in hung["detail"]
    assert done.record.statuses == [
        *(S.LAUNCHING, S.STARTING, S.READY, S.UNHEALTHY, S.UNHEALTHY, S.BACKOFF),
        *(S.STARTING, S.READY, S.STOPPING, S.STOPPED),
    ]
    assert world.stops[0] == {"pid": 1000, "timeout": 10, "drain": False}  # hung: SIGTERM, the full stop time
    assert "killing the server: http://127.0.0.1:30000/health_generate failed 2 probes in a row" in done.out
    assert "the server hung " in done.out and done.code == ExitCode.OK


def test_a_probe_that_times_out_counts_as_a_failure(tmp_path):
    timed_out = ProbeResult(False, None, "timed out after 0.3 s", 0.3)
    world = World(Script(hung=(2.0, 1e9), hung_answer=timed_out))
    done = supervise(tmp_path, world, max_restarts=0)
    assert done.code == ExitCode.FINDINGS
    assert done.record.read("probe_failed")[0]["detail"] == "timed out after 0.3 s" and done.record.read("hung")


def test_a_probe_ok_again_makes_it_ready_again(tmp_path):
    world = World(Script(hung=(3.0, 3.5)))
    world.signal(8.0)
    done = supervise(tmp_path, world)
    assert done.record.statuses == [S.LAUNCHING, S.STARTING, S.READY, S.UNHEALTHY, S.READY, S.STOPPING, S.STOPPED]
    assert "probe ok again after 1 failure(s)" in done.out and done.record.read("hung") == []


def test_startup_budget(tmp_path):
    bar = "Loading safetensors checkpoint shards:   0% Completed | 0/4 [00:00<?, ?it/s]\r"
    world = World(Script(log=((0.1, LOADING), (0.2, bar)), ready_at=None))
    done = supervise(tmp_path, world, startup_timeout_s=3, max_restarts=0)
    assert done.code == ExitCode.FINDINGS
    detail = "not generating after 3s (last: loading weights 0% (0/4 shards))"
    assert f"killing the server: {detail}" in done.out and f"the server did not start: {detail}" in done.out
    [timeout] = done.record.read("start_timeout")
    assert timeout["detail"] == detail and not timeout["ready"] and timeout["ran_s"] >= 3.0
    assert world.stops == [{"pid": 1000, "timeout": 10, "drain": False}]


def test_a_run_that_stayed_ready_resets_the_crash_loop_count(tmp_path):
    crash, stable = Script(dies_at=0.5), Script(dies_at=20.0)
    world = World(crash, stable, crash)
    done = supervise(tmp_path, world, max_restarts=1, stable_after_s=10)
    assert [e["failures"] for e in done.record.read("restarting")] == [1, 1]  # without the reset: gave up at once
    assert done.record.read("gave_up")[0]["failures"] == 2 and len(world.servers) == 3
    assert [e["in_s"] for e in done.record.read("restarting")] == [0.2, 0.2]  # the backoff starts over too


def test_stop_lets_sglang_drain(tmp_path):
    world = World(Script(drain_s=3.0))
    world.signal(5.0, signal.SIGTERM)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK and world.stops[0]["drain"] is True
    [stopped] = done.record.read("stopped")
    assert stopped["clean"] and stopped["sigkilled"] == [] and stopped["seconds"] >= 3.0
    assert done.record.read("stopping")[0]["signal"] == "SIGTERM"


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    world = World(Script(ignores_sigterm=True))
    world.signal(5.0, signal.SIGTERM)
    done = supervise(tmp_path, world, stop_timeout_s=1)
    [stopped] = done.record.read("stopped")
    assert done.code == ExitCode.OK and stopped["clean"] and stopped["sigkilled"] == [1000, 1001, 1002, 1003]
    assert 1.0 <= stopped["seconds"] < 1.1 and ", 4 needed SIGKILL" in done.out


def test_a_second_ctrl_c_kills_at_once(tmp_path):
    world = World(Script(ignores_sigterm=True))
    world.signal(5.0)
    world.signal(5.3)
    done = supervise(tmp_path, world, stop_timeout_s=60)
    [stopped] = done.record.read("stopped")
    assert done.code == ExitCode.OK and stopped["sigkilled"] and 0.3 <= stopped["seconds"] < 0.4
    assert done.record.kinds().count("stopping") == 1


def test_a_stop_while_starting(tmp_path):
    world = World(Script(log=((0.1, LOADING),), ready_at=None))
    world.signal(0.5, signal.SIGHUP)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK
    assert done.record.statuses == [S.LAUNCHING, S.STARTING, S.STOPPING, S.STOPPED]
    assert done.record.read("stopped")[0]["clean"] and "stopping on SIGHUP" in done.out


def test_a_stop_during_backoff_has_no_server_to_stop(tmp_path):
    world = World(Script(dies_at=0.5))
    world.signal(2.0, signal.SIGTERM)
    done = supervise(tmp_path, world, backoff_initial_s=5, backoff_max_s=5)
    assert done.code == ExitCode.OK
    assert done.record.statuses == [S.LAUNCHING, S.STARTING, S.BACKOFF, S.STOPPING, S.STOPPED]
    [stopped] = done.record.read("stopped")
    assert stopped["clean"] is True and stopped["processes"] == 0 and len(world.servers) == 1
    assert "stopped on SIGTERM: no server was running" in done.out
    assert done.record.state_json()["server_pid"] is None


@pytest.mark.parametrize(
    "script, bound, says",
    [
        (
            Script(leaves=(procs.Proc(1003, "sglang::scheduler_TP1", 1, EPOCH, "me"),)),
            set(),
            "LEFT RUNNING: pid 1003 'sglang::scheduler_TP1'",
        ),
        (Script(), {30000}, "STILL BOUND: 30000 (server.port)"),
    ],
)
def test_an_unclean_stop_exits_3(tmp_path, script, bound, says):
    world = World(script)
    world.signal(5.0)
    world.at(5.0, lambda: world.bound.update(bound))
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.UNCLEAN and says in done.out
    assert done.record.read("stopped")[0]["clean"] is False and done.record.state_json()["clean"] is False


def test_a_record_that_cannot_be_written_does_not_stop_a_healthy_server(tmp_path):
    world = World()
    run = tmp_path / "run"

    def break_the_disk() -> None:  # a directory where a file must go: every write fails
        (run / "events.jsonl").unlink()
        (run / "events.jsonl").mkdir()
        (run / ".state.json.tmp").mkdir()

    def mend_it() -> None:
        (run / "events.jsonl").rmdir()
        (run / ".state.json.tmp").rmdir()

    world.at(3.0, break_the_disk)
    world.at(8.0, mend_it)
    world.signal(10.0)
    done = supervise(tmp_path, world)
    assert done.code == ExitCode.OK
    assert done.out.count("could not record state.json (Is a directory)") == 1, "said once, not at every probe"
    assert "recording state.json again" in done.out
    assert done.record.read("stopped")[0]["clean"] is True and done.record.state_json()["status"] == "stopped"


def test_a_supervisor_error_stops_the_server_and_is_recorded(tmp_path):
    world = World()

    def broken() -> dict[int, int]:
        if world.now >= 3.0:
            raise RuntimeError(f"a bug that mentions {SECRET}")
        return {}

    world.reap = broken
    with pytest.raises(RuntimeError, match="a bug"):
        supervise(tmp_path, world, spec=replace(SPEC, api_key=SECRET, api_key_env="K"))
    record = Recorded(tmp_path / "run")
    [error] = record.read("supervisor_error")
    assert error["error"] == "RuntimeError: a bug that mentions $K"
    assert world.stops == [{"pid": 1000, "timeout": 10, "drain": True}]
    assert record.state_json()["status"] == "stopped" and record.state_json()["clean"] is False


def test_the_machine_alone_from_launch_to_ready():
    clock = FakeClock()
    machine = Machine(SPEC, POLICY, clock, "server.log", "events.jsonl")
    assert machine.tick() == [Spawn()] and machine.status is S.LAUNCHING
    said = machine.started(1000, "fake:1")
    assert machine.status is S.STARTING and isinstance(said[-1], Say)
    assert machine.tick() == [Probe(1)] and machine.tick() == []  # one probe out at a time
    assert machine.probe_done(1, STARTING) == [] and machine.status is S.STARTING
    clock.now = 1.0
    assert machine.wake_at() == 1.0 and machine.tick() == [Probe(1)]
    ready = machine.probe_done(1, OK)
    assert machine.status is S.READY and ready[0] == Update(
        {
            "status": S.READY,
            "since": EPOCH + 1.0,
            "ready_after_s": 1.0,
            "last_health": {"at": EPOCH + 1.0, "ok": True, "detail": "200", "seconds": 0.01},
        }
    )


def test_the_machine_ignores_an_answer_for_an_earlier_start():
    clock = FakeClock()
    machine = Machine(SPEC, POLICY, clock, "server.log", "events.jsonl")
    machine.tick()
    machine.started(1000, "fake:1")
    assert machine.tick() == [Probe(1)]
    assert machine.exited("killed by SIGKILL", None) == [Kill(2.0)]
    machine.after_end("")
    clock.now = 1.0
    assert machine.status is S.BACKOFF and machine.tick() == [Spawn()]
    machine.started(2000, "fake:2")
    assert machine.probe_done(1, OK) == [] and machine.status is S.STARTING and not machine.probing


def test_a_move_off_the_diagram_is_a_bug_and_moves_nothing():
    """Before, the machine took whatever it was told: a second started() without the end of
    the first went from starting to starting, a stop signal after the stop from stopped to
    stopped, and the record said so. Now each raises (an internal error: the supervisor records
    it and stops the server) and the status stays where it was."""
    machine = Machine(SPEC, POLICY, FakeClock(), "server.log", "events.jsonl")
    machine.started(1000, "fake:1")
    with pytest.raises(IllegalTransition, match="from starting to starting"):
        machine.started(2000, "fake:2")
    assert machine.status is S.STARTING and machine.attempts == 1
    machine.signalled("SIGTERM")
    machine.stopped(procs.StopReport(), [], None, None)
    assert machine.status is S.STOPPED
    with pytest.raises(IllegalTransition, match="from stopped to stopped"):
        machine.signalled("SIGTERM")
    assert machine.status is S.STOPPED
    with pytest.raises(AttributeError):
        machine.status = S.READY  # moved by the machine alone
    assert set(TRANSITIONS) == set(S) - {S.SUPERVISOR_GONE, S.DAMAGED, S.UNREADABLE}  # the ones `ps` says


def test_statuses_and_kinds_are_written_as_the_strings_they_always_were(tmp_path):
    record = RunRecord(tmp_path / "run")
    record.update(status=S.GAVE_UP)
    record.event(EventKind.GAVE_UP, failures=1)
    assert json.loads(record.state_file.read_text())["status"] == "gave-up"
    assert json.loads(record.events.read_text())["event"] == "gave_up"
    assert f"{S.SUPERVISOR_GONE}" == "supervisor gone" and S("gave-up") in TERMINAL


def test_backoff_doubles_up_to_the_cap():
    policy = Policy.from_health(Health(backoff_initial_s=5, backoff_max_s=60))
    assert [policy.backoff(n) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]
    assert policy.stop_timeout_s == 60 and policy.stable_after_s == 600


def test_exit_descriptions():
    assert procs.exit_description(0) == (0, "exit code 0")
    assert procs.exit_description(1 << 8) == (1, "exit code 1")
    assert procs.exit_description(signal.SIGKILL) == (None, "killed by SIGKILL")


def test_the_supervisor_stops_with_exit_2_after_one_such_start(tmp_path):
    world = World(Script(log=((0.1, TRACEBACK),), dies_at=0.5, wait_status=1 << 8))
    done = supervise(tmp_path, world, max_restarts=3)
    assert done.code == ExitCode.ERROR
    assert done.record.kinds() == ["started", "died", "gave_up"] and len(world.servers) == 1
    [gave_up] = done.record.read("gave_up")
    assert gave_up["restart"] is False and "no module named 'numpy'" in gave_up["reason"]
    assert "not restarting fake: the serving environment is incomplete" in done.out
    assert done.record.state_json()["status"] == "gave-up"


@pytest.mark.parametrize(
    "script",
    [
        Script(log=((4.9, TRACEBACK),), dies_at=5.0, wait_status=1 << 8),  # it served first: restarted
        Script(log=((0.1, TRACEBACK), (0.4, OOM)), dies_at=0.5),  # out of memory as well: restarted
    ],
)
def test_other_deaths_are_restarted_as_before(tmp_path, script):
    world = World(script, Script())
    world.signal(12.0)
    done = supervise(tmp_path, world)
    kinds = done.record.kinds()
    assert done.code == ExitCode.OK and "restarting" in kinds and kinds.count("started") == 2, kinds
