"""The results of timing candidate configs: one row a batch size (`BatchTiming`), the run's table
(`TimingResult`, what tune-moe installs and prints) and the state file that keeps the finished rows,
so that a run stopped by the budget, by Ctrl-C or by a crash resumes where it stopped.

Separate from the scheduling (timing.py) because the renderer and the command read these and
never start a worker; the state is keyed by everything that makes a timing comparable (shape,
candidates, sglang/Triton/torch versions, GPU model, timing settings).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from sm120kit.atomic_write import write_atomic

STATE_VERSION = 1


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
