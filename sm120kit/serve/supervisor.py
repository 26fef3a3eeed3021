"""Keeps one sglang server up: start it, wait until it generates, probe it, and on death
or hang diagnose, back off and restart it, up to a crash-loop limit; on SIGINT, SIGTERM or
SIGHUP stop the whole process tree within a deadline and prove that nothing is left.

The decisions are sm120kit.serve.machine's; this module carries them out: it spawns and
stops the server, sends the probes, reads the log (the live tail, progress, the tail a
diagnosis reads), checks ports and GPUs after a stop, and writes the record. Time, the
machine's processes and the probes come through seams (a Clock, a Host, a Prober) whose
defaults are the real ones; tests stand fakes in for them.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Protocol, TextIO

import psutil

from sm120kit.exit_codes import ExitCode
from sm120kit.followup import complete
from sm120kit.serve import procs
from sm120kit.serve.clock import SYSTEM_CLOCK, Clock
from sm120kit.serve.host import Host, LocalHost
from sm120kit.serve.machine import (
    Action,
    Event,
    Exit,
    Kill,
    Machine,
    Probe,
    Say,
    Smoke,
    Spawn,
    Stop,
    Update,
)
from sm120kit.serve.probe import Prober, ThreadProber
from sm120kit.serve.progress import LineSplitter, phase_of
from sm120kit.serve.rundir import RunRecord, copy_truncate, rotate
from sm120kit.serve.status import EventKind, RunStatus

if TYPE_CHECKING:
    from sm120kit.quality.options import SmokeOptions
    from sm120kit.serve.machine import Policy, ServerSpec

LOG_TICK_S = 0.5  # how often the log is read (live tail, progress)
LOG_TAIL_BYTES = 256 * 1024  # read for a diagnosis
PORT_RELEASE_WAIT_S = 5.0  # a closing socket takes a moment
GPU_RELEASE_WAIT_S = 15.0
GPU_MEMORY_SLACK_MIB = 512  # what another tenant's small allocation may add meanwhile
TREE_SAMPLE_S = 1.0  # how often the run's process tree is sampled (what left it is still known)

Verdict = tuple[bool, str, list[str], bool]  # a smoke's: (passed, summary, failures, answered)


class Smoker(Protocol):
    """Runs the smoke (health.smoke) against the server of a start (a Protocol, so that
    tests can give a verdict of their own)."""

    def start(self, attempt: int) -> None: ...

    def results(self) -> list[tuple[int, Verdict]]:
        """The verdicts that came since the last call: (attempt, (passed, summary, failures,
        answered)); answered is false when the server stopped answering the smoke."""


class ThreadSmoker:
    """sm120kit.quality's smoke in a thread of its own (the supervisor goes on reading the
    log and taking signals meanwhile); wake() ends the supervisor's wait for it. A smoke
    that cannot run (the server went away, a UserError) is a failed one, with its message."""

    def __init__(self, options: SmokeOptions, wake: Callable[[], None]) -> None:
        self.options, self._wake = options, wake
        self._verdicts: queue.SimpleQueue[tuple[int, Verdict]] = queue.SimpleQueue()

    def start(self, attempt: int) -> None:
        from sm120kit.errors import UserError
        from sm120kit.quality.client import Unreachable
        from sm120kit.quality.command import smoke

        def work() -> None:
            verdict: Verdict
            try:
                result = smoke(self.options)
                stalled = [f"stopped sending early: {result.stalled}"] if result.stalled else []
                verdict = (result.passed, result.summary(), result.failures + stalled, result.stalled is None)
            except UserError as exc:  # not there (Unreachable: it hung or went away), or the key refused
                answered = not isinstance(exc, Unreachable)
                verdict = (False, f"smoke FAILED: it could not run: {exc.message}", [exc.message], answered)
            except BaseException as exc:  # a failed smoke, never a dead thread; its text may hold the key
                verdict = (False, f"smoke FAILED: smoke error ({type(exc).__name__})", [], True)
            self._verdicts.put((attempt, verdict))
            self._wake()

        threading.Thread(target=work, name="smoke", daemon=True).start()

    def results(self) -> list[tuple[int, Verdict]]:
        found = []
        while True:
            try:
                found.append(self._verdicts.get_nowait())
            except queue.Empty:
                return found


@dataclass
class Child:
    """The server process of the current start, and its log, open for the live tail."""

    proc: subprocess.Popen
    log: BinaryIO
    unredacted: str = ""  # the log's last characters, held back while they may begin the key
    splitter: LineSplitter = field(default_factory=LineSplitter)


class Supervisor:
    def __init__(
        self,
        server: ServerSpec,
        policy: Policy,
        record: RunRecord,
        out: TextIO | None = None,
        echo: bool = True,
        log_max_bytes: int = 256 << 20,
        *,
        clock: Clock = SYSTEM_CLOCK,
        host: Host | None = None,  # None: this machine (LocalHost)
        prober: Prober | None = None,  # None: HTTP probes of the server, each in a thread
        smoker: Smoker | None = None,  # health.smoke: runs the smoke (None: ThreadSmoker of `smoke`)
        smoke: SmokeOptions | None = None,  # for health.smoke
        patch_dirs: tuple[str, ...] = (),  # --patch-dir: their known failures diagnose a death too
    ) -> None:
        self.server, self.policy, self.record = server, policy, record
        self.out = out or sys.stdout
        self.echo, self.log_max_bytes = echo, log_max_bytes
        self.clock = clock
        self.host = host or LocalHost()
        self.prober = prober or ThreadProber(
            server.host, server.port, policy.probe_timeout_s, server.api_key, self.host.wake, server.probe_path
        )
        self.smoker = smoker or (ThreadSmoker(smoke, self.host.wake) if smoke is not None else None)
        self.machine = Machine(server, policy, clock, str(record.log), str(record.events), patch_dirs)
        self.stop_signals: list[int] = []
        self._line_open = False  # the echoed log ended mid-line
        self._child: Child | None = None  # the server of the current start
        self._gpu_baseline: dict[int, int] | None = None  # GPU memory in use before the first start
        self._sampled_at = float("-inf")
        if server.api_key:
            record.secrets[server.api_key] = f"${server.api_key_env or 'API_KEY'}"
        record.on_problem = self.say  # a record it cannot write is said in the output, once

    def say(self, message: str) -> None:
        prefix = "\n" if self._line_open else ""
        self._line_open = False
        at = time.strftime("%H:%M:%S", time.localtime(self.clock.time()))
        message = complete(message)  # a command it names, for the serve that runs (its --python, ...)
        self.out.write(f"{prefix}[sm120kit {at}] {message}\n")  # log lines in it are redacted already
        self.out.flush()

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> ExitCode:
        self.host.listen(self.stop_signals.append)
        subreaper = self.host.become_subreaper()
        me = psutil.Process()
        self._apply(self.machine.launch(me.pid, me.create_time(), subreaper))
        self._gpu_baseline = self._gpu_memory()
        try:
            while (code := self._step()) is None:
                self._wait()
            return code
        except BaseException as exc:  # a bug or a full disk: do not leave the server unsupervised
            self.record.event(EventKind.SUPERVISOR_ERROR, error=self.record.redact(f"{type(exc).__name__}: {exc}"))
            if self._child is not None and self._child.proc.returncode is None:
                self._end_run(self.policy.stop_timeout_s, drain=True)
            self.record.update(status=RunStatus.STOPPED, since=self.clock.time(), server_pid=None, clean=False)
            raise

    def _step(self) -> ExitCode | None:
        """What happened since the last wake-up, most urgent first, told to the machine.
        A death seen with a stop signal was not the stop's doing (the server runs in a
        session of its own: a stop reaches it only through us): it is recorded as a death."""
        reaped = self.host.reap()
        child = self._child
        if child is not None and child.proc.pid in reaped:
            self._read_log(child)
            child.proc.returncode = reaped[child.proc.pid]
            exit_code, how = procs.exit_description(reaped[child.proc.pid])
            if (code := self._apply(self.machine.exited(how, exit_code))) is not None or not self.stop_signals:
                return code
        if self.stop_signals:
            return self._apply(self.machine.signalled(signal.Signals(self.stop_signals[0]).name))
        self._sample_tree()
        if self._child is not None:
            self._read_log(self._child)
        for attempt, result in self.prober.results():
            if (code := self._apply(self.machine.probe_done(attempt, result))) is not None:
                return code
        for attempt, verdict in self.smoker.results() if self.smoker else ():
            if (code := self._apply(self.machine.smoke_done(attempt, *verdict))) is not None:
                return code
        return self._apply(self.machine.tick())

    def _wait(self) -> None:
        now = self.clock.monotonic()
        wake = self.machine.wake_at()
        if self._child is not None and (self.echo or self.machine.starting):
            wake = min(wake, now + LOG_TICK_S)
        self.host.wait(max(0.01, wake - now))

    def _hurry(self) -> bool:
        """A second stop signal during a stop: do not wait for the deadline."""
        self.host.wait(0)
        return len(self.stop_signals) > 1

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
            case Spawn():
                return self._spawn()
            case Probe(attempt):
                self.prober.start(attempt)
            case Smoke(attempt):
                if self.smoker is None:  # nothing to run it with: not a verdict of failure
                    return self.machine.smoke_done(attempt, True, "smoke skipped: no smoke options", [])
                self.smoker.start(attempt)
            case Kill(timeout):
                self._end_run(timeout)
                return self.machine.after_end(self._log_tail())
            case Stop():
                return self._stop()
        return []

    # -- a start -----------------------------------------------------------------------

    def _spawn(self) -> list[Action]:
        rotate(self.record.log)
        marker = f"{self.server.name}:{uuid.uuid4().hex[:12]}"
        proc = self.host.spawn(self.server.argv, {**self.server.env, procs.MARKER: marker}, str(self.record.log))
        self._child = Child(proc, open(self.record.log, "rb"))  # noqa: SIM115 (closed in _end_run)
        return self.machine.started(proc.pid, marker)

    def _read_log(self, child: Child) -> None:
        data = child.log.read()
        if not data:
            return
        text = child.unredacted + data.decode("utf-8", errors="replace")
        held = self.record.secret_prefix_at_end(text)  # a key split across two reads
        text, child.unredacted = text[: len(text) - held], text[len(text) - held :]
        text = self.record.redact(text)  # sglang logs server_args, key included
        if not text:
            return
        if self.echo:
            self.out.write(text)
            self.out.flush()
            self._line_open = not text.endswith("\n")
        if self.machine.starting:
            for line in child.splitter.feed(text):
                if phase := phase_of(line):
                    self._apply(self.machine.progress(phase))
        if child.log.tell() > self.log_max_bytes:
            try:
                copy_truncate(self.record.log)
            except OSError as exc:
                self.say(
                    f"could not keep a copy of the log past {self.log_max_bytes >> 20} MiB "
                    f"({exc.strerror or exc}): truncated it without one"
                )
            child.log.seek(0)

    def _sample_tree(self) -> None:
        if self.clock.monotonic() - self._sampled_at >= TREE_SAMPLE_S:
            self.host.sample()
            self._sampled_at = self.clock.monotonic()

    def _log_tail(self) -> str:
        try:
            with open(self.record.log, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                return self.record.redact(fh.read().decode("utf-8", errors="replace"))
        except OSError:
            return ""

    # -- the end of a start ------------------------------------------------------------

    def _running(self) -> Child:
        """The server of the current start: the machine ends or stops one only while it runs."""
        assert self._child is not None, "no server is running"
        return self._child

    def _end_run(self, timeout: float, drain: bool = False) -> procs.StopReport:
        child = self._running()
        report = self.host.stop(child.proc.pid, timeout, self._hurry, drain)
        if child.proc.returncode is None:  # reaped by the host's reap(): Popen must not wait for it again
            child.proc.returncode = -signal.SIGKILL
        child.log.close()
        self._child = None
        return report

    def _stop(self) -> list[Action]:
        pids = self.host.members(self._running().proc.pid)
        report = self._end_run(self.policy.stop_timeout_s, drain=True)
        ports = self._ports_taken()
        waited = self.clock.monotonic()
        on_gpu = self._gpu_leftovers(pids | set(report.killed))
        gpu_s = None if on_gpu is None else round(self.clock.monotonic() - waited, 3)
        return self.machine.stopped(report, ports, on_gpu, gpu_s)

    def _ports_taken(self, wait_s: float = PORT_RELEASE_WAIT_S) -> list[str]:
        """Ports of the plan still bound after the stop."""
        end = self.clock.monotonic() + wait_s
        while True:
            taken = [f"{port} ({what})" for what, host, port in self.server.ports if self.host.port_in_use(host, port)]
            if not taken or self.clock.monotonic() >= end:
                return taken
            self.clock.sleep(0.05)

    def _gpu_memory(self) -> dict[int, int] | None:
        """Memory in use on each GPU now (MiB); None when NVML cannot tell."""
        if not self.server.check_gpus:
            return None
        from sm120kit.node import nvml

        try:
            found = self.host.read_gpus()
        except nvml.NvmlUnavailable:
            return None
        # only the GPUs it may use: a fleet's other replicas load theirs meanwhile
        return {g.index: g.in_use_mib for g in found if self.server.gpus is None or g.index in self.server.gpus}

    def _gpu_leftovers(self, pids: set[int], wait_s: float = GPU_RELEASE_WAIT_S) -> list[str] | None:
        """What NVML still shows of the run, after waiting up to wait_s (the driver frees a
        context a moment after its process has gone: ~0.7 s for 8 x 12 GiB on an H200):
        our pids on a GPU, and GPU memory above what was in use before the first start
        (inside a container NVML reports host pids, so the pids alone could prove nothing).
        None when NVML cannot tell."""
        if not self.server.check_gpus:
            return None
        from sm120kit.node import nvml

        end = self.clock.monotonic() + wait_s
        while True:
            try:
                found = self.host.read_gpus()
            except nvml.NvmlUnavailable:
                return None
            left = [
                f"pid {pid} on GPU {g.index} ({used} MiB)" for g in found for pid, used in g.pids.items() if pid in pids
            ]
            base = self._gpu_baseline or {}
            left += [
                f"GPU {g.index} uses {g.in_use_mib - base[g.index]} MiB more than before the start"
                for g in found
                if g.index in base and g.in_use_mib - base[g.index] > GPU_MEMORY_SLACK_MIB
            ]
            if not left or self.clock.monotonic() >= end:
                return left
            self.clock.sleep(0.1)
