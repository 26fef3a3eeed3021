"""Where a starting sglang server is, read from its log: the milestones sglang logs while
it loads (0.5.9-0.5.23: model_runner, weight_utils' tqdm bar, the memory pool, CUDA graph
capture, uvicorn, the ready line)."""

from __future__ import annotations

import re

READY_LINE = "The server is fired up and ready to roll!"

# (pattern, phase); later milestones come later in the list. tqdm writes its updates to a
# file joined by carriage returns, so callers split on "\r" as well as "\n".
PHASES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(pattern), phase)
    for pattern, phase in (
        (r"Init torch distributed begin", "initialising torch.distributed"),
        (r"Load weight begin", "loading weights"),
        (
            r"Loading safetensors checkpoint shards:\s*(?P<pct>\d+)% Completed \| (?P<n>\d+)/(?P<total>\d+)",
            "loading weights {pct}% ({n}/{total} shards)",
        ),
        (r"Load weight end", "weights loaded"),
        (r"Memory pool end|KV Cache is allocated", "KV cache allocated"),
        (r"Capture .*(?:cuda|CUDA) graph begin|Capturing batches", "capturing CUDA graphs"),
        (r"Uvicorn running on", "HTTP server up, warming up"),
        (re.escape(READY_LINE), "warmup done"),
    )
)


def phase_of(line: str) -> str | None:
    """The milestone a log line marks, or None."""
    for pattern, phase in PHASES:
        if match := pattern.search(line):
            return phase.format(**match.groupdict())
    return None


class LineSplitter:
    """Feeds chunks of a growing log; yields complete lines (split on \\n and \\r)."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, chunk: str) -> list[str]:
        text = self._rest + chunk
        parts = re.split(r"\r\n|\r|\n", text)
        self._rest = parts.pop()
        return parts
