"""Keeps one sglang server up: start it, wait until it generates, probe it, and on death
or hang diagnose, back off and restart it, up to a crash-loop limit; on SIGINT, SIGTERM or
SIGHUP stop the whole process tree within a deadline and prove that nothing is left.

One thread does the work and sleeps in select() on a pipe that signal handlers (SIGCHLD
included) and the probe thread write to: a death is seen the moment SIGCHLD arrives, and
an idle supervisor costs a wake-up per probe and per log read.
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO

import psutil

from sm120kit.serve import procs
from sm120kit.serve.diagnose import diagnose
from sm120kit.serve.probe import HEALTH_PATH, ProbeResult, probe
from sm120kit.serve.progress import LineSplitter, phase_of
from sm120kit.serve.rundir import Record, copy_truncate, rotate

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOG_TICK_S = 0.5  # how often the log is read (live tail, progress)
PROGRESS_EVERY_S = 30.0  # a "still starting" line at least this often
LOG_TAIL_BYTES = 256 * 1024  # read for a diagnosis
GPU_RELEASE_WAIT_S = 15.0
GPU_MEMORY_SLACK = 512 << 20  # what another tenant's small allocation may add meanwhile
TREE_SAMPLE_S = 1.0  # how often the run's process tree is sampled (what left it is still known)
EXIT_STOPPED, EXIT_GAVE_UP, EXIT_UNCLEAN = 0, 1, 3


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

    @classmethod
    def from_health(cls, health) -> Policy:
        return cls(**{f: getattr(health, f) for f in cls.__dataclass_fields__ if hasattr(health, f)})

    def backoff(self, failures: int) -> float:
        return min(self.backoff_initial_s * 2 ** (failures - 1), self.backoff_max_s)


@dataclass
class Server:
    """What to run and how to reach it."""

    name: str
    argv: list[str]  # with the API key in place: never logged
    shown_argv: list[str]  # with the key as "$NAME"
    env: dict[str, str]
    host: str  # where to probe
    port: int
    ports: list[tuple[str, str, int]]  # the port plan, proven free after a stop
    api_key: str | None = None
    api_key_env: str | None = None  # its name: what is written wherever the key would be
    check_gpus: bool = True


@dataclass
class Run:
    attempt: int
    proc: object
    marker: str
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    phase: str = "launching"
    phase_said_at: float = 0.0
    failures_in_row: int = 0
    log: BinaryIO | None = None  # the server's log, open for the live tail
    unredacted: str = ""  # the log's last characters, held back while they may begin the key
    splitter: LineSplitter = field(default_factory=LineSplitter)

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(frozen=True)
class End:
    kind: str  # "stop", "died", "hung", "start_timeout"
    detail: str
    exit_code: int | None = None
    at: float = field(default_factory=time.time)  # when the supervisor saw it


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Supervisor:
    def __init__(
        self,
        server: Server,
        policy: Policy,
        record: Record,
        out=None,
        echo: bool = True,
        log_max_bytes: int = 256 << 20,
    ) -> None:
        self.server, self.policy, self.record = server, policy, record
        self.out = out or sys.stdout
        self.echo, self.log_max_bytes = echo, log_max_bytes
        self.stop_signals: list[int] = []
        self.failures = 0  # consecutive failed runs: the crash-loop count
        self.restarts = 0
        self.deaths: list[str] = []
        self._line_open = False  # the echoed log ended mid-line
        self._run: Run | None = None  # the current start
        self._gpu_baseline: dict[int, int] | None = None  # GPU memory in use before the first start
        self._tree = procs.Tree()  # every process of the runs, sampled while they run
        self._sampled_at = 0.0
        self._probes: queue.SimpleQueue[tuple[int, ProbeResult]] = queue.SimpleQueue()
        self._probing = False
        if server.api_key:
            record.secrets[server.api_key] = f"${server.api_key_env or 'API_KEY'}"
        record.on_problem = self.say  # a record it cannot write is said in the output, once

    # -- output ------------------------------------------------------------------------

    def say(self, message: str) -> None:
        prefix = "\n" if self._line_open else ""
        self._line_open = False
        self.out.write(
            f"{prefix}[sm120kit {time.strftime('%H:%M:%S')}] {message}\n"
        )  # log lines in it are redacted already
        self.out.flush()

    # -- signals and waiting -----------------------------------------------------------

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: self.stop_signals.append(signum))
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def _sleep(self, seconds: float) -> None:
        """Until a signal, a probe result, or `seconds`."""
        if self._selector.select(max(0.0, seconds)):
            try:
                while os.read(self._wake_r, 512):
                    pass
            except BlockingIOError:
                pass

    def _hurry(self) -> bool:
        """A second stop signal during a stop: do not wait for the deadline."""
        self._sleep(0)
        return len(self.stop_signals) > 1

    # -- one start ---------------------------------------------------------------------

    def _start(self, attempt: int) -> Run:
        rotate(self.record.log)
        marker = f"{self.server.name}:{uuid.uuid4().hex[:12]}"
        proc = procs.spawn(self.server.argv, {**self.server.env, procs.MARKER: marker}, str(self.record.log))
        run = Run(attempt, proc, marker, log=open(self.record.log, "rb"))  # noqa: SIM115 (closed in _end_run)
        self.record.event(
            "started", attempt=attempt, pid=proc.pid, argv=self.server.shown_argv, log=str(self.record.log)
        )
        self.record.update(
            status="starting",
            since=time.time(),
            server_pid=proc.pid,
            marker=marker,
            attempt=attempt,
            restarts=self.restarts,
        )
        self.say(
            f"started {self.server.name}: pid {proc.pid} (attempt {attempt}); ready when it generates, within {_duration(self.policy.startup_timeout_s)}; log {self.record.log}"
        )
        return run

    def _read_log(self, run: Run) -> None:
        data = run.log.read()
        if not data:
            return
        text = run.unredacted + data.decode("utf-8", errors="replace")
        held = self.record.secret_prefix_at_end(text)  # a key split across two reads
        text, run.unredacted = text[: len(text) - held], text[len(text) - held :]
        text = self.record.redact(text)  # sglang logs server_args, key included
        if not text:
            return
        if self.echo:
            self.out.write(text)
            self.out.flush()
            self._line_open = not text.endswith("\n")
        if run.ready_at is None:
            for line in run.splitter.feed(text):
                if phase := phase_of(line):
                    self._progress(run, phase)
        if run.log.tell() > self.log_max_bytes:
            try:
                copy_truncate(self.record.log)
            except OSError as exc:
                self.say(
                    f"could not keep a copy of the log past {self.log_max_bytes >> 20} MiB ({exc.strerror or exc}): truncated it without one"
                )
            run.log.seek(0)

    def _progress(self, run: Run, phase: str) -> None:
        now = time.monotonic()
        same_kind = phase.split()[:2] == run.phase.split()[:2]
        run.phase = phase
        if same_kind and now - run.phase_said_at < 5 and "100%" not in phase:
            return  # shard-by-shard progress: a line every few seconds is enough
        run.phase_said_at = now
        self.record.event("progress", phase=phase, elapsed_s=round(now - run.started, 1))
        self.record.update(phase=phase)
        self.say(f"starting: {phase} ({_duration(now - run.started)})")

    def _start_probe(self, run: Run) -> None:
        self._probing = True
        attempt, s, timeout = run.attempt, self.server, self.policy.probe_timeout_s

        def work() -> None:
            try:
                result = probe(s.host, s.port, timeout, s.api_key)
            except BaseException as exc:
                result = ProbeResult(
                    False, None, f"probe error ({type(exc).__name__})", 0.0
                )  # its text may hold the key
            self._probes.put((attempt, result))
            self._probing = False
            try:
                os.write(self._wake_w, b"p")
            except OSError:
                pass

        threading.Thread(target=work, name="probe", daemon=True).start()

    def _on_probe(self, run: Run, result: ProbeResult) -> End | None:
        """Starting: the first 200 makes it ready (503 and refusals just mean "not yet").
        Ready: count failures in a row; enough of them make it hung."""
        p, now = self.policy, time.monotonic()
        if run.ready_at is None:
            if result.ok:
                run.ready_at = now
                after = round(now - run.started, 1)
                self.record.update(
                    status="ready", since=time.time(), ready_after_s=after, last_health=self._health(result)
                )
                self.record.event("ready", after_s=after)
                self.say(
                    f"ready: {self.server.name} generates (after {_duration(after)}); probing {self._url()} every {p.probe_interval_s:g}s"
                )
            return None
        self.record.update(last_health=self._health(result))
        if result.ok:
            if run.failures_in_row:
                self.record.update(status="ready")
                self.say(f"probe ok again after {run.failures_in_row} failure(s)")
            run.failures_in_row = 0
            return None
        run.failures_in_row += 1
        self.record.event(
            "probe_failed", detail=result.detail, consecutive=run.failures_in_row, limit=p.failures_before_restart
        )
        self.record.update(status="unhealthy")
        self.say(f"probe failed: {result.detail} ({run.failures_in_row}/{p.failures_before_restart})")
        if run.failures_in_row >= p.failures_before_restart:
            return End("hung", f"{self._url()} failed {run.failures_in_row} probes in a row (last: {result.detail})")
        return None

    def _watch(self, run: Run) -> End:
        """Until the run ends: a stop signal, its death, a hang or the startup deadline."""
        p = self.policy
        next_probe = time.monotonic()
        next_note = next_probe + PROGRESS_EVERY_S
        while True:
            if self.stop_signals:
                return End("stop", signal.Signals(self.stop_signals[0]).name)
            reaped = procs.reap()
            self._sample_tree()
            self._read_log(run)
            if run.pid in reaped:
                run.proc.returncode = reaped[run.pid]
                code, how = procs.exit_description(reaped[run.pid])
                return End("died", how, code)
            while not self._probes.empty():
                attempt, result = self._probes.get()
                if attempt == run.attempt and (end := self._on_probe(run, result)):
                    return end
            now = time.monotonic()
            if run.ready_at is None:
                if now - run.started > p.startup_timeout_s:
                    return End(
                        "start_timeout", f"not generating after {_duration(p.startup_timeout_s)} (last: {run.phase})"
                    )
                if now >= next_note:
                    next_note = now + PROGRESS_EVERY_S
                    self.say(
                        f"still starting: {run.phase} ({_duration(now - run.started)} of {_duration(p.startup_timeout_s)})"
                    )
            if not self._probing and now >= next_probe:
                next_probe = now + (
                    p.probe_interval_s
                    if run.ready_at is not None
                    else min(p.startup_probe_interval_s, p.probe_interval_s)
                )
                self._start_probe(run)
            wake = now + p.probe_interval_s if self._probing else next_probe  # a probe's result wakes us
            if self.echo or run.ready_at is None:
                wake = min(wake, now + LOG_TICK_S)
            self._sleep(max(0.01, wake - now))

    def _url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}{HEALTH_PATH}"

    @staticmethod
    def _health(result: ProbeResult) -> dict:
        return {"at": time.time(), "ok": result.ok, "detail": result.detail, "seconds": round(result.seconds, 3)}

    # -- after a run -------------------------------------------------------------------

    def _log_tail(self) -> str:
        try:
            with open(self.record.log, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                return self.record.redact(fh.read().decode("utf-8", errors="replace"))
        except OSError:
            return ""

    def _diagnose(self, run: Run, end: End) -> None:
        tail = self._log_tail()
        found = diagnose(tail)
        last = [line for line in tail.replace("\r", "\n").splitlines() if line.strip()][-15:]
        ran = time.monotonic() - run.started
        when = (
            f"while starting ({run.phase})"
            if run.ready_at is None
            else f"{_duration(time.monotonic() - run.ready_at)} after it was ready"
        )
        self.record.event(
            end.kind,
            detail=end.detail,
            exit_code=end.exit_code,
            noticed_at=end.at,
            ran_s=round(ran, 1),
            ready=run.ready_at is not None,
            phase=run.phase,
            diagnoses=[d.as_json() for d in found],
            log_tail=last,
        )
        what = {"died": f"the server died {when}: {end.detail}", "hung": f"the server hung {when}: {end.detail}"}.get(
            end.kind, f"the server did not start: {end.detail}"
        )
        self.say(what)
        for d in found:
            self.say(f"diagnosis: {d.title}\n    log:    {d.line}\n    advice: {d.advice}")
        if not found:
            self.say("no known SM120 failure signature in the log; its last lines:\n    " + "\n    ".join(last[-8:]))
        self.deaths.append(f"attempt {run.attempt}: {what}" + (f" [{', '.join(d.id for d in found)}]" if found else ""))

    def _sample_tree(self) -> None:
        if time.monotonic() - self._sampled_at >= TREE_SAMPLE_S:
            self._tree.sample()
            self._sampled_at = time.monotonic()

    def _end_run(self, run: Run, timeout: float, drain: bool = False) -> procs.StopReport:
        report = procs.stop(run.pid, self._tree, timeout, hurry=self._hurry, drain=drain)
        if run.proc.returncode is None:  # reaped by procs.reap(): Popen must not wait for it again
            run.proc.returncode = -signal.SIGKILL
        run.log.close()
        return report

    def _ports_taken(self, wait_s: float = 5.0) -> list[str]:
        """Ports of the plan still bound after the stop (a closing socket takes a moment)."""
        end = time.monotonic() + wait_s
        while True:
            taken = [f"{port} ({what})" for what, host, port in self.server.ports if procs.port_in_use(host, port)]
            if not taken or time.monotonic() >= end:
                return taken
            time.sleep(0.05)

    def _gpu_memory(self) -> dict[int, int] | None:
        """Memory in use on each GPU now (bytes); None when NVML cannot tell."""
        if not self.server.check_gpus:
            return None
        from sm120kit.serve import gpus

        try:
            return {g.index: g.total - g.free for g in gpus.read_gpus()}
        except gpus.NvmlUnavailable:
            return None

    def _gpu_leftovers(self, pids: set[int], wait_s: float = GPU_RELEASE_WAIT_S) -> list[str] | None:
        """What NVML still shows of the run, after waiting up to wait_s (the driver frees a
        context a moment after its process has gone: ~0.7 s for 8 x 12 GiB on an H200):
        our pids on a GPU, and GPU memory above what was in use before the first start
        (inside a container NVML reports host pids, so the pids alone could prove nothing).
        None when NVML cannot tell."""
        if not self.server.check_gpus:
            return None
        from sm120kit.serve import gpus

        end = time.monotonic() + wait_s
        while True:
            try:
                found = gpus.read_gpus()
            except gpus.NvmlUnavailable:
                return None
            left = [
                f"pid {pid} on GPU {g.index} ({used // gpus.MIB} MiB)"
                for g in found
                for pid, used in g.processes.items()
                if pid in pids
            ]
            base = self._gpu_baseline or {}
            left += [
                f"GPU {g.index} uses {(g.total - g.free - base[g.index]) // gpus.MIB} MiB more than before the start"
                for g in found
                if g.index in base and g.total - g.free - base[g.index] > GPU_MEMORY_SLACK
            ]
            if not left or time.monotonic() >= end:
                return left
            time.sleep(0.1)

    def _stop(self, run: Run | None, why: str) -> int:
        self.record.event("stopping", signal=why)
        self.record.update(status="stopping", since=time.time())
        if run is None:
            self.record.event("stopped", clean=True, processes=0)
            self.record.update(status="stopped", since=time.time(), server_pid=None)
            self.say(f"stopped on {why}: no server was running")
            return EXIT_STOPPED
        self.say(
            f"stopping on {why}: SIGTERM to sglang's launcher (it drains requests), then to the rest; SIGKILL after {_duration(self.policy.stop_timeout_s)} (a second Ctrl-C: now)"
        )
        pids = procs.members(run.pid, self._tree)
        report = self._end_run(run, self.policy.stop_timeout_s, drain=True)
        ports = self._ports_taken()
        waited = time.monotonic()
        on_gpu = self._gpu_leftovers(pids | set(report.killed))
        gpu_s = None if on_gpu is None else round(time.monotonic() - waited, 3)
        clean = report.clean and not ports and not on_gpu
        self.record.event(
            "stopped", clean=clean, ports_taken=ports, on_gpu=on_gpu, gpu_released_after_s=gpu_s, **report.as_json()
        )
        self.record.update(status="stopped", since=time.time(), server_pid=None, clean=clean)
        killed = f", {len(report.killed)} needed SIGKILL" if report.killed else ""
        gpu = (
            ""
            if on_gpu is None
            else f"; no process of ours on the GPUs (NVML, {gpu_s:.1f}s later)"
            if not on_gpu
            else f"; STILL ON A GPU: {', '.join(on_gpu)}"
        )
        port_note = (
            "ports " + ", ".join(str(p) for _, _, p in self.server.ports) + " free"
            if not ports
            else f"STILL BOUND: {', '.join(ports)}"
        )
        self.say(f"stopped: {report.processes} processes ended in {report.seconds:.1f}s{killed}; {port_note}{gpu}")
        if report.left:
            self.say("LEFT RUNNING: " + "; ".join(p.line() for p in report.left))
        return EXIT_STOPPED if clean else EXIT_UNCLEAN

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        self._install_signals()
        subreaper = procs.become_subreaper()
        me = psutil.Process()
        self.record.update(
            profile=self.server.name,
            supervisor_pid=me.pid,
            supervisor_started=me.create_time(),
            status="launching",
            since=time.time(),
            host=self.server.host,
            port=self.server.port,
            log=str(self.record.log),
            events=str(self.record.events),
            restarts=0,
            last_health=None,
            subreaper=subreaper,
        )
        self._gpu_baseline = self._gpu_memory()
        try:
            return self._loop()
        except BaseException as exc:  # a bug or a full disk: do not leave the server unsupervised
            self.record.event("supervisor_error", error=self.record.redact(f"{type(exc).__name__}: {exc}"))
            if self._run is not None and self._run.proc.returncode is None:
                self._end_run(self._run, self.policy.stop_timeout_s, drain=True)
            self.record.update(status="stopped", since=time.time(), server_pid=None, clean=False)
            raise

    def _loop(self) -> int:
        attempt = 0
        while True:
            attempt += 1
            run = self._run = self._start(attempt)
            end = self._watch(run)
            if end.kind == "stop":
                return self._stop(run, end.detail)
            if end.kind != "died":
                self.say(f"killing the server: {end.detail}")
            self._end_run(run, self.policy.stop_timeout_s if end.kind != "died" else 2.0)
            self._diagnose(run, end)
            if run.ready_at is not None and time.monotonic() - run.ready_at >= self.policy.stable_after_s:
                self.failures = 0  # it ran well for long enough: not a crash loop
            self.failures += 1
            if self.failures > self.policy.max_restarts:
                return self._give_up()
            delay = self.policy.backoff(self.failures)
            self.restarts += 1
            self.record.event("restarting", in_s=delay, failures=self.failures, limit=self.policy.max_restarts)
            self.record.update(status="backoff", since=time.time(), server_pid=None, restarts=self.restarts)
            self.say(
                f"restarting in {delay:g}s (restart {self.failures} of at most {self.policy.max_restarts} in a row)"
            )
            until = time.monotonic() + delay
            while not self.stop_signals and time.monotonic() < until:
                self._sleep(until - time.monotonic())
            if self.stop_signals:
                return self._stop(None, signal.Signals(self.stop_signals[0]).name)

    def _give_up(self) -> int:
        self.record.event("gave_up", failures=self.failures, deaths=self.deaths)
        self.record.update(status="gave-up", since=time.time(), server_pid=None)
        self.say(
            f"giving up: {self.failures} failed runs in a row (health.max_restarts = {self.policy.max_restarts}):\n    "
            + "\n    ".join(self.deaths)
            + f"\n    log: {self.record.log}; events: {self.record.events}"
        )
        return EXIT_GAVE_UP
