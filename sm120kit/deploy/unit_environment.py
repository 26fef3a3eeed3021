"""`render systemd`: the checks `serve --dry-run` runs, against the interpreter the unit's
`sm120kit serve` will run (--python; else the python of the sm120kit the unit runs), so
that a unit whose serve would refuse at its start (exit 2, which the unit never retries)
is refused here. Where that interpreter is not on this machine, or is not the serving
environment (no sglang, and --python not given), the checks are not run and a warning says
so plainly.

The launch is judged as `profile check` judges it; that judgement is the cli's (it reads the
command's options), so the cli hands it down (`judge`), and the warnings to print (`warn`)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sm120kit.deploy import Deployment
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.profiles.render import Launch
    from sm120kit.target import Target

# The launch of the profile rendered and judged for the serving environment (its python, its
# target): a UserError where `serve` there would refuse it.
Judge = Callable[[str, "Target"], "Launch | FleetLaunch"]


def check_unit_environment(
    d: Deployment, exe: tuple[str, ...], exe_given: bool, judge: Judge, warn: Callable[[list[str]], None]
) -> None:
    """A UserError (exit 2, nothing printed) where `serve` of the unit would refuse: no
    sglang (or sglang-router, for a fleet) in the environment d.python names, a profile
    that does not render for its release, a known failure, a package the server imports
    missing there. Warnings through `warn`: the renderer's, and what could not be checked.
    exe: how the unit runs sm120kit; exe_given: it was --sm120kit's."""
    from sm120kit.serve.preflight import require_imports
    from sm120kit.target import resolve_target

    python, not_here = unit_python(d.python, exe, exe_given)
    if python is None:
        warn([f"the serving environment was not checked: {not_here}"])
        return
    target = resolve_target(python)
    if d.python is None and target.find("sglang") is None:
        warn(
            [
                f"the serving environment was not checked: {python}, the python of the sm120kit the unit runs, "
                f"has no sglang, and `sm120kit serve` there would refuse to start (next: name the serving "
                f"environment: --python ENV/bin/python)"
            ]
        )
        return
    launch = judge(python, target)  # no sglang (sglang-router), flags, known failures
    warn(launch.warnings)
    require_imports(launch.entry_points, {**os.environ, **d.profile.env}, target)


def unit_python(python: str | None, exe: tuple[str, ...], given_exe: bool) -> tuple[str | None, str]:
    """(the interpreter the unit's serve runs, or None and why it is not known here)."""
    if python is not None:
        if not _here(python):
            return None, f"--python {python} is not on this machine"
        return python, ""
    if not given_exe:
        return sys.executable, ""  # the unit runs this sm120kit: this interpreter's
    if exe[1:2] == ("-m",):
        return (exe[0], "") if _here(exe[0]) else (None, f"{exe[0]} is not on this machine")
    if not os.path.isfile(exe[0]):
        return None, f"--sm120kit {exe[0]} is not on this machine"
    try:
        with open(exe[0], "rb") as fh:
            first = fh.readline(512).decode("utf-8", "replace")
    except OSError as exc:
        return None, f"--sm120kit {exe[0]}: cannot read it ({exc.strerror or exc})"
    words = first[2:].split() if first.startswith("#!") else []
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    if not words or not _here(words[0]):
        return None, f"--sm120kit {exe[0]} names no python of this machine (give --python)"
    return words[0], ""


def _here(python: str) -> bool:
    if os.sep in python or python.startswith("~"):
        return os.path.exists(os.path.expanduser(python))
    return shutil.which(python) is not None
