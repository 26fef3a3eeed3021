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
Compiles run in worker processes (fit_workers.py, run with -m); results are kept in a small
JSON cache (fit_cache.py) keyed by the kernel file's bytes, the Triton version and each
launch's compile key, so a second plan is instant. Where sm120kit's own environment has no
Triton, the whole fit runs in the target's interpreter, with its Triton
(`fit_configs(python=...)`: this module run with -m --fit).

The units and the pruning are fit_sweep.py's, the compiler processes fit_workers.py's, the
cache fit_cache.py's: this module builds each config's launches and runs the fit, here or in
the target's interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.tune import aot, kernels
from sm120kit.tune.fit_cache import FitCache, default_cache_dir
from sm120kit.tune.fit_sweep import FitResult, Sweep
from sm120kit.tune.fit_workers import CRASHED, compile_all, log_tail, pipes, shape_from_json
from sm120kit.tune.shape import MoeShape

# The token count the launches are built for. Tokens reach the kernels only as integer
# arguments (EM, num_valid_tokens: specialised on % 16 and == 1) and, from 0.5.19, as
# GDC_EARLY (tokens <= 512); none of these changes shared memory (checked by the tests).
FIT_TOKENS = 1024
CANONICAL_GROUP_SIZE_M = 1
TILE = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")  # what varies within a family


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
    cache = FitCache(cache_dir or default_cache_dir(), kernel_source)
    with tempfile.TemporaryDirectory(prefix="sm120kit-fit-") as scratch:
        module = kernels.load(kernel_source, Path(scratch), (arch // 10, arch % 10))
        sweep, per_config = Sweep(limit, prune), []
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
            compile_all(sweep, kernel_source, shape, arch, tokens, gemms, jobs, Path(scratch), progress)
        finally:
            cache.save({key: value for key, value in sweep.found.items() if value[1] != CRASHED})
    return [sweep.result(config, keys) for config, keys in zip(configs, per_config)]


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
        stdin, stdout = pipes(proc)
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
            + " | ".join(log_tail(log, 3).splitlines()),
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
            shape_from_json(request["shape"]),
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


if __name__ == "__main__" and sys.argv[1:] == ["--fit"]:
    _fit_here()
