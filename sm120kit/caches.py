"""Where sm120kit keeps what it can compute again (patch outcomes, shared-memory figures,
tune-moe's progress, release wheels): one directory per kind, under $SM120KIT_CACHE_DIR
when it is set (tests and `sm120kit try` point it at a scratch directory), else under the
platform's user cache directory."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SM120KIT_CACHE_DIR"


def cache_dir(kind: str, *, env: str | None = CACHE_ENV) -> Path:
    """The directory of `kind` (not made here): $<env>/<kind> when that variable is set, else
    <user cache dir>/sm120kit/<kind>. env=None: always the user cache dir (the wheel cache,
    which a $SM120KIT_CACHE_DIR set for one scratch run must not empty)."""
    configured = os.environ.get(env) if env else None
    if configured:
        return Path(configured) / kind
    from platformdirs import user_cache_dir  # not at import: `sm120kit --help` stays fast

    return Path(user_cache_dir("sm120kit")) / kind
