"""A path the system cannot look up at all: a name in it longer than its filesystem allows
(NAME_MAX: 255 bytes on ext4, xfs, btrfs, tmpfs) or the whole longer than PATH_MAX (4096
bytes on Linux). Every use of such a path fails with ENAMETOOLONG; an option that gives one
is refused naming the option, as any other bad value is."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from sm120kit.errors import UserError

HINT = "give a shorter path (a symbolic link to the directory, or a path relative to the current one)"


def problem(value: str) -> str | None:
    """Why `value` is no path this system can look up, or None."""
    raw = os.fsencode(value)
    path_max = _limit("/", "PC_PATH_MAX", 4096)
    if len(raw) >= path_max:
        return f"the path is {len(raw)} bytes long; the system takes at most {path_max - 1}"
    name_max = _limit(_nearest_existing(value), "PC_NAME_MAX", 255)
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > name_max:
        shown = os.fsdecode(longest[:24]) + "..."
        return f"the name {shown} in it is {len(longest)} bytes long; its filesystem takes at most {name_max}"
    return None


def check(option: str, value: str) -> None:
    """Refuse `value` of `option` (a UserError naming both) if it is no path the system can look up."""
    if why := problem(value):
        raise UserError(f"{option} {_shown(value)}: {why}", HINT)


def refusal(exc: OSError, given: list[tuple[str, object]]) -> UserError | None:
    """An ENAMETOOLONG from anywhere as the refusal of the option whose value led to it (the
    option whose path the failing one starts with; "" for a positional), or None for any
    other error. `given`: (option, value) of each option the command took."""
    if exc.errno != errno.ENAMETOOLONG:
        return None
    failed = os.fsdecode(exc.filename) if exc.filename is not None else ""
    why = problem(failed) if failed else None
    for option, value in given:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and v and failed.startswith(os.path.expanduser(v)):
                where = f"{option} {_shown(v)}" if option else _shown(v)
                return UserError(f"{where}: {why or 'the path is longer than the system allows'}", HINT)
    return UserError(f"{_shown(failed) or 'a path'}: {why or 'the path is longer than the system allows'}", HINT)


def _nearest_existing(value: str) -> str:
    path = Path(os.path.expanduser(value)).absolute()
    return next((str(p) for p in (path, *path.parents) if os.path.exists(p)), "/")


def _limit(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _shown(value: str) -> str:
    """A path too long to be read in a message: its start and its end."""
    return value if len(value) <= 120 else f"{value[:60]}...{value[-40:]}"
