"""The compiler processes of a fit: `compile_all` hands the sweep's units to worker processes
(this module run with `python -m sm120kit.tune.fit_workers`), one unit at a time each, a dead
worker's unit tried once more in a fresh one; the worker's side (`serve_compiles`) compiles
each launch with Triton, LLVM's optimiser off, and answers its shared memory.

Separate from fit.py: this is the process protocol and its failures, which a fit run in the
target's interpreter (fit.py's `--fit`) uses as well. It imports nothing outside the standard
library, Triton (inside the worker) and sm120kit's modules that do the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from sm120kit.textcheck import printable
from sm120kit.tune import kernels
from sm120kit.tune.fit_sweep import Sweep
from sm120kit.tune.shape import MoeShape

CRASHED = "the Triton compiler's process died on this config"
MAX_DEATHS_IN_A_ROW = 4
MAX_JOBS = 32


def default_jobs() -> int:
    """One worker per CPU, at most MAX_JOBS (each holds Triton and LLVM: 0.2-0.5 GB)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_JOBS)


def compile_all(sweep: Sweep, source, shape, arch, tokens, gemms, jobs, scratch, progress) -> None:
    """Compile what the sweep hands out in worker processes (`python -m sm120kit.tune.fit_workers`,
    one unit at a time each). A unit whose worker dies is tried once more in a fresh
    worker, then recorded as CRASHED (and not cached)."""
    pending = len(sweep.units) - len(sweep.found)
    if not pending:
        return
    (scratch / "kernel.py").write_bytes(source)
    init = {"source": str(scratch / "kernel.py"), "shape": shape.to_json(), "arch": arch, "tokens": tokens}
    init["gemms"] = list(gemms)
    lock, stop = threading.Lock(), threading.Event()
    attempts: dict[str, int] = {}
    workers: list[CompileWorker] = []
    deaths: list[Path] = []  # logs of workers that died in a row

    def drive() -> None:
        worker = None
        while not stop.is_set():
            with lock:
                key = sweep.next_unit()
                if key is None:
                    break
                if worker is None:
                    worker = CompileWorker(init, scratch / f"worker-{len(workers)}.log")
                    workers.append(worker)
            value = worker.compile(*sweep.units[key])
            with lock:
                if value is None:  # it died: this key again in a fresh one, once
                    deaths.append(worker.log)
                    worker = None
                    attempts[key] = attempts.get(key, 0) + 1
                    if len(deaths) >= MAX_DEATHS_IN_A_ROW:  # not the config: the workers cannot run
                        stop.set()
                    if stop.is_set():
                        break
                    if attempts[key] < 2:
                        sweep.retry(key)
                        continue
                    value = (None, CRASHED)
                if value[1] != CRASHED:
                    deaths.clear()
                sweep.record(key, value)
                if progress:
                    progress(*sweep.progress())
        if worker is not None:
            worker.close()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(max(1, min(jobs or default_jobs(), pending)))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # wakes up for Ctrl-C
    finally:
        stop.set()
        with lock:
            for worker in workers:
                worker.kill()
        for thread in threads:
            thread.join()
    if len(deaths) >= MAX_DEATHS_IN_A_ROW:
        raise RuntimeError(f"the Triton compiler workers keep dying; the last one said:\n{log_tail(deaths[-1])}")
    if progress:
        progress(*sweep.progress())


def log_tail(log: Path, lines: int = 20) -> str:
    """A worker log's last lines, as a terminal may show them (they are quoted to a person)."""
    try:
        return "\n".join(printable(line) for line in log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class CompileWorker:
    """One compiler process: a JSON line in (config, launch index), a JSON line out
    ([shared, error]) on its own pipe (Triton prints ptxas failures to stdout)."""

    def __init__(self, init: dict, log: Path):
        self.log = log
        with log.open("w") as stderr:  # what Triton prints (ptxas failures), and a crash's traceback
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sm120kit.tune.fit_workers", str(log.parent)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.stdin, self.stdout = pipes(self.proc)
        self.send(init)

    def send(self, message: dict) -> bool:
        try:
            self.stdin.write(json.dumps(message) + "\n")
            self.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def compile(self, config: dict, index: int) -> tuple[int | None, str | None] | None:
        """(shared, error), or None when the process died on it."""
        if not self.send({"config": config, "index": index}):
            self.kill()
            return None
        line = self.stdout.readline()
        if not line:
            self.kill()
            return None
        shared, error = json.loads(line)
        return shared, error

    def close(self) -> None:
        try:
            self.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def pipes(proc: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
    """The stdin and stdout of a process started with both as PIPE (then never None)."""
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


def serve_compiles(scratch: Path) -> None:
    """The worker's loop. Protocol on the original stdout; fd 1 goes to stderr, so what
    Triton prints cannot corrupt it. Its own Triton cache under the scratch directory
    (thrown away with it, so ~/.triton is untouched)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    own = scratch / f"worker-{os.getpid()}"
    own.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(own / "triton")  # emptied after each compile: none repeats
    os.environ["TRITON_STORE_BINARY_ONLY"] = "1"
    # Shared memory is fixed in MLIR (ttg.shared), before LLVM runs: its O3 pass, up to 3/4
    # of a large tile's compile time, only shapes the code we never run. ptxas still runs.
    os.environ["DISABLE_LLVM_OPT"] = "1"
    init = json.loads(sys.stdin.readline())
    shape = shape_from_json(init["shape"])
    arch, tokens, gemms = init["arch"], init["tokens"], tuple(init["gemms"])
    module = kernels.load(Path(init["source"]).read_bytes(), own, (arch // 10, arch % 10))
    for line in sys.stdin:
        task = json.loads(line)
        launch = kernels.moe_launches(module, shape, task["config"], tokens, gemms)[task["index"]]
        try:
            answer = [launch.shared_bytes(arch), None]
        except Exception as exc:  # a config the compiler rejects (e.g. ptxas) does not fit
            answer = [None, _why(exc)]
        shutil.rmtree(own / "triton", ignore_errors=True)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def shape_from_json(fields: dict) -> MoeShape:
    return MoeShape(**{**fields, "block_shape": tuple(fields["block_shape"]) if fields["block_shape"] else None})


def _why(exc: Exception) -> str:
    """One line: Triton's errors end with the cause (CompilationError: after the source
    excerpt; PTXASError: ptxas's last words, before the repro command)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Repro command")]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


if __name__ == "__main__":
    serve_compiles(Path(sys.argv[1]))
