"""Where patches and profiles come from: the user's directories first (a command-line
option, then an environment variable), then the set shipped in the wheel. Nothing else.

A user's directory that cannot be searched is refused here, naming it and why, for every
command alike: passed over, it would drop the user's patches (or profiles, or survey)
without a word, and `patch --check` would be green without ever reading them."""

from __future__ import annotations

import os
import shlex
import stat
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
    """The user's directories (each checked to be one this process can search), then
    `last` (the shipped set)."""
    given = [(option, d) for d in dirs or []]
    given += [(f"${env_var}", d) for d in os.environ.get(env_var, "").split(os.pathsep) if d]
    user = []
    for where, d in given:
        path_limits.check(where, d)
        directory = Path(d).expanduser()
        if found := unsearchable(directory, where):
            why, hint = found
            raise UserError(f"{SINGULAR[kind]} directory {directory} {why}", hint)
        user.append(directory)
    return [*user, last]


def unsearchable(directory: Path, where: str = "") -> tuple[str, str] | None:
    """Why `directory` cannot be searched, and the next step; None when it can. `where`:
    the option or variable that gave it ("" for a directory found inside one)."""
    shown = _q(directory)
    try:
        mode = directory.stat().st_mode
    except FileNotFoundError:
        return "does not exist", f"create it (mkdir -p {shown}) or correct {where}"
    except OSError as exc:  # a parent this user cannot search, a loop of links
        return f"cannot be reached ({exc.strerror or exc})", f"see which part stops it: namei -l {shown}"
    if not stat.S_ISDIR(mode):
        return "is not a directory", f"point {where} at a directory"
    # Listed (r) and its files opened (x): without either, the search would find nothing.
    if not os.access(directory, os.R_OK | os.X_OK):
        return (
            "cannot be read (Permission denied: it needs read and search permission)",
            f"let this user read it (as its owner: chmod a+rx {shown})"
            + (f", or leave it out of {where}" if where else ""),
        )
    return None


def files_named(directories: list[Path], name: str, noun: str) -> list[Path]:
    """`name` in each directory that has one, in order. An entry of that name that is not a
    file is refused: passed over, what the user put there would be ignored without a word."""
    found = []
    for directory in directories:
        path = directory / name
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            why = exc.strerror or exc
            raise UserError(f"{noun} {path} cannot be read ({why})", f"see why: ls -l {_q(path)}") from None
        if not stat.S_ISREG(mode):
            raise UserError(
                f"{noun} {path} is not a file (the {name} of a user directory is read as one)",
                f"rename it out of the way: mv {_q(path)} {_q(path.with_name(path.name + '.moved'))}",
            )
        found.append(path)
    return found


def _q(path: Path) -> str:
    return shlex.quote(str(path))
