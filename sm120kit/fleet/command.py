"""`sm120kit serve FLEET`: one fleet supervisor per profile (a lock in its run directory),
the fleet's preflight (the shared checks once; GPUs and ports for every replica; the
router's port), then the fleet in the foreground until a stop signal or giving up."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sm120kit.endpoint import probe_host
from sm120kit.exit_codes import ExitCode
from sm120kit.fleet.launch import FleetLaunch
from sm120kit.fleet.plan import ROUTER
from sm120kit.node.check import Check, Status
from sm120kit.serve import preflight
from sm120kit.serve.command import ServeOptions, lock_run, metrics_served
from sm120kit.serve.rundir import RunRecord

if TYPE_CHECKING:
    from sm120kit.fleet.machine import Member
    from sm120kit.fleet.plan import ReplicaPlan
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Target

SHARED_CHECKS = ("api key", "imports", "patches", "stale processes")  # once for the fleet
REPLICA_CHECKS = ("gpus", "ports")  # for each replica served here


def run_preflight(
    fleet: FleetLaunch,
    target: Target,
    options: ServeOptions,
    on_this_node: bool = True,
    off: Mapping[str, str] | None = None,
) -> preflight.Preflight:
    """The fleet's preflight; without on_this_node (a dry run, profile check) the checks of
    the profile and the serving environment alone, as preflight.run's."""
    from sm120kit.node import registry, snapshot

    node = snapshot.live(target, pairs=False)
    off = {**preflight.skipped(options), **(off or {})}
    profile = fleet.plan.profile
    here = fleet.plan.here if fleet.replicas else []
    checks = [Check("profile", Status.OK, _rendered(fleet))]
    # a router alone loads no patch, runs no sglang: its key and its own imports
    shared = [c for c in SHARED_CHECKS if here or c in ("api key", "imports")]
    shared = [c for c in shared if on_this_node or c in registry.ANYWHERE]
    first = here[0].served_profile if here else profile
    inputs = preflight.check_inputs(node, first, options, options.kill_stale and on_this_node, fleet.entry_points)
    checks += registry.run(tuple(shared), inputs, off)
    sglang = next(iter(fleet.replicas.values())).sglang if fleet.replicas else ""
    if not on_this_node:
        return preflight.Preflight(profile.name, sglang, checks, list(fleet.warnings), {**node.env, **profile.env})
    for r in here:
        for c in registry.run(REPLICA_CHECKS, preflight.check_inputs(node, r.served_profile, options), off):
            checks.append(dataclasses.replace(c, id=f"{c.id} ({r.name})"))
    if fleet.router is not None:
        checks.append(_router_port(fleet))
    if options.metrics_port is not None:
        from sm120kit.node.checks.serving import port_plan

        taken = {port: f"{r.name}'s {what}" for r in here for what, _, port in port_plan(r.served_profile)}
        taken |= {port: f"the router's {what}" for what, _, port in fleet.router_ports}
        checks.append(preflight.metrics_port(options.metrics_port, profile.server.host, taken))
    return preflight.Preflight(profile.name, sglang, checks, list(fleet.warnings), {**node.env, **profile.env})


def _rendered(fleet: FleetLaunch) -> str:
    parts = []
    if fleet.replicas:
        parts.append(f"{len(fleet.replicas)} replica(s) render for sglang {next(iter(fleet.replicas.values())).sglang}")
    if fleet.router is not None:
        parts.append(f"the router for sglang-router {fleet.router_version}")
    return "; ".join(parts)


def _router_port(fleet: FleetLaunch) -> Check:
    from sm120kit.serve import procs

    taken = [
        f"{port} ({what}) is held by {procs.port_holder(port)}"
        for what, host, port in fleet.router_ports
        if procs.port_in_use(host, port)
    ]
    if taken:
        return Check("ports (router)", Status.FAIL, "; ".join(taken), "stop what holds it, or give the router another")
    return Check(
        "ports (router)", Status.OK, ", ".join(f"{port} ({what})" for what, _, port in fleet.router_ports) + " free"
    )


def show_plan(fleet: FleetLaunch) -> None:
    print(f"preflight for fleet {fleet.plan.profile.name} ({fleet.mode.value}):", flush=True)


