"""What `sm120kit tune-moe` is asked to do (`TuneOptions`), and the command line's words for it
read into typed values (batch sizes, budget, GPUs).

Separate from the command (command.py) so that the cli builds the options without importing
what plans and times a tune.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sm120kit.errors import UserError

# sglang's tuning script's default batch sizes (benchmark/kernels/fused_moe_triton).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
MAX_BATCH_SIZE = 1 << 20


@dataclass(frozen=True)
class TuneOptions:
    plan_only: bool = False
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    budget_s: float | None = None
    gpus: tuple[int, ...] | None = None  # None: every visible GPU
    device_name: str | None = None  # GPU 0's (the cli reads it); None: no GPU here
    config_dir: Path | None = None  # $SGLANG_MOE_CONFIG_DIR instead of the package's directory
    model_config: Path | None = None  # None: from the profile's [model] path
    jobs: int | None = None
    restart: bool = False
    python: str | None = None  # the target's interpreter (--python); None: this one
    show_progress: bool = True


def parse_batch_sizes(text: str | None) -> tuple[int, ...]:
    if text is None:
        return DEFAULT_BATCH_SIZES
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or not all(1 <= m <= MAX_BATCH_SIZE for m in sizes):
        raise UserError(
            f"--batch-sizes {text!r}: expected whole numbers from 1 to {MAX_BATCH_SIZE}, comma-separated",
            "e.g. --batch-sizes 1,64,256,1024",
        )
    return tuple(sizes)


def parse_budget(text: str | None) -> float | None:
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*", text)
    seconds = float(match[1]) * {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[match[2]] if match else 0
    if not seconds:
        raise UserError(f"--budget {text!r}: expected a time such as 90s, 20m or 2h", "e.g. --budget 20m")
    return seconds


def parse_gpus(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        gpus = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        gpus = ()
    if not gpus or min(gpus) < 0:
        raise UserError(f"--gpus {text!r}: expected GPU indices, comma-separated", "e.g. --gpus 0,1,2,3")
    return gpus
