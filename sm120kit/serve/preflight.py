"""Before a start: is this node ready for the profile? The profile's own line (it renders
for the installed sglang), then the preflight checks (sm120kit.node.registry.PREFLIGHT:
API key, the server's imports, patches, the profile's ports each its own, stale processes,
GPUs, ports free). The caller refuses to start while any check failed. The commands that
judge a launch without starting it (serve --dry-run, profile check, bench's plan) run the
same list, less the checks of this node (on_this_node=False), so that their verdict is the
start's. Nothing here changes the node, except --kill-stale, which stops the stale sglang
processes it found (and says which)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sm120kit import report
from sm120kit.exit_codes import ExitCode
from sm120kit.node import registry, render, snapshot
from sm120kit.node.check import Check, Status
from sm120kit.serve import procs, rundir
from sm120kit.serve.status import EventKind

if TYPE_CHECKING:
    from sm120kit.node.snapshot import Snapshot
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import EntryPoints, Launch
    from sm120kit.serve.options import ServeOptions
    from sm120kit.serve.rundir import RunRecord
    from sm120kit.target import Target


@dataclass(frozen=True)
class Preflight:
    profile: str
    sglang: str  # the release the profile was rendered for
    checks: list[Check]
    warnings: list[str]  # the renderer's, about the profile
    env: dict[str, str]  # the server's environment

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.FINDINGS if self.failed else ExitCode.OK

    def verdict_json(self) -> dict:
        """The checks and the exit code, for a document of its own (a dry run's, profile check's)."""
        return {"checks": [c.as_json() for c in self.checks], "exit_code": int(self.exit_code)}

    def as_json(self) -> dict:
        return {
            "profile": self.profile,
            "sglang": self.sglang,
            "checks": [c.as_json() for c in self.checks],
            "warnings": self.warnings,
            "exit_code": int(self.exit_code),
        }


def check_inputs(
    node: Snapshot,
    profile: Profile,
    options: ServeOptions,
    kill_stale: bool = False,
    entry_points: EntryPoints = (),
) -> registry.CheckInputs:
    """What serve's checks look at, for one server's profile (a fleet: each replica's);
    entry_points: the (python, module) of what it starts (the launch's `entry_points`)."""
    return registry.CheckInputs(
        node,
        profile,
        patch_dirs=options.patch_dirs,
        patch_ids=tuple(profile.patches),
        allow_missing=options.allow_missing,
        kill_stale=kill_stale,
        processes=procs,
        runs=rundir.runs,
        debug=options.debug,
        entry_points=entry_points,
    )


def skipped(options: ServeOptions) -> dict[str, str]:
    """The checks the options turn off, with the option that did."""
    off = {"patches": "--no-patch-check"} if not options.patch_check else {}
    return off | ({"gpus": "--no-gpu-check"} if not options.gpu_check else {})


def run(
    profile: Profile,
    launch: Launch,
    target: Target,
    options: ServeOptions,
    on_this_node: bool = True,
    off: Mapping[str, str] | None = None,
) -> Preflight:
    """serve's checks of one server's start. on_this_node: the command is about this node (serve,
    serve --check): every check; else (a dry run, profile check, bench's plan) those of the
    profile and the serving environment alone (registry.ANYWHERE). off: checks that cannot
    run, besides those the options turn off: id -> why (said as SKIP)."""
    node = snapshot.live(target, pairs=False)
    inputs = check_inputs(node, profile, options, options.kill_stale and on_this_node, launch.entry_points)
    told = "server.metrics_port" if options.metrics_port == profile.server.metrics_port else "--metrics-port"
    inputs = dataclasses.replace(inputs, metrics_port=options.metrics_port, metrics_from=told)
    warned = f" ({len(launch.warnings)} warning(s) above)" if launch.warnings else ""
    rendered = Check("profile", Status.OK, f"renders for sglang {launch.sglang}{warned}")
    ids = registry.PREFLIGHT if on_this_node else registry.ANYWHERE
    checks = [rendered, *registry.run(ids, inputs, {**skipped(options), **(off or {})})]
    return Preflight(profile.name, launch.sglang, checks, list(launch.warnings), inputs.server_env)


def would_refuse(checked: Preflight, width: int | None, wide: bool = False) -> None:
    """A dry run's word on stderr (serve --dry-run, profile check) on the checks it ran: a
    warning for each that warns, and for those that failed, that the start would be
    refused, each with its fix."""
    warned = [c for c in checked.checks if c.status is Status.WARN]
    report.print_warnings([f"{c.id}: {c.detail}" + (f" (next: {c.fix})" if c.fix else "") for c in warned], wide)
    if checked.failed:
        print(
            f"sm120kit: serve would refuse to start {checked.profile}: "
            f"{len(checked.failed)} preflight check(s) failed:",
            *render.listing(checked.failed, width),
            sep="\n",
            file=sys.stderr,
        )


def require_imports(found: EntryPoints, env: dict[str, str], target: Target, wide: bool = False) -> None:
    """The imports check outside a start (`render systemd`, in the unit's interpreter) of what a launch
    starts (its `entry_points`, one server's or a fleet's): a UserError (exit 2) naming what
    the server imports and its interpreter lacks; a warning where it could not tell."""
    from sm120kit.errors import UserError
    from sm120kit.node.checks.imports import judge

    checked = judge(found, env, target) if found else None
    if checked is not None and checked.status is Status.FAIL:
        raise UserError(checked.detail, checked.fix)
    if checked is not None and checked.status is Status.WARN:
        report.print_warnings([f"{checked.detail} (next: {checked.fix})"], wide)


def metrics_port(port: int, host: str, taken: dict[int, str]) -> Check:
    """--metrics-port: not a port of the server's own plan (the supervisor binds it first:
    the server would fail on it), and free."""
    if port in taken:
        return Check(
            "ports (metrics)",
            Status.FAIL,
            f"--metrics-port {port} is the server's too ({taken[port]})",
            "give the metrics a port of their own: --metrics-port N (or server.metrics_port)",
        )
    if procs.port_in_use(host, port):
        return Check(
            "ports (metrics)",
            Status.FAIL,
            f"--metrics-port {port} is held by {procs.port_holder(port)}",
            "stop what holds it, or give the metrics another port",
        )
    return Check("ports (metrics)", Status.OK, f"{port} is free")


def header(profile: str, launch: Launch) -> None:
    """The renderer's warnings on stderr, then the line the checks go under: before they
    run (the patch plan, NVML and --kill-stale can take seconds)."""
    report.print_warnings(launch.warnings)
    print(f"preflight for {profile} (sglang {launch.sglang}):", flush=True)


def show(preflight: Preflight, width: int | None) -> None:
    """Each check (under the header), and the fix of each that is not ok."""
    print("\n".join(render.listing(preflight.checks, width)), flush=True)


def refused(checked: Preflight, record: RunRecord, width: int | None) -> bool:
    """Show the checks and record them; True (said on stderr) when one failed: nothing starts."""
    show(checked, width)
    record.event(EventKind.PREFLIGHT, ok=not checked.failed, checks=[c.as_json() for c in checked.checks])
    if checked.failed:
        print(
            f"sm120kit: refusing to start {checked.profile}: {len(checked.failed)} preflight check(s) failed "
            "(see above)",
            file=sys.stderr,
        )
    return bool(checked.failed)
