"""Outcome cache, as Black caches formatted files: a transform's verdict on a file is a
pure function of the file's bytes, the patch's source and the sm120kit version, so it is
kept under that key and a repeated `status` / `patch --check` skips parsing the file.

Best effort: an unwritable cache only costs speed. $SM120KIT_CACHE_DIR overrides the
user cache directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from sm120kit import __version__
from sm120kit.caches import cache_dir


def _root() -> Path:
    return cache_dir("outcomes")


def key(*parts: str) -> str:
    return hashlib.sha256("\0".join((__version__, *parts)).encode()).hexdigest()


def get(name: str) -> dict | None:
    try:
        return json.loads((_root() / name[:2] / name).read_text())
    except (OSError, ValueError):
        return None


def put(name: str, value: dict) -> None:
    path = _root() / name[:2] / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
