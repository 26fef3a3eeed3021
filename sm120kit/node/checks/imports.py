"""Does the serving environment have every package the server imports? What
`python -m sglang.launch_server` (and a fleet's router, sglang_router.launch_router)
imports is read by sm120kit/node/imports_probe.py in the server's own interpreter and
environment: once, in a process of its own, bounded in time, importing nothing (sglang's
imports load torch). A package it lacks fails the check: the server would die at that
import on every start, and no restart mends it.

serve's preflight runs it (CheckInputs.entry_points: what a launch says it starts, its
`entry_points`), and so do doctor, `serve --dry-run`, `profile check` and bench's plan
(sm120kit.serve.preflight); `render systemd` through judge()."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit import child_process
from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs
    from sm120kit.target import Target

ID = "imports"
TIMEOUT_S = 60.0  # the probe reads ~1,100 files of sglang 0.5.23 in under a second
PROBE = Path(__file__).resolve().parent.parent / "imports_probe.py"
# What a module starts by default besides its own imports: sglang's launch_server imports
# its HTTP server inside run_server (0.5.9-0.5.23), where a walk of module-level imports
# does not look. Followed where it exists.
SERVER = "sglang.launch_server"  # what `python -m` starts for one server (doctor's entry point, profile or not)
ALSO = {"sglang.launch_server": ("sglang.srt.entrypoints.http_server",)}
WHAT = {"sglang.launch_server": "sglang's server", "sglang_router.launch_router": "sglang's router"}
DISTRIBUTION = {"sglang": "sglang", "sglang_router": "sglang-router"}  # a top-level package -> its distribution
SHOWN = 4  # missing packages named in the detail; the rest are counted


def imports(inputs: CheckInputs) -> Check | None:
    """serve's preflight check; None where nothing is started with `python -m`."""
    if not inputs.entry_points:
        return None
    target = inputs.node.target
    found = inputs.entry_points
    if target is not None and target.find("sglang") is None:  # no server to probe: the software check says so
        found = tuple((python, module) for python, module in found if module != SERVER)
    return judge(found, inputs.server_env, target) if found else None


def judge(
    entry_points: Iterable[tuple[str, str]],
    env: dict[str, str],
    target: Target | None = None,
    timeout_s: float | None = None,
) -> Check:
    """One probe per interpreter; the worst verdict, with what each said."""
    by_python: dict[str, list[str]] = {}
    for python, module in entry_points:
        by_python.setdefault(python, []).append(module)
    found = [_judge_one(python, modules, env, target, timeout_s or TIMEOUT_S) for python, modules in by_python.items()]
    for status in (Status.FAIL, Status.WARN, Status.OK):
        said = [c for c in found if c.status is status]
        if said:
            data = {k: v for c in said for k, v in c.data.items()}
            return Check(
                ID, status, "; ".join(c.detail for c in said), "; ".join(dict.fromkeys(c.fix for c in said)), data
            )
    return Check(ID, Status.INFO, "nothing to read")


def _judge_one(python: str, modules: list[str], env: dict[str, str], target: Target | None, timeout_s: float) -> Check:
    what = " and ".join(WHAT.get(m, m) for m in modules)
    roots = [r for m in modules for r in (m, *(f"?{also}" for also in ALSO.get(m, ())))]
    said = probe(python, roots, env, timeout_s)
    if isinstance(said, str):
        return Check(
            ID,
            Status.WARN,
            f"could not tell whether {python} has what {what} imports: {said}",
            f"see for yourself: {python} -c 'import {modules[0]}'",
        )
    if said["absent"]:
        names = ", ".join(repr(m) for m in said["absent"])
        dist = _distribution(said["absent"][0], target)
        return Check(
            ID,
            Status.FAIL,
            f"{python}: no module named {names}: {dist or 'its package'} is installed without it (a damaged install)",
            f"reinstall it: {python} -m pip install --force-reinstall --no-deps {dist or 'PACKAGE==VERSION'}",
        )
    if said["missing"]:
        missing = list(said["missing"].items())
        named = ", ".join(f"{top!r} (imported by {where})" for top, where in missing[:SHOWN])
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        owners = dict.fromkeys(_distribution(where.split("/")[0], target) for _, where in missing)
        installs = " ".join(f"'{d}'" for d in owners if d)
        return Check(
            ID,
            Status.FAIL,
            f"{what} would not start: {python} has no module named {named}{more}: the environment is incomplete",
            f"install what is missing into it: {python} -m pip install {installs or 'PACKAGE'} installs the "
            f"requirements it lacks (`{python} -m pip check` lists them)",
            {"missing": said["missing"]},
        )
    if said["unread"]:
        return Check(
            ID,
            Status.WARN,
            f"{what}: {len(said['unread'])} file(s) that {python} cannot read: {said['unread'][0]}",
            f"reinstall the package: {python} -m pip install --force-reinstall --no-deps PACKAGE==VERSION",
        )
    files = f"{said['files']} file{'s' * (said['files'] != 1)}"
    return Check(ID, Status.OK, f"{python} has every package {what} imports (read from {files})")


def _distribution(module: str, target: Target | None) -> str | None:
    """'sglang==0.5.23' for a module of sglang (the version where the target knows it)."""
    name = DISTRIBUTION.get(module.split(".")[0])
    dist = target.find(name) if target is not None and name else None
    return f"{name}=={dist.version}" if dist else name


def probe(python: str, roots: list[str], env: dict[str, str], timeout_s: float = TIMEOUT_S) -> dict | str:
    """The probe's answer, run as `python -c PROBE ROOT...` in a session of its own (what
    it starts is stopped with it); a string saying why there is none."""
    try:
        done = child_process.run([python, "-c", PROBE.read_text(), *roots], env=env, deadline_s=timeout_s)
    except OSError as exc:
        return f"cannot run it ({exc.strerror or exc})"
    if done.hung:
        return f"no answer within {timeout_s:g} s (stopped)"
    if done.returncode:
        last = (done.stderr_tail() or ["no message"])[-1]
        return f"its python exited {done.returncode} ({last[:200]})"
    try:
        said = child_process.loads_line(done.last_line())
    except ValueError:
        said = None
    keys = {"files": int, "absent": list, "missing": dict, "found": list, "unread": list}
    if not isinstance(said, dict) or not all(isinstance(said.get(k), t) for k, t in keys.items()):
        return "it did not answer as a Python interpreter would"
    return said
