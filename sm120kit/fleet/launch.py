"""A fleet profile rendered for what is installed: each replica's sglang command (the
one-server renderer, on the replica's profile) and the router's command (the installed
sglang-router's options). What `serve --dry-run` prints and what the fleet runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.fleet.plan import FleetPlan, plan
from sm120kit.profiles.render import EntryPoints, Launch, python_modules, render

if TYPE_CHECKING:
    from sm120kit.fleet.router import RouterSchema
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Target


class Mode(str, Enum):
    ALL = "all"  # the replicas of this node and the router
    ROUTER_ONLY = "router-only"  # a router here in front of replicas served elsewhere
    REPLICAS_ONLY = "replicas-only"  # this node's replicas, for a router on another node


@dataclass
class FleetLaunch:
    plan: FleetPlan
    mode: Mode
    replicas: dict[str, Launch]  # the replicas started here, by name
    router: list[str] | None  # the router's argv; None: no router here
    router_version: str | None = None
    router_ports: list[tuple[str, str, int]] = field(default_factory=list)  # (what, host, port): free before, after
    warnings: list[str] = field(default_factory=list)

    @property
    def entry_points(self) -> EntryPoints:
        """What the imports check reads: the replicas' (one interpreter) and the router's."""
        replica = [next(iter(self.replicas.values())).argv] if self.replicas else []
        return python_modules(replica + ([self.router] if self.router else []))

    def as_json(self) -> dict:
        return {
            "profile": self.plan.profile.name,
            "mode": self.mode.value,
            "replicas": [
                {
                    "name": r.name,
                    "url": r.url,
                    "here": r.name in self.replicas,
                    "gpus": list(r.gpus),
                    **(self.replicas[r.name].as_json() if r.name in self.replicas else {}),
                }
                for r in self.plan.replicas
            ],
            "router": None
            if self.router is None
            else {"url": self.plan.router_url, "argv": self.router, "sglang_router": self.router_version},
            "warnings": self.warnings,
        }

    def shell(self) -> str:
        """Every command of the fleet, each under a comment line that says what it is."""
        blocks = []
        for r in self.plan.replicas:
            if r.name in self.replicas:
                blocks.append(f"# {r.name}: GPU {r.visible_devices}, {r.url}\n{self.replicas[r.name].shell()}")
            else:
                blocks.append(f"# {r.name}: {r.url} (served elsewhere)")
        if self.router is not None:
            routed = ", ".join(r.name for r in self.plan.replicas)
            blocks.append(
                f"# router (sglang-router {self.router_version}): {self.plan.router_url} -> {routed}, "
                f"added as they become ready\n{Launch([*self.router], {}, '').shell()}"
            )
        return "\n\n".join(blocks)


def render_fleet(
    profile: Profile, target: Target, python: str, mode: Mode = Mode.ALL, router_optional: bool = False
) -> FleetLaunch:
    """The fleet's commands for the target's sglang and sglang-router; a UserError (exit 2,
    nothing started) for a layout or an option that cannot be. router_optional (`profile
    check`): without sglang-router in the target, the replicas alone, and a warning."""
    from sm120kit.fleet.router import SUPPORTED, read_router_schema, router_argv
    from sm120kit.profiles.flags import installed_schema

    layout = plan(profile, everything_elsewhere=mode is Mode.ROUTER_ONLY)
    replicas: dict[str, Launch] = {}
    warnings: list[str] = []
    if mode is not Mode.ROUTER_ONLY:
        if not layout.here:
            raise UserError(
                f"profile {profile.name}: no replica is served on this node (each names another node or a url)",
                f"run the router alone: sm120kit serve {profile.name} --router-only",
            )
        schema = installed_schema(target)
        for r in layout.here:
            replicas[r.name] = render(r.served_profile, schema, python)
        warnings += next(iter(replicas.values())).warnings
    router, version, router_ports = None, None, []
    if mode is not Mode.REPLICAS_ONLY:
        router_schema = read_router_schema(target)
        if router_schema is None and router_optional:
            warnings.append(
                f"sglang-router is not installed in {target.description}: the router's options were not checked "
                f"(`serve` needs it: pip install 'sglang-router{SUPPORTED}')"
            )
            return FleetLaunch(layout, mode, replicas, None, None, [], warnings)
        if router_schema is None:
            raise UserError(
                f"sglang-router is not installed in {target.description}: a fleet runs sglang's own router",
                f"pip install 'sglang-router{SUPPORTED}' in the serving environment (or --replicas-only on a node "
                "without the router)",
            )
        router = router_argv(
            python,
            router_schema,
            layout.router_options,
            host=layout.router_host,
            port=layout.router_port,
            worker_urls=[],
            source=profile.source,
        )
        version = router_schema.version
        router_ports = _router_ports(layout, router_schema)
    return FleetLaunch(layout, mode, replicas, router, version, router_ports, warnings)


ROUTER_PROMETHEUS_PORT = 29000  # the router's own --prometheus-port default (0.2.4-0.3.2): it always binds it


def _router_ports(layout: FleetPlan, schema: RouterSchema) -> list[tuple[str, str, int]]:
    """The router's ports: its HTTP port and its Prometheus exporter's, which it binds
    whether asked to or not (a second router on the node, or a replica there, would make
    it panic at start): both must be free, and no replica's."""
    from sm120kit.node.checks.serving import port_plan

    ports = [("server.port", layout.router_host, layout.router_port)]
    if "prometheus_port" in schema.options:
        exporter = layout.router_options.get("prometheus_port", ROUTER_PROMETHEUS_PORT)
        host = layout.router_options.get("prometheus_host", layout.router_host)
        ports.append(("fleet.router.prometheus_port", str(host), exporter))
    taken = {port: f"{r.name}'s {what}" for r in layout.here for what, _, port in port_plan(r.served_profile)}
    for what, _, port in ports[1:]:
        if port in taken or port == layout.router_port:
            profile = layout.profile
            raise UserError(
                f"profile {profile.name} ({profile.source}): port {port} is the router's {what} and "
                f"{taken.get(port, 'its server.port')}; nothing was started",
                "set fleet.router.prometheus_port to a port of its own",
            )
    return ports
