"""A fleet profile -> the replicas it serves (their GPUs, ports, URLs, one-server profiles)
and the router in front of them. Pure: nothing here looks at the machine but its own
addresses (is a replica's node this one?). Every mistake a profile can make about the
layout is found here, before anything starts: a GPU in two replicas, a GPU the node does
not have, two servers on one port (sglang derives more ports from --port: the whole plan
of each is compared), a replica that is not the size the profile's parallel sizes say."""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sm120kit.endpoint import probe_host
from sm120kit.errors import UserError
from sm120kit.profiles.model import is_loopback
from sm120kit.profiles.render import gpus_used
from sm120kit.urls import http_url, parse_http_url

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile, Replica

ROUTER = "router"


@dataclass(frozen=True)
class ReplicaPlan:
    name: str  # "replica-0"
    url: str  # where the router reaches it
    gpus: tuple[int, ...]  # NVML indices; () for one served elsewhere
    port: int | None
    here: bool  # started by `serve` on this node
    profile: Profile | None  # the one-server profile of a replica served here

    @property
    def visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))

    @property
    def served_profile(self) -> Profile:
        """The one-server profile of a replica served here (a ValueError for one served elsewhere)."""
        if self.profile is None:
            raise ValueError(f"{self.name} ({self.url}) is not served here: it has no one-server profile")
        return self.profile


@dataclass(frozen=True)
class FleetPlan:
    profile: Profile
    replicas: list[ReplicaPlan]
    router_host: str  # where it binds
    router_port: int
    router_options: dict  # fleet.router without host and port

    @property
    def here(self) -> list[ReplicaPlan]:
        return [r for r in self.replicas if r.here]

    @property
    def router_url(self) -> str:
        return http_url(probe_host(self.router_host), self.router_port)


def _problem(profile: Profile, text: str, hint: str) -> UserError:
    return UserError(f"profile {profile.name} ({profile.source}): {text}; nothing was started", hint)


