"""Timing candidate configs on this node's GPUs: one worker process per GPU (worker.py, run by the
target's interpreter), the batch sizes handed out one at a time, a resumable state file, a budget,
and Ctrl-C that leaves no worker behind.

The parent never imports torch: it speaks worker.py's JSON-lines protocol (see that file) over
pipes. A finished batch size is written to the state file at once, so a run stopped by the budget,
by Ctrl-C or by a crash resumes where it stopped; the state is keyed by everything that makes a
timing comparable (shape, candidates, sglang/Triton/torch versions, GPU model, timing settings).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypeAlias

from sm120kit.atomic_write import write_atomic
from sm120kit.errors import UserError
from sm120kit.tune.shape import MoeShape

WORKER = Path(__file__).with_name("worker.py")
PROTOCOL = 1  # worker.py's
STATE_VERSION = 1
PROBE_TIMEOUT_S = 180.0
KILL_GRACE_S = 5.0
MAX_RESTARTS = 3  # fresh workers for one batch size after crashes, before it is given up
ERROR_SAMPLES = 3
# How each candidate is timed (worker.py's job keys); part of the state's key.
DEFAULT_SETTINGS = {"seed": 0, "graph_runs": 10, "warmup": 3, "repeats": 10}

Progress = Callable[[int, int, str], None]  # (candidates timed, candidates in all, what is running)


class Stop(str, Enum):
    COMPLETE = "complete"  # every batch size finished
    BUDGET = "budget"  # the budget ran out; what finished is kept
    INTERRUPTED = "interrupted"  # Ctrl-C; what finished is kept


@dataclass
class BatchTiming:
    """One batch size: sglang's default config against the best candidate, timed in one worker."""

    batch_size: int
    default: dict  # the installed sglang's get_default_config for this M
    default_us: float | None  # None: the default does not run on this GPU
    best: dict | None  # the fastest candidate that ran and matched the reference
    best_us: float | None
    timed: int = 0  # candidates timed and correct
    failed: int = 0  # did not compile or launch (OutOfResources, a crash)
    incorrect: int = 0  # ran, but differed from the reference
    skipped: int = 0  # not timed (the budget ran out, a crash took the worker)
    pruned: int = 0  # of timed: over twice the best at their first replay, so not replayed further
    reference: str = "default"  # what the outputs were checked against: "default" or "fallback"
    gpu: int | None = None
    elapsed_s: float = 0.0
    compile_s: float = 0.0  # of elapsed_s: first runs of the candidates (Triton compiles)
    bench_s: float = 0.0  # of elapsed_s: CUDA-graph capture and timed replays
    errors: list[str] = field(default_factory=list)  # a few of the failures, as the worker said them

    @property
    def speedup(self) -> float | None:
        if self.default_us and self.best_us:
            return self.default_us / self.best_us
        return None

    def to_json(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}

    @classmethod
    def from_json(cls, data: dict) -> BatchTiming:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class TimingResult:
    rows: list[BatchTiming]  # finished batch sizes, ascending
    pending: list[int]  # batch sizes not finished (budget, Ctrl-C)
    stop: Stop
    resumed: list[int]  # batch sizes taken from the state file, not timed again
    device: str  # the GPU model the workers ran on
    versions: dict  # sglang, triton, torch of the target
    candidates: int
    gpus: list[int]
    elapsed_s: float
    state_path: Path
    compile_jobs: int = 0  # processes that compiled the candidates before the timing (0: none)
    compile_s: float = 0.0  # the wall time they took
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.pending and all(row.best is not None for row in self.rows)

    def best_configs(self) -> dict[int, dict]:
        """The table sglang reads: batch size -> config, for the batch sizes that have a winner."""
        return {row.batch_size: row.best for row in self.rows if row.best is not None}

    def as_json(self) -> dict:
        return {
            "stop": self.stop.value,
            "complete": self.complete,
            "rows": [row.to_json() for row in self.rows],
            "pending": self.pending,
            "resumed": self.resumed,
            "device": self.device,
            "versions": self.versions,
            "candidates": self.candidates,
            "gpus": self.gpus,
            "elapsed_s": round(self.elapsed_s, 3),
            "compile_jobs": self.compile_jobs,
            "compile_s": round(self.compile_s, 3),
            "state": str(self.state_path),
            "notes": self.notes,
        }


