"""sglang's default config against the tuned one, each batch size timed in one worker on one GPU,
replay about replay (worker.py's interleave mode), so that drift falls on both alike.

Separate from timing.py: it is one job sent to one worker and read back whole, after the tune
(scripts/tune_moe_gpu_proof.py proves a table with it), with no schedule, state or budget.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from sm120kit import child_process
from sm120kit.errors import UserError
from sm120kit.tune.shape import MoeShape
from sm120kit.tune.worker_client import DEFAULT_SETTINGS, PROTOCOL, WORKER, visible_device


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
    argv = [str(python), str(worker)]
    done = child_process.run(argv, env=env, input=json.dumps(job) + "\n", deadline_s=timeout_s)  # Ctrl-C ends it too
    if done.hung:
        raise subprocess.TimeoutExpired(argv, timeout_s or 0.0)
    found: dict[int, dict] = {}
    for event in done.objects():
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
        error = (
            None if ok else result.get("error") or f"no result (worker exit {done.returncode}: {done.stderr[-300:]})"
        )
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
