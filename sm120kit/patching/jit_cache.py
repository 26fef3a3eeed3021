"""JIT caches built from a package's sources. Changing flashinfer's JIT sources is useless
while its cache still holds kernels built from the old ones, so a run that changes (or
restores) such files removes that version's cache, and `status` warns about a cache that
is older than the patch.

flashinfer (0.6.x-0.7.x, flashinfer/jit/env.py) builds into
$FLASHINFER_WORKSPACE_BASE (default: the home directory) / .cache/flashinfer/<version>/<archs>/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sm120kit.target import Distribution


def _flashinfer(dist: Distribution) -> list[Path]:
    root = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer"
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.is_dir() and (p.name == dist.version or p.name.startswith(dist.version + "+"))
    )


_CACHES = {"flashinfer-python": _flashinfer}
# Packages of prebuilt kernels that are loaded instead of JIT builds from the sources.
_PREBUILT = {"flashinfer-python": "flashinfer-jit-cache"}


def prebuilt_package(dist: Distribution) -> str | None:
    return _PREBUILT.get(dist.name)


def cache_dirs(dist: Distribution) -> list[Path]:
    """The JIT cache directories built from this installed version's sources."""
    finder = _CACHES.get(dist.name)
    return finder(dist) if finder else []


def remove(dist: Distribution) -> list[Path]:
    removed = []
    for path in cache_dirs(dist):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def built_before(dist: Distribution, when: float) -> list[Path]:
    """Cache directories holding anything built before `when` (a POSIX time)."""
    return [d for d in cache_dirs(dist) if any(f.is_file() and f.stat().st_mtime < when for f in d.rglob("*"))]
