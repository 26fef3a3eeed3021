"""The fit's cache: the shared memory of each launch compiled before, keyed by the kernel file's
bytes, the Triton version and the launch's compile key, so that a second plan is instant.

Separate from fit.py: a file on disk read and merged, best effort, that no compile depends on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from sm120kit.caches import cache_dir
from sm120kit.tune import aot

CACHE_FORMAT = 1  # raise when what a cached figure means changes


def default_cache_dir() -> Path:
    return cache_dir("smem")


class FitCache:
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
