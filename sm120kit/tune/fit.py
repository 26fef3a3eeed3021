"""Which fused-MoE configs fit a GPU's shared memory: each candidate's launches (the up and
the down GEMM, as the release's launcher makes them) compiled for the target with Triton on
the CPU, and `metadata.shared` compared with the opt-in limit, as Triton does at launch.

Three things keep a full space affordable, each checked on the real kernels
(tests/test_tune_fit.py; for the monotone rule, the whole space of the Kimi-K2 TP8 shape
in 0.5.23, bf16, block fp8 and int4 GPTQ):
- GROUP_SIZE_M only reorders program ids (scalar arithmetic at the top of both kernels), so
  configs that differ in it alone share one compile.
- A launch's shared memory never decreases when BLOCK_SIZE_M, _N, _K or num_stages grows
  and every other compile input (warps, even_Ks, ...) stays, so a config that contains a
  smaller one already over the limit is ruled out without compiling it (prune=False
  compiles everything).
- The workers run Triton with LLVM's optimiser off: shared memory is fixed in MLIR before
  LLVM runs, and O3 on a large tile is most of its compile time.
Compiles run in worker processes (this module, run with -m); results are kept in a small
JSON cache keyed by the kernel file's bytes, the Triton version and each launch's compile
key, so a second plan is instant. Where sm120kit's own environment has no Triton, the whole
fit runs in the target's interpreter, with its Triton (`fit_configs(python=...)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from sm120kit.caches import cache_dir
from sm120kit.errors import UserError
from sm120kit.tune import aot, kernels
from sm120kit.tune.shape import MoeShape

# The token count the launches are built for. Tokens reach the kernels only as integer
# arguments (EM, num_valid_tokens: specialised on % 16 and == 1) and, from 0.5.19, as
# GDC_EARLY (tokens <= 512); none of these changes shared memory (checked by the tests).
FIT_TOKENS = 1024
CANONICAL_GROUP_SIZE_M = 1
TILE = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")  # what varies within a family
CRASHED = "the Triton compiler's process died on this config"
MAX_DEATHS_IN_A_ROW = 4
MAX_JOBS = 32
CACHE_FORMAT = 1  # raise when what a cached figure means changes


@dataclass(frozen=True)
class FitResult:
    config: dict
    shared: int | None  # bytes of shared memory, the largest of the launches' (None: not all compiled)
    fits: bool  # every launch compiled and needs at most the limit
    error: str | None = None  # why a launch did not compile (a ptxas or compiler failure)
    launches: tuple[int | None, ...] = field(default=())  # bytes per launch (of `gemms`); None: not compiled
    at_least: int | None = None  # ruled out uncompiled: a smaller config's launch already needs this many bytes

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "shared": self.shared,
            "fits": self.fits,
            "error": self.error,
            "launches": list(self.launches),
            "at_least": self.at_least,
        }


def default_cache_dir() -> Path:
    return cache_dir("smem")


def default_jobs() -> int:
    """One worker per CPU, at most MAX_JOBS (each holds Triton and LLVM: 0.2-0.5 GB)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_JOBS)


