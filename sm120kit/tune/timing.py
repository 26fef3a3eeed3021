"""Timing candidate configs on this node's GPUs: the schedule. One worker process per GPU
(worker_client.py), the batch sizes handed out one at a time (largest first, each to the next free
GPU), the compile processes before them, a fresh worker after a crash, a budget, and Ctrl-C that
leaves no worker behind.

The pipes to the workers are worker_client.py's, the rows and the resumable state file are
timing_result.py's: this module decides only what runs where and when. A finished batch size is
written to the state file at once, so a run stopped by the budget, by Ctrl-C or by a crash
resumes where it stopped.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.tune.shape import MoeShape
from sm120kit.tune.timing_result import BatchTiming, Stop, TimingResult, load_state, save_state, state_key
from sm120kit.tune.worker_client import DEFAULT_SETTINGS, PROTOCOL, WORKER, Events, Worker, probe

MAX_RESTARTS = 3  # fresh workers for one batch size after crashes, before it is given up
ERROR_SAMPLES = 3

Progress = Callable[[int, int, str], None]  # (candidates timed, candidates in all, what is running)


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
        self.events: Events = queue.Queue()
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