# ----------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class Probe:
    sglang: str
    triton: str | None
    torch: str
    devices: list[str]
    memory: list[int] = field(default_factory=list)  # bytes per GPU (empty: not reported)


def probe(python: Path, worker: Path = WORKER) -> Probe:
    """What the target can time on: versions and GPUs, asked of its interpreter. A target that
    cannot time (no torch, no CUDA, no GPU, no sglang) is a UserError before anything is written."""
    hint = "run tune-moe on a node with GPUs, with --python naming the environment sglang serves from"
    try:
        done = subprocess.run(
            [str(python), str(worker), "--probe"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(f"{python}: cannot run it to look for GPUs: {exc}", hint) from exc
    info = None
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "probe":
                info = event
    if info is None:
        tail = " ".join((done.stderr or "").strip().splitlines()[-3:])
        raise UserError(f"{python}: the timing worker's probe said nothing (exit {done.returncode}): {tail}", hint)
    if not info.get("torch") or info.get("error", "").startswith("torch cannot be imported"):
        raise UserError(f"{python}: no torch in this environment: timing needs torch with CUDA and a GPU", hint)
    if not info.get("cuda") or not info.get("devices"):
        why = f" ({info['error']})" if info.get("error") else ""
        raise UserError(f"{python}: torch {info['torch']} sees no CUDA GPU{why}: timing needs one", hint)
    if not info.get("sglang"):
        raise UserError(f"{python}: sglang is not installed in this environment", "pip install sglang")
    return Probe(
        info["sglang"], info.get("triton"), info["torch"], list(info["devices"]), list(info.get("memory") or [])
    )


# ----------------------------------------------------------------------------- the state


def state_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def load_state(path: Path, key: str) -> tuple[dict[int, BatchTiming], str | None]:
    """Finished batch sizes of an earlier run with the same key; a note when a state was there
    but is not used."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError):
        return {}, f"the state file {path} is not readable JSON: timing every batch size again"
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION or data.get("key") != key:
        return {}, (
            f"the state file {path} is for another shape, candidate set, GPU or sglang/Triton/torch: "
            "timing every batch size again"
        )
    try:
        rows = {int(m): BatchTiming.from_json(row) for m, row in data.get("batches", {}).items()}
    except (TypeError, ValueError):
        return {}, f"the state file {path} is damaged: timing every batch size again"
    return rows, None


def save_state(path: Path, key: str, fields: dict, rows: dict[int, BatchTiming]) -> None:
    """Written whole (write_atomic): a kill at any point leaves the old state or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "version": STATE_VERSION,
        "key": key,
        "key_fields": fields,
        "batches": {str(m): row.to_json() for m, row in sorted(rows.items())},
    }
    write_atomic(path, json.dumps(data, indent=1).encode())


# ----------------------------------------------------------------------------- workers


def visible_device(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES value for our GPU index `gpu`, counted among the GPUs visible to
    us (a parent started with CUDA_VISIBLE_DEVICES=4,5 means 4 by GPU 0)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        visible = [d.strip() for d in inherited.split(",") if d.strip()]
        if gpu < len(visible):
            return visible[gpu]
    return str(gpu)


# (the worker, its event; None: its output ended)
_Events: TypeAlias = "queue.Queue[tuple[Worker, dict | None]]"


class Worker:
    """One worker process on one GPU, with threads that turn its output into events on a queue."""

    def __init__(self, python: Path, script: Path, gpu: int, job: dict, events: _Events) -> None:
        self.gpu = gpu
        self.batch: dict | None = None  # the request in flight
        self.results: list[dict] = []  # its result events so far
        self.reference_seen = False
        self.reference: dict = {}
        self.default: dict = {}
        self.finished = False  # told there is no more work
        self.fatal = False  # said why it stopped
        self.stderr_tail: deque[str] = deque(maxlen=30)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(gpu), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # its own process group: Ctrl-C reaches us, and we end it whole
        )
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # all three are pipes
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(events,), daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.send(job)

    def _read_stdout(self, events: _Events) -> None:
        for line in self.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.stderr_tail.append(line.rstrip())
                continue
            if isinstance(event, dict) and "event" in event:
                events.put((self, event))
        events.put((self, None))  # end of output: the worker is gone

    def _read_stderr(self) -> None:
        for line in self.stderr:
            self.stderr_tail.append(line.rstrip())

    def send(self, message: dict) -> None:
        try:
            self.stdin.write(json.dumps(message) + "\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: its end of output says so

    def request(self, batch: dict) -> None:
        self.batch, self.results, self.reference_seen = batch, [], False
        self.send(batch)

    def finish(self) -> None:
        """No more work: close its stdin and let it exit."""
        self.finished = True
        with contextlib.suppress(OSError):
            self.stdin.close()

    def kill(self) -> None:
        """SIGTERM to its process group, SIGKILL after a grace period."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()

    def tail(self) -> str:
        return " | ".join(list(self.stderr_tail)[-5:])


# ----------------------------------------------------------------------------- the run


def _validate(shape: MoeShape, batch_sizes: Sequence[int], candidates: Sequence[dict], gpus: Sequence[int]) -> None:
    if not gpus:
        raise UserError("no GPU to time on", "name GPUs with --gpus, or run on a node that has them")
    if any(not isinstance(g, int) or g < 0 for g in gpus):
        raise UserError(f"GPU indices must be non-negative integers, not {list(gpus)}", "e.g. --gpus 0,1")
    if not batch_sizes or any(not isinstance(m, int) or m < 1 for m in batch_sizes):
        raise UserError(f"batch sizes must be positive integers, not {list(batch_sizes)}", "e.g. --batch-sizes 1,64")
    if not candidates:
        raise UserError(f"no candidate config to time for {shape.model or 'this shape'}", "see tune-moe --plan")


def time_candidates(
    python: Path,
    shape: MoeShape,
    batch_sizes: Sequence[int],
    candidates: Sequence[dict],
    gpus: list[int],
    *,
    budget_s: float | None,
    state_path: Path,
    progress: Progress | None = None,
    settings: dict | None = None,
    compile_jobs: int | None = None,
    worker: Path = WORKER,
) -> TimingResult:
    """Time every candidate at every batch size with the target's sglang kernel, the batch sizes
    spread over one worker per GPU (largest first, each to the next free GPU). Returns what
    finished; the caller writes the table. Ctrl-C stops the workers and returns what finished
    (stop=INTERRUPTED); the budget does the same (stop=BUDGET); both are resumed by calling again
    with the same state_path.

    Before the timing, `compile_jobs` processes (default: one per CPU core, at most 8 a GPU and
    as many as its memory holds with the weights in each) run
    every candidate once at every batch size, so that Triton's compiles (about half of a tune's
    time when one process does them) happen in parallel into its on-disk cache; the timing
    workers then load the kernels from there, one per GPU, with nothing else on it."""
    started = time.monotonic()
    _validate(shape, batch_sizes, candidates, gpus)
    found = probe(python, worker)
    missing = [g for g in gpus if g >= len(found.devices)]
    if missing:
        raise UserError(
            f"GPU {missing[0]} does not exist: {python} sees {len(found.devices)} GPU(s)",
            f"--gpus {','.join(map(str, range(len(found.devices))))}",
        )
    models = sorted({found.devices[g] for g in gpus})
    settings = {**DEFAULT_SETTINGS, **(settings or {})}
    key_fields = {
        "protocol": PROTOCOL,
        "shape": {k: v for k, v in shape.to_json().items() if k != "model"},
        "candidates": list(candidates),
        "sglang": found.sglang,
        "triton": found.triton,
        "torch": found.torch,
        "devices": models,
        "settings": settings,
    }
    key = state_key(key_fields)
    done, note = load_state(state_path, key)
    notes = [note] if note else []
    if len(models) > 1:
        notes.append(f"the GPUs are of different models ({', '.join(models)}): one table for all of them")
    resumed = sorted(m for m in done if m in batch_sizes)
    # largest first: the longest batch sizes start early, the short ones fill the gaps
    queue_ = sorted({m for m in batch_sizes if m not in done}, reverse=True)
    total_candidates = len(queue_) * len(candidates)
    run = _Run(python, worker, shape, candidates, settings, progress, total_candidates)
    stop = Stop.COMPLETE
    jobs, compile_s = 0, 0.0
    if queue_:
        deadline = started + budget_s if budget_s is not None else None
        if compile_jobs is None:
            memory = min((found.memory[g] for g in gpus if g < len(found.memory)), default=None)
            jobs = default_compile_jobs(len(gpus), len(candidates), per_gpu=compile_jobs_per_gpu(shape, memory))
        else:
            jobs = compile_jobs
        try:
            if jobs > 1:
                compile_started = time.monotonic()
                stop = run.precompile(queue_, gpus, jobs, deadline)
                compile_s = time.monotonic() - compile_started
            else:
                jobs = 0
            if stop is Stop.COMPLETE:
                stop = run.drive(queue_, gpus, deadline, done, lambda: save_state(state_path, key, key_fields, done))
        finally:
            run.kill_all()
    notes += run.notes
    rows = [done[m] for m in sorted(done) if m in batch_sizes]
    pending = sorted(m for m in batch_sizes if m not in done)
    if pending and stop is Stop.COMPLETE:  # batch sizes given up (a worker that kept crashing)
        notes.append(f"batch sizes not timed: {', '.join(map(str, pending))}")
    return TimingResult(
        rows=rows,
        pending=pending,
        stop=stop,
        resumed=resumed,
        device=models[0] if len(models) == 1 else ", ".join(models),
        versions={"sglang": found.sglang, "triton": found.triton, "torch": found.torch},
        candidates=len(candidates),
        gpus=list(gpus),
        elapsed_s=time.monotonic() - started,
        state_path=state_path,
        compile_jobs=jobs,
        compile_s=compile_s,
        notes=notes,
    )


# What one compile process holds on its GPU besides the weights: the CUDA context, Triton's
# and torch's workspaces, the activations of the largest batch size.
PROCESS_OVERHEAD_BYTES = 2 << 30
WEIGHT_BYTES = {None: 2, "fp8_w8a8": 1, "int8_w8a8": 1, "int8_w8a16": 1, "int4_w4a16": 0.5}


def compile_jobs_per_gpu(shape: MoeShape, memory: int | None, most: int = 8) -> int:
    """Compile processes one GPU holds: each has the layer's weights (w13 and w2) on it; 80% of
    the GPU's memory is shared out, at most `most` processes."""
    if not memory:
        return most
    weights = shape.experts * 3 * shape.intermediate * shape.hidden * WEIGHT_BYTES.get(shape.dtype, 2)
    return max(1, min(most, int(0.8 * memory // (weights + PROCESS_OVERHEAD_BYTES))))


def default_compile_jobs(gpus: int, candidates: int, per_gpu: int = 8) -> int:
    """One compile process per CPU core, at most per_gpu a GPU, and at least a few candidates each."""
    return max(1, min(os.cpu_count() or 1, per_gpu * gpus, candidates // 4))


class _Run:
    """The dispatch loop: the event queue, the workers, what is in flight."""

    def __init__(self, python, script, shape, candidates, settings, progress, total) -> None:
        self.python, self.script, self.candidates, self.progress = python, script, list(candidates), progress
        self.job = {
            "protocol": PROTOCOL,
            "shape": shape.to_json(),
            "candidates": self.candidates,
            "stream": True,
            **settings,
        }
        self.events: _Events = queue.Queue()
        self.workers: dict[int, Worker] = {}
        self.total, self.counted = total, 0
        self.notes: list[str] = []
        self.carry: dict[int, dict] = {}  # batch size -> results and skips kept across a worker's crash
        self.restarts: dict[int, int] = {}

    def start(self, gpu: int) -> Worker:
        worker = Worker(self.python, self.script, gpu, self.job, self.events)
        self.workers[gpu] = worker
        return worker

    def kill_all(self) -> None:
        for worker in list(self.workers.values()):
            worker.kill()
        self.workers.clear()

    def _tick(self, worker: Worker) -> None:
        self.counted += 1
        if self.progress is not None:
            m = worker.batch["batch_size"] if worker.batch else "?"
            self.progress(min(self.counted, self.total), self.total, f"batch {m} on GPU {worker.gpu}")

    def _dispatch(self, worker: Worker, queue_: list[int]) -> None:
        if not queue_:
            worker.batch = None
            worker.finish()
            return
        m = queue_.pop(0)
        carried = self.carry.get(m, {})
        request: dict[str, object] = {"batch_size": m}
        if carried.get("skip"):
            request["skip"] = sorted(carried["skip"])
        worker.request(request)

    def precompile(self, batch_sizes: list[int], gpus: list[int], jobs: int, deadline) -> Stop:
        """worker.py's compile mode in `jobs` processes spread over the GPUs, each with every
        jobs-th candidate. A compile process that fails is only a loss of time: the timing
        workers compile what is missing themselves."""
        indices = list(range(len(self.candidates)))
        job = {**self.job, "mode": "compile", "stream": False, "batch_sizes": batch_sizes}
        compilers: dict[int, Worker] = {}
        try:
            for k in range(jobs):
                proc = Worker(
                    self.python, self.script, gpus[k % len(gpus)], {**job, "indices": indices[k::jobs]}, self.events
                )
                proc.finish()
                compilers[k] = proc
            total, count = len(batch_sizes) * len(indices), 0
            alive = set(compilers.values())
            while alive:
                if deadline is not None and time.monotonic() >= deadline:
                    self.notes.append("the budget ran out while compiling the candidates")
                    return Stop.BUDGET
                try:
                    proc, event = self.events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is None:
                    alive.discard(proc)
                    if proc.proc.wait() not in (0, None) and not proc.fatal:
                        self.notes.append(f"a compile process died (exit {proc.proc.returncode}): {proc.tail()}")
                elif event["event"] == "compiled":
                    count += 1
                    if self.progress is not None:
                        self.progress(min(count, total), total, f"compiling on {jobs} processes")
                elif event["event"] == "fatal":
                    proc.fatal = True
                    if event.get("kind") != "cuda":
                        raise UserError(
                            f"the timing worker on GPU {proc.gpu} stopped: {event.get('error')}",
                            "check that the target's sglang imports: <python> -c 'import sglang'",
                        )
            return Stop.COMPLETE
        except KeyboardInterrupt:
            self.notes.append("interrupted while compiling the candidates")
            return Stop.INTERRUPTED
        finally:
            for proc in compilers.values():
                proc.kill()

    def drive(self, queue_: list[int], gpus: list[int], deadline, done: dict, save: Callable[[], None]) -> Stop:
        for gpu in gpus[: len(queue_)]:
            self._dispatch(self.start(gpu), queue_)
        try:
            while self.workers:
                timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                if deadline is not None and time.monotonic() >= deadline:
                    self.notes.append("the budget ran out: the batch sizes in flight were stopped")
                    return Stop.BUDGET
                try:
                    worker, event = self.events.get(timeout=timeout)
                except queue.Empty:
                    continue
                if worker is not self.workers.get(worker.gpu):
                    continue  # a replaced worker's last words
                self._handle(worker, event, queue_, done, save)
            return Stop.COMPLETE
        except KeyboardInterrupt:
            self.notes.append("interrupted: the batch sizes in flight were stopped")
            return Stop.INTERRUPTED

    def _handle(self, worker: Worker, event: dict | None, queue_: list[int], done: dict, save) -> None:
        kind = event["event"] if event else "gone"
        said = event or {}  # the event, where it is one
        if kind == "reference":
            worker.reference_seen = True
            worker.reference = said
        elif kind == "batch":
            worker.default = said.get("default") or {}
        elif kind == "result":
            worker.results.append(said)
            self._tick(worker)
        elif kind == "done":
            m = said["batch_size"]
            done[m] = self._row(worker, said)
            self.carry.pop(m, None)
            save()
            self._dispatch(worker, queue_)
        elif kind == "exit":
            pass
        elif kind == "gone" and worker.finished and worker.batch is None:  # a clean exit
            worker.kill()
            del self.workers[worker.gpu]
        elif kind in ("fatal", "gone"):
            self._lost(worker, event, queue_, done, save)

    def _row(self, worker: Worker, event: dict) -> BatchTiming:
        m = event["batch_size"]
        carried = self.carry.get(m, {})
        results = carried.get("results", []) + worker.results
        ok = [r for r in results if r["status"] == "ok"]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        failures = [r for r in results if r["status"] != "ok"]
        errors = [f"{self._tile(r['index'])}: {r.get('error', r['status'])}" for r in failures[:ERROR_SAMPLES]]
        default_us = event.get("default_us")
        return BatchTiming(
            batch_size=m,
            default=worker.default,
            default_us=default_us,
            best=self.candidates[best["index"]] if best else None,
            best_us=best["us"] if best else None,
            timed=len(ok),
            failed=sum(r["status"] == "failed" for r in results),
            incorrect=sum(r["status"] == "incorrect" for r in results),
            skipped=len(self.candidates) - len(results),
            pruned=sum(bool(r.get("pruned")) for r in ok),
            reference=worker.reference.get("source", "default"),
            gpu=worker.gpu,
            elapsed_s=float(event.get("elapsed_s") or 0.0) + carried.get("elapsed_s", 0.0),
            compile_s=sum(r.get("compile_s", 0.0) for r in results),
            bench_s=sum(r.get("bench_s", 0.0) for r in results),
            errors=errors,
        )

    def _tile(self, index: int) -> str:
        c = self.candidates[index]
        return f"{c.get('BLOCK_SIZE_M')}x{c.get('BLOCK_SIZE_N')}x{c.get('BLOCK_SIZE_K')}"

    def _lost(self, worker: Worker, event: dict | None, queue_: list[int], done: dict, save) -> None:
        """The worker ended by a fatal event or died. A crash in the middle of a batch size is put
        on the candidate that was running (the first not reported); a fresh worker goes on with the
        rest. Anything else (sglang does not import, no GPU) ends the run: a UserError."""
        worker.kill()
        del self.workers[worker.gpu]
        error = event.get("error") if event else f"the worker died (exit {worker.proc.returncode}): {worker.tail()}"
        fatal_kind = event.get("kind") if event else "died"
        if fatal_kind not in ("cuda", "died"):
            self.kill_all()
            raise UserError(
                f"the timing worker on GPU {worker.gpu} stopped: {error}",
                "check that the target's sglang imports: <python> -c 'import sglang'",
            )
        batch = worker.batch
        if batch is None:  # died between batch sizes: start again if work is left
            if queue_:
                self._dispatch(self.start(worker.gpu), queue_)
            return
        m = batch["batch_size"]
        carried = self.carry.setdefault(m, {"results": [], "skip": set(), "elapsed_s": 0.0})
        carried["results"] += worker.results
        seen = {r["index"] for r in carried["results"]}
        carried["skip"] |= seen
        self.restarts[m] = self.restarts.get(m, 0) + 1
        order = [i for i in range(len(self.candidates)) if i not in carried["skip"]]
        if not worker.reference_seen or self.restarts[m] > MAX_RESTARTS:
            why = "the reference config" if not worker.reference_seen else "too many crashes"
            self.notes.append(f"batch size {m} given up on GPU {worker.gpu} ({why}): {error}")
            self.carry.pop(m, None)
        else:
            if event is None and order:  # died without a word: blame the candidate that was running
                suspect = order[0]
                failed = {"event": "result", "batch_size": m, "index": suspect, "status": "failed", "error": error}
                carried["results"].append(failed)
                carried["skip"].add(suspect)
                self._tick(worker)
            # (a fatal "cuda" event came after the failed result of the candidate that caused it)
            queue_.insert(0, m)
        if queue_:
            self._dispatch(self.start(worker.gpu), queue_)


# ----------------------------------------------------------------------------- default against tuned


@dataclass(frozen=True)
class Comparison:
    """sglang's default config and the tuned one at one batch size, timed in one worker, replay
    about replay (worker.py's interleave mode), so drift falls on both alike."""

    batch_size: int
    default: dict
    default_us: float | None
    tuned: dict
    tuned_us: float | None
    rel_err: float | None  # the tuned output against the default's
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.tuned_us if self.default_us and self.tuned_us else None

    def to_json(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def compare_with_default(
    python: Path,
    shape: MoeShape,
    tuned: dict[int, dict],
    gpu: int = 0,
    *,
    repeats: int = 50,
    settings: dict | None = None,
    worker: Path = WORKER,
    timeout_s: float | None = None,
) -> list[Comparison]:
    """Time each batch size's tuned config against sglang's default in one worker on one GPU."""
    if not tuned:
        return []
    configs: list[dict] = []
    for config in tuned.values():
        if config not in configs:
            configs.append(config)
    job = {
        "protocol": PROTOCOL,
        "shape": shape.to_json(),
        "candidates": configs,
        "batch_sizes": [{"batch_size": m, "indices": [configs.index(c)]} for m, c in sorted(tuned.items())],
        "interleave": True,
        **{**DEFAULT_SETTINGS, **(settings or {}), "repeats": repeats},
    }
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(gpu)}
    proc = subprocess.Popen(
        [str(python), str(worker)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(json.dumps(job) + "\n", timeout=timeout_s)
    except BaseException:  # Ctrl-C or the timeout: end its process group, then say so
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    found: dict[int, dict] = {}
    for line in out.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind, m = event.get("event"), event.get("batch_size")
        if kind == "fatal":
            raise UserError(f"the timing worker on GPU {gpu} stopped: {event.get('error')}")
        if m is None:
            continue
        row = found.setdefault(m, {})
        if kind == "batch":
            row["default"] = event.get("default") or {}
        elif kind == "reference":
            row["default_us"] = event.get("us") if event.get("source") == "default" else None
        elif kind == "result":
            row["result"] = event
    comparisons = []
    for m, config in sorted(tuned.items()):
        row = found.get(m, {})
        result = row.get("result") or {}
        ok = result.get("status") == "ok"
        error = None if ok else result.get("error") or f"no result (worker exit {proc.returncode}: {err[-300:]})"
        comparisons.append(
            Comparison(
                batch_size=m,
                default=row.get("default", {}),
                default_us=row.get("default_us"),
                tuned=config,
                tuned_us=result.get("us") if ok else None,
                rel_err=result.get("rel_err"),
                error=error,
            )
        )
    return comparisons