@functools.cache
def local_addresses() -> frozenset[str]:
    """This machine's names and addresses: a replica whose node is one of them is served here."""
    import psutil

    found = {"localhost", socket.gethostname(), socket.getfqdn()}
    for addrs in psutil.net_if_addrs().values():
        found |= {a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return frozenset(a.lower() for a in found)


def _gpu_list(text: str) -> tuple[int, ...]:
    return tuple(int(g) for g in text.replace(" ", "").split(","))


def plan(profile: Profile, *, everything_elsewhere: bool = False) -> FleetPlan:
    """The layout of a fleet profile. everything_elsewhere (`--router-only`): no replica is
    served here; the router reaches the local ones at their ports on this node."""
    from sm120kit.node.checks.serving import port_plan

    fleet, s = profile.fleet, profile.server
    if fleet is None:
        raise ValueError(f"profile {profile.name} has no [fleet] table: it is one server, not a fleet")
    if profile.parallel.nnodes > 1:
        raise _problem(
            profile,
            f"parallel.nnodes = {profile.parallel.nnodes}: a fleet's replicas are one-node servers",
            "serve a multi-node server with its own profile on each node and put it in the fleet as "
            '[[fleet.replica]] url = "http://NODE0:PORT"',
        )
    options = dict(fleet.router)  # its host and port are server.host and server.port (the profile moved them)
    router_host, router_port = s.host, s.port
    per_replica, counted = gpus_used(profile)
    size = fleet.gpus_per_replica or per_replica
    if size != per_replica:
        raise _problem(
            profile,
            f"fleet.gpus_per_replica = {size}, but each replica's server uses {counted} = {per_replica}",
            "make the parallel sizes describe one replica, or drop fleet.gpus_per_replica",
        )
    entries: list[Replica | None] = [*fleet.replica] or [None] * (fleet.replicas or 0)  # one of them is given
    explicit = {g for e in entries if e is not None and e.gpus for g in _gpu_list(e.gpus)}
    spare = (g for g in range(10**6) if g not in explicit)
    replicas: list[ReplicaPlan] = []
    owner: dict[int, str] = {}  # GPU -> the replica served here that uses it
    for k, entry in enumerate(entries):
        name = f"replica-{k}"
        if entry is not None and entry.url:
            replicas.append(ReplicaPlan(name, parse_http_url(entry.url).text, (), None, False, None))
            continue
        port = entry.port if entry is not None and entry.port else router_port + 1 + k
        if port > 65535:
            raise _problem(
                profile, f"{name} would take port {port}", "set server.port lower, or ports in [[fleet.replica]]"
            )
        given = entry.gpus if entry is not None else None  # only given GPUs can be too many or twice one
        gpus = _gpu_list(given) if given else tuple(next(spare) for _ in range(size))
        if len(gpus) != size:
            raise _problem(
                profile,
                f'{name}: fleet.replica[{k}].gpus = "{given}" is {len(gpus)} GPU(s), but a replica uses {size}',
                f"give each [[fleet.replica]] {size} GPU(s)",
            )
        node = entry.node if entry is not None else None
        here = not everything_elsewhere and (node is None or node.lower() in local_addresses())
        if node is None or node.lower() in local_addresses():
            if len(set(gpus)) != len(gpus):
                raise _problem(
                    profile,
                    f'{name}: fleet.replica[{k}].gpus = "{given}" names a GPU twice',
                    "give each replica GPUs of its own ([[fleet.replica]] gpus = ...)",
                )
            for g in gpus:
                if g in owner:
                    raise _problem(
                        profile,
                        f"GPU {g} is in {owner[g]} and in {name}",
                        "give each replica GPUs of its own ([[fleet.replica]] gpus = ...)",
                    )
                owner[g] = name
            url = http_url(probe_host(fleet.replica_host), port)
        else:
            url = http_url(node, port)
        replicas.append(
            ReplicaPlan(
                name,
                url,
                gpus,
                port,
                here,
                _replica_profile(profile, name, gpus, port, fleet.replica_host) if here else None,
            )
        )
    if owner and max(owner) >= profile.node.gpus:
        g = max(owner)
        raise _problem(
            profile,
            f"{owner[g]} uses GPU {g}, but node.gpus = {profile.node.gpus} (GPUs 0-{profile.node.gpus - 1})",
            "use fewer replicas or GPUs, or set node.gpus to what the node has (`nvidia-smi -L` lists them)",
        )
    if any(e is not None and e.node for e in entries) and is_loopback(fleet.replica_host):
        raise _problem(
            profile,
            f"replicas on other nodes, but fleet.replica_host = {fleet.replica_host!r}: a router on another node "
            "could not reach them",
            'bind them where the router reaches them: fleet.replica_host = "0.0.0.0" (with server.api_key_env)',
        )
    result = FleetPlan(profile, replicas, router_host, router_port, options)
    taken = {router_port: "the router's (server.port)"}
    for r in result.here:
        for what, _host, port in port_plan(r.served_profile):
            if port in taken:
                raise _problem(
                    profile,
                    f"port {port} is {taken[port]} and {r.name}'s {what}",
                    "give every replica and the router ports of their own ([[fleet.replica]] port = ...; sglang "
                    "also takes --port + 233 .. + 238 with dp-attention)",
                )
            taken[port] = f"{r.name}'s {what}"
    return result


def _replica_profile(profile: Profile, name: str, gpus: tuple[int, ...], port: int, host: str) -> Profile:
    """The one-server profile of a replica: the fleet profile on its GPUs and port, bound to
    `host` (fleet.replica_host), without the fleet."""
    env = {**profile.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return profile.model_copy(
        update={
            "fleet": None,
            "name": f"{profile.name}/{name}",
            "env": env,
            "node": profile.node.model_copy(update={"gpus": len(gpus)}),
            "server": profile.server.model_copy(update={"host": host, "port": port, "metrics_port": None}),
        }
    )