def fit_configs(
    kernel_source: bytes,
    shape: MoeShape,
    configs: Sequence[dict],
    *,
    limit: int = aot.SM120_SMEM_OPTIN,
    arch: int = 120,
    tokens: int = FIT_TOKENS,
    gemms: tuple[str, ...] = kernels.GEMMS,
    prune: bool = True,
    jobs: int | None = None,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    python: Path | None = None,
) -> list[FitResult]:
    """One FitResult per config, in order: the shared memory its launches need on `arch`
    (compiled from `kernel_source`, the release's fused_moe_triton_kernels.py) and whether
    that fits `limit`. `gemms`: the launches a config drives (("w2",) for a `_down.json`
    table). progress(done, total) counts distinct compiles, those cached or ruled out
    included. Ctrl-C keeps what finished in the cache. `python`: compile with that
    interpreter's Triton (the target's) instead of this one's."""
    if python is not None:
        request = {"limit": limit, "arch": arch, "tokens": tokens, "gemms": list(gemms), "prune": prune, "jobs": jobs}
        request["cache_dir"] = str(cache_dir or default_cache_dir())
        return _fit_elsewhere(python, kernel_source, shape, configs, request, progress)
    cache = _Cache(cache_dir or default_cache_dir(), kernel_source)
    with tempfile.TemporaryDirectory(prefix="sm120kit-fit-") as scratch:
        module = kernels.load(kernel_source, Path(scratch), (arch // 10, arch % 10))
        sweep, per_config = _Sweep(limit, prune), []
        for config in configs:
            canonical = {**config, "GROUP_SIZE_M": CANONICAL_GROUP_SIZE_M}
            launches = kernels.moe_launches(module, shape, canonical, tokens, gemms)
            keys = [launch.compile_keys(arch, TILE) for launch in launches]
            per_config.append([key for key, _ in keys])
            sweep.add(canonical, keys)
        for key in list(sweep.units):
            if (cached := cache.get(key)) is not None:
                sweep.record(key, cached)
        sweep.rule_out_known()
        if progress:
            progress(*sweep.progress())
        try:
            _compile_all(sweep, kernel_source, shape, arch, tokens, gemms, jobs, Path(scratch), progress)
        finally:
            cache.save({key: value for key, value in sweep.found.items() if value[1] != CRASHED})
    return [sweep.result(config, keys) for config, keys in zip(configs, per_config)]


def _point(config: dict) -> tuple[int, int, int, int]:
    return config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["num_stages"]


class _Sweep:
    """The distinct compiles (units: one launch of one config, GROUP_SIZE_M canonical), what
    each gave, and the order they are handed out in: smallest tiles first, so that with
    `prune` the configs that contain one already over the limit are ruled out uncompiled.
    Only launches of one family are compared: the same compile inputs but for the tiles and
    the stages (e.g. even_Ks = K % BLOCK_SIZE_K == 0 splits families: with a ragged last K
    step, the GPTQ/AWQ kernel does not pipeline B, and needs less)."""

    def __init__(self, limit: int, prune: bool):
        self.limit, self.prune = limit, prune
        self.units: dict[str, tuple[dict, int]] = {}  # key -> (canonical config, launch index)
        self.family: dict[str, str] = {}  # key -> its family
        self.siblings: dict[str, list[str]] = {}  # key -> the keys of its config's launches
        self.found: dict[str, tuple[int | None, str | None]] = {}  # key -> (shared, error)
        self.ruled_out: set[str] = set()
        self.over: dict[str, list[tuple[tuple[int, int, int, int], int]]] = {}  # family -> [(point, bytes)]
        self.order: list[str] | None = None

    def add(self, config: dict, keys: list[tuple[str, str]]) -> None:
        siblings = [key for key, _ in keys]
        for index, (key, family) in enumerate(keys):
            if key not in self.units:
                self.units[key], self.family[key], self.siblings[key] = (config, index), family, siblings

    def record(self, key: str, value: tuple[int | None, str | None]) -> None:
        self.found[key] = value
        shared = value[0]
        if shared is not None and shared > self.limit:
            self.over.setdefault(self.family[key], []).append((_point(self.units[key][0]), shared))

    def bound(self, keys: list[str]) -> int | None:
        """With prune: the most bytes that a launch of the same family with smaller or equal
        tiles and stages needs, when that is over the limit (by monotonicity, the config of
        these launches needs as many), else None."""
        if not self.prune:
            return None
        sizes = [
            size
            for key in keys
            for point in [_point(self.units[key][0])]
            for smaller, size in self.over.get(self.family[key], ())
            if all(x <= y for x, y in zip(smaller, point))
        ]
        return max(sizes, default=None)

    def next_unit(self) -> str | None:
        """The next key to compile, or None; ruled-out keys are skipped (and counted)."""
        if self.order is None:
            self.order = sorted((k for k in self.units if k not in self.found), key=self._staged, reverse=True)
        while self.order:
            key = self.order.pop()
            if key in self.found:
                continue
            if self.bound(self.siblings[key]) is not None:
                self.ruled_out.add(key)
                continue
            return key
        return None

    def _staged(self, key: str) -> tuple[int, str]:
        """What a unit's tiles stage per block, as a proxy: only the order depends on it."""
        m, n, k, stages = _point(self.units[key][0])
        return (stages - 1) * (m + n) * k, key

    def retry(self, key: str) -> None:
        assert self.order is not None  # key was handed out by next_unit, which made the order
        self.order.append(key)

    def rule_out_known(self) -> None:
        """Mark what the results so far (e.g. cached ones) already rule out."""
        pending = (key for key in self.units if key not in self.found)
        self.ruled_out |= {key for key in pending if self.bound(self.siblings[key]) is not None}

    def progress(self) -> tuple[int, int]:
        return len(self.found) + len(self.ruled_out), len(self.units)

    def result(self, config: dict, keys: list[str]) -> FitResult:
        found = [self.found.get(key) for key in keys]
        sizes = tuple(value[0] if value else None for value in found)
        error = next((value[1] for value in found if value and value[1]), None)
        compiled = [size for size in sizes if size is not None]
        if len(compiled) == len(sizes):
            shared = max(compiled)
            return FitResult(dict(config), shared, error is None and shared <= self.limit, error, sizes)
        return FitResult(dict(config), None, False, error, sizes, None if error else self.bound(keys))


def _compile_all(sweep: _Sweep, source, shape, arch, tokens, gemms, jobs, scratch, progress) -> None:
    """Compile what the sweep hands out in worker processes (`python -m sm120kit.tune.fit`,
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
    workers: list[_Worker] = []
    deaths: list[Path] = []  # logs of workers that died in a row

    def drive() -> None:
        worker = None
        while not stop.is_set():
            with lock:
                key = sweep.next_unit()
                if key is None:
                    break
                if worker is None:
                    worker = _Worker(init, scratch / f"worker-{len(workers)}.log")
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
        raise RuntimeError(f"the Triton compiler workers keep dying; the last one said:\n{_tail(deaths[-1])}")
    if progress:
        progress(*sweep.progress())


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Worker:
    """One compiler process: a JSON line in (config, launch index), a JSON line out
    ([shared, error]) on its own pipe (Triton prints ptxas failures to stdout)."""

    def __init__(self, init: dict, log: Path):
        self.log = log
        with log.open("w") as stderr:  # what Triton prints (ptxas failures), and a crash's traceback
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sm120kit.tune.fit", str(log.parent)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.stdin, self.stdout = _pipes(self.proc)
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


def _pipes(proc: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
    """The stdin and stdout of a process started with both as PIPE (then never None)."""
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


def _serve(scratch: Path) -> None:
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
    shape = _shape(init["shape"])
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


def _shape(fields: dict) -> MoeShape:
    return MoeShape(**{**fields, "block_shape": tuple(fields["block_shape"]) if fields["block_shape"] else None})


def _fit_elsewhere(
    python: Path, source: bytes, shape: MoeShape, configs: Sequence[dict], request: dict, progress
) -> list[FitResult]:
    """fit_configs run by another interpreter, with its Triton (`python -m sm120kit.tune.fit
    --fit`, the request on stdin, progress and the results as JSON lines). That interpreter
    needs no sm120kit: this package alone is put on its path (not this environment's
    site-packages, whose Triton it would find first), and the compile modules import nothing
    outside the standard library and Triton."""
    with tempfile.TemporaryDirectory(prefix="sm120kit-fit-") as scratch_name:
        scratch = Path(scratch_name)
        path = scratch / "path"
        path.mkdir()
        (path / "sm120kit").symlink_to(Path(__file__).resolve().parent.parent, target_is_directory=True)
        (scratch / "kernel.py").write_bytes(source)
        request = {**request, "source": str(scratch / "kernel.py"), "shape": shape.to_json(), "configs": list(configs)}
        request["progress"] = progress is not None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
        log = scratch / "fit.log"
        try:
            with log.open("w") as stderr:
                proc = subprocess.Popen(
                    [str(python), "-m", "sm120kit.tune.fit", "--fit"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=env,
                    cwd=scratch,  # -m puts the working directory first on the path
                )
        except OSError as exc:
            raise UserError(f"{python}: cannot run it to compile with its Triton: {exc}", _ELSEWHERE_HINT) from None
        answer: dict = {}
        stdin, stdout = _pipes(proc)
        try:
            with contextlib.suppress(BrokenPipeError):
                stdin.write(json.dumps(request))
                stdin.close()
            for line in stdout:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and "progress" in event and progress:
                        progress(*event["progress"])
                    elif isinstance(event, dict):
                        answer = event
            proc.wait()
        finally:
            if proc.poll() is None:  # Ctrl-C: it got the signal too, and keeps what it compiled
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if "results" in answer:
            return [FitResult(**{**r, "launches": tuple(r["launches"])}) for r in answer["results"]]
        if "error" in answer:
            raise UserError(answer["error"], answer.get("hint"))
        raise UserError(
            f"{python} could not compile sglang's kernel with its Triton (exit {proc.returncode}): "
            + " | ".join(_tail(log, 3).splitlines()),
            _ELSEWHERE_HINT,
        )


_ELSEWHERE_HINT = "pip install 'sm120kit[tune]' to compile with a Triton of sm120kit's own environment"


def _fit_here() -> None:
    """`--fit`: fit_configs for the parent in `_fit_elsewhere`. Answers on the original
    stdout; fd 1 goes to stderr, so what Triton prints cannot corrupt them."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.loads(sys.stdin.read())

    def progress(done: int, total: int) -> None:
        answers.write(json.dumps({"progress": [done, total]}) + "\n")
        answers.flush()

    try:
        results = fit_configs(
            Path(request["source"]).read_bytes(),
            _shape(request["shape"]),
            request["configs"],
            limit=request["limit"],
            arch=request["arch"],
            tokens=request["tokens"],
            gemms=tuple(request["gemms"]),
            prune=request["prune"],
            jobs=request["jobs"],
            cache_dir=Path(request["cache_dir"]),
            progress=progress if request["progress"] else None,
        )
    except UserError as exc:
        answers.write(json.dumps({"error": exc.message, "hint": exc.hint}) + "\n")
        sys.exit(2)
    except (ImportError, RuntimeError) as exc:  # its Triton does not import, or its workers keep dying
        answers.write(
            json.dumps({"error": f"{sys.executable}: {type(exc).__name__}: {exc}", "hint": _ELSEWHERE_HINT}) + "\n"
        )
        sys.exit(1)
    answers.write(json.dumps({"results": [r.to_json() for r in results]}) + "\n")
    answers.flush()


def _why(exc: Exception) -> str:
    """One line: Triton's errors end with the cause (CompilationError: after the source
    excerpt; PTXASError: ptxas's last words, before the repro command)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Repro command")]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


class _Cache:
    """{compile key: [shared, error]} for one kernel file and one Triton, in one JSON file.
    Best effort: an unreadable or unwritable cache only costs time."""

    def __init__(self, root: Path, source: bytes):
        digest = hashlib.sha256(source).hexdigest()[:24]
        self.path = Path(root) / f"v{CACHE_FORMAT}-{digest}-triton-{aot.triton_version()}.json"
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        if not isinstance(self.entries, dict):
            self.entries = {}

    def get(self, key: str) -> tuple[int | None, str | None] | None:
        value = self.entries.get(key)
        if isinstance(value, list) and len(value) == 2:
            return value[0], value[1]
        return None

    def save(self, found: dict) -> None:
        new = {key: list(value) for key, value in found.items() if self.entries.get(key) != list(value)}
        if not new:
            return
        try:  # merge with what another run may have written meanwhile
            current = json.loads(self.path.read_text())
            current = current if isinstance(current, dict) else {}
        except (OSError, ValueError):
            current = {}
        current.update(self.entries)
        current.update(new)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(current, sort_keys=True))
            os.replace(tmp, self.path)
            self.entries = current
        except OSError:
            pass


if __name__ == "__main__":
    if sys.argv[1:] == ["--fit"]:
        _fit_here()
    else:
        _serve(Path(sys.argv[1]))
