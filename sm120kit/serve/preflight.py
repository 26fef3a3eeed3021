"""Before a start: is this node ready for the profile? The profile's own line (it renders
for the installed sglang), then the node's preflight checks (sm120kit.node.registry:
API key, the server's imports, patches, stale processes, GPUs, ports). The caller refuses
to start while any check failed. Nothing here changes the node, except --kill-stale, which
stops the stale sglang processes it found (and says which)."""

from __future__ import annotations

import sys
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
    from sm120kit.serve.command import ServeOptions
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


def run(profile: Profile, launch: Launch, target: Target, options: ServeOptions) -> Preflight:
    node = snapshot.live(target, pairs=False)
    inputs = check_inputs(node, profile, options, options.kill_stale, launch.entry_points)
    warned = f" ({len(launch.warnings)} warning(s) above)" if launch.warnings else ""
    rendered = Check("profile", Status.OK, f"renders for sglang {launch.sglang}{warned}")
    checks = [rendered, *registry.run(registry.PREFLIGHT, inputs, skipped(options))]
    if options.metrics_port is not None:
        from sm120kit.node.checks.serving import port_plan

        taken = {port: what for what, _, port in port_plan(profile)}
        checks.append(metrics_port(options.metrics_port, profile.server.host, taken))
    return Preflight(profile.name, launch.sglang, checks, list(launch.warnings), inputs.server_env)


def require_imports(found: EntryPoints, env: dict[str, str], target: Target, wide: bool = False) -> None:
    """The imports check outside a start (`serve --dry-run`, `render systemd`) of what a launch
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
