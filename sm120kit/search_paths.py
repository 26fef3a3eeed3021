"""Where patches and profiles come from: the user's directories first (a command-line
option, then an environment variable), then the set shipped in the wheel. Nothing else."""

from __future__ import annotations

import os
from pathlib import Path

from sm120kit import path_limits
from sm120kit.errors import UserError

SINGULAR = {"patches": "patch", "profiles": "profile"}


def shipped(kind: str) -> Path:
    """Inside the wheel: sm120kit/_shipped/<kind>. In a source checkout: ./<kind>."""
    here = Path(__file__).resolve().parent
    packaged = here / "_shipped" / kind
    return packaged if packaged.is_dir() else here.parent / kind


def search_path(kind: str, option: str, env_var: str, dirs: list[str] | None, last: Path) -> list[Path]:
    """The user's directories (checked to exist), then `last` (the shipped set)."""
    given = [(option, d) for d in dirs or []]
    given += [(f"${env_var}", d) for d in os.environ.get(env_var, "").split(os.pathsep) if d]
    for where, d in given:
        path_limits.check(where, d)
    user = [Path(d).expanduser() for _, d in given]
    for directory in user:
        if not directory.is_dir():
            raise UserError(f"{SINGULAR[kind]} directory {directory} does not exist", f"check {option} and ${env_var}")
    return [*user, last]