def serve_fleet(fleet: FleetLaunch, target: Target, options: ServeOptions, width: int | None) -> ExitCode:
    """As `serve` for one server: OK stopped on request and clean; FINDINGS gave up;
    ERROR refused; UNCLEAN something was left."""
    from sm120kit.fleet.supervisor import Fleet
    from sm120kit.serve import metrics

    profile = fleet.plan.profile
    record, lock = lock_run(profile.name)
    try:
        show_plan(fleet)
        checked = run_preflight(fleet, target, options)
        if preflight.refused(checked, record, width):
            return ExitCode.ERROR
        replicas = [_replica_member(fleet, r, record, options) for r in fleet.plan.here if r.name in fleet.replicas]
        router = _router_member(fleet, fleet.router, record) if fleet.router is not None else None
        _forget_former_members(record, {m.name for m in [*replicas, *([router] if router else [])]})
        started = {m.url for m in replicas}
        remote = [r.url for r in fleet.plan.replicas if r.url not in started] if router else []
        key = checked.env.get(profile.server.api_key_env) if profile.server.api_key_env else None
        members = [metrics.Member(m.name, m.role, m.dir) for m in [*replicas, *([router] if router else [])]]
        with metrics_served(options, profile, lambda: members):
            return Fleet(profile.name, replicas, router, remote, record, profile.health.stop_timeout_s, key).run()
    finally:
        lock.release()


def _forget_former_members(record: RunRecord, names: set[str]) -> None:
    """A member of an earlier run of this profile that this one does not have (fewer
    replicas now, or the router elsewhere): its state goes, so that `ps` and the metrics
    do not show it as stopped among the live ones; its logs stay."""
    from sm120kit.fleet.member import SPEC

    for spec in record.dir.glob(f"*/{SPEC}"):
        if spec.parent.name not in names:
            (spec.parent / "state.json").unlink(missing_ok=True)
            spec.unlink(missing_ok=True)


def _policy(profile: Profile) -> dict:
    from sm120kit.serve.machine import Policy

    return dataclasses.asdict(Policy.from_health(profile.health))


def _replica_member(fleet: FleetLaunch, r: ReplicaPlan, record: RunRecord, options: ServeOptions) -> Member:
    from sm120kit.fleet.member import argv_refs, write_spec
    from sm120kit.fleet.supervisor import Member
    from sm120kit.node.checks.serving import port_plan

    launch = fleet.replicas[r.name]
    directory = record.dir / r.name
    directory.mkdir(mode=0o700, exist_ok=True)
    profile = r.served_profile
    ports = port_plan(profile)
    write_spec(
        directory,
        name=profile.name,
        member=r.name,
        role="replica",
        argv=argv_refs(launch.argv),
        env=launch.env,
        host=probe_host(profile.server.host),
        port=r.port,
        ports=ports,
        policy=_policy(profile),
        api_key_env=profile.server.api_key_env,
        key_file=launch.config_flag,
        check_gpus=options.gpu_check,
        gpus=list(r.gpus),
        url=r.url,
        probe_path="/health_generate",
        smoke=_smoke(profile),
        patch_dirs=[os.path.abspath(d) for d in options.patch_dirs],  # their known failures name a death
    )
    return Member(r.name, "replica", directory, r.url, ports)


def _smoke(profile: Profile) -> dict | None:
    """health.smoke's options for a replica (its own URL), without the key: the member
    takes that from its environment."""
    if not profile.health.smoke:
        return None
    from sm120kit.quality.options import options_for

    return {k: v for k, v in dataclasses.asdict(options_for(profile, api_key=None)).items() if k != "api_key"}


def _router_refs(argv: list[str], key_env: str | None) -> list[str | dict[str, str]]:
    """The router's argv for member.json: its API key (the same as the replicas') as a
    reference that the member resolves from its environment."""
    return [*argv, "--api-key", {"env": key_env}] if key_env else list(argv)


def _router_member(fleet: FleetLaunch, router_argv: list[str], record: RunRecord) -> Member:
    from sm120kit.fleet.member import write_spec
    from sm120kit.fleet.router import LIVENESS_PATH
    from sm120kit.fleet.supervisor import Member

    layout, profile = fleet.plan, fleet.plan.profile
    directory = record.dir / ROUTER
    directory.mkdir(mode=0o700, exist_ok=True)
    ports = fleet.router_ports
    write_spec(
        directory,
        name=f"{profile.name}/{ROUTER}",
        member=ROUTER,
        role="router",
        argv=_router_refs(router_argv, profile.server.api_key_env),
        env={},
        host=probe_host(layout.router_host),
        port=layout.router_port,
        ports=ports,
        policy=_policy(profile),
        api_key_env=profile.server.api_key_env,
        key_file=False,
        check_gpus=False,
        gpus=[],
        url=layout.router_url,
        probe_path=LIVENESS_PATH,
        smoke=None,
        patch_dirs=[],
    )
    return Member(ROUTER, "router", directory, layout.router_url, ports)
