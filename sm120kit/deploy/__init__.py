"""Deployment artifacts rendered from a launch profile: a systemd unit (systemd.py), a
`docker run` line and a compose file (docker.py), Kubernetes manifests (k8s.py).

One renderer: systemd and docker run sm120kit's own supervisor, `sm120kit serve PROFILE`,
after `sm120kit patch --verify` for the profile's patches, so the sglang argv is the one
`serve --dry-run` prints, by construction. `Deployment` is that pair of commands with the
options that found and shaped the profile (its directories, --set, --python, the node
rank), so that the unit or the container loads the very profile that was rendered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sm120kit.profiles.model import Profile

# TimeoutStopSec / docker's stop timeout past health.stop_timeout_s: docs/serve.md
# (the drain, then the kill and the proof that nothing is left).
STOP_MARGIN_S = 45
# Starts of the supervisor that systemd (or docker) makes before it gives up too: each start
# is serve with its own crash-loop limit (health.max_restarts restarts of sglang) inside.
START_BURST = 3


@dataclass(frozen=True)
class Deployment:
    profile: Profile
    ref: str  # the profile as `serve` is told it: its name, or the absolute path of its file
    profile_dirs: tuple[str, ...] = ()  # absolute: --profile-dir and $SM120KIT_PROFILE_PATH at render time
    sets: tuple[str, ...] = ()  # --set KEY=VALUE, passed on as given
    python: str | None = None  # --python of the serving environment
    node_rank: int | None = None  # a multi-node profile: this node's rank
    patch_dirs: tuple[str, ...] = ()  # absolute: --patch-dir and $SM120KIT_PATCH_PATH at render time
    allowed: tuple[str, ...] = ()  # --allow-known-failure IDs the render was judged with: serve is told them too

    @property
    def name(self) -> str:
        """The unit's and the container's name: sm120kit-PROFILE[-rankN]."""
        rank = f"-rank{self.node_rank}" if self.node_rank is not None else ""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", f"sm120kit-{self.profile.name}{rank}")

    def patch_argv(self, exe: list[str], patch_dirs: tuple[str, ...] | None = None) -> list[str] | None:
        """`sm120kit patch --verify --only ID ...` for the profile's patches, the ones serve's
        preflight checks; None for a profile that needs none (nothing to apply or prove)."""
        if not self.profile.patches:
            return None
        words = [*exe, "patch", "--verify"]
        words += [w for d in (self.patch_dirs if patch_dirs is None else patch_dirs) for w in ("--patch-dir", d)]
        words += [w for p in self.profile.patches for w in ("--only", p)]
        return words + (["--python", self.python] if self.python else [])

    def serve_argv(
        self,
        exe: list[str],
        ref: str | None = None,
        profile_dirs: tuple[str, ...] | None = None,
        patch_dirs: tuple[str, ...] | None = None,
    ) -> list[str]:
        """`sm120kit serve PROFILE` with what found and shaped the profile; a container
        passes its own paths for the profile and the directories."""
        words = [*exe, "serve", self.ref if ref is None else ref]
        words += [
            w for d in (self.profile_dirs if profile_dirs is None else profile_dirs) for w in ("--profile-dir", d)
        ]
        words += [w for d in (self.patch_dirs if patch_dirs is None else patch_dirs) for w in ("--patch-dir", d)]
        words += [w for s in self.sets for w in ("--set", s)]
        words += ["--node-rank", str(self.node_rank)] if self.node_rank is not None else []
        words += [w for failure_id in self.allowed for w in ("--allow-known-failure", failure_id)]
        return words + (["--python", self.python] if self.python else [])


def deployment(
    name: str,
    profile_dirs: list[str] | None,
    sets: list[str] | None,
    python: str | None,
    node_rank: int | None,
    patch_dirs: list[str] | None,
    allowed: Sequence[str] = (),
) -> Deployment:
    """The profile NAME loaded as `serve` would load it, checked to be one a unit or a
    container can serve: a UserError (exit 2, nothing written) for one that cannot serve,
    a multi-node profile without --node-rank or without a rendezvous port, a patch id that
    no patch has. `allowed`: the known failures the unit's or container's serve starts
    despite (--allow-known-failure)."""
    from sm120kit.patching import registry
    from sm120kit.profiles import loader
    from sm120kit.profiles.render import require_servable

    profile = loader.load_profile(name, profile_dirs, sets)
    if node_rank is not None:  # said as --node-rank, not as the --set it becomes
        nodes = profile.parallel.nnodes
        if not node_rank < nodes:
            raise UserError(
                f"--node-rank {node_rank}: profile {profile.name} spans parallel.nnodes = {nodes} node(s)"
                + (f", ranks 0 .. {nodes - 1}" if nodes > 1 else ": --node-rank is for multi-node profiles"),
                f"render {'without --node-rank' if nodes == 1 else f'with --node-rank 0 .. {nodes - 1}'}",
            )
        profile = loader.load_profile(name, profile_dirs, [*(sets or []), f"parallel.node_rank={node_rank}"])
    require_servable(profile)
    if profile.fleet is not None:
        from sm120kit.fleet.plan import plan

        plan(profile)  # its layout's mistakes, as serve would find them
    require_rendezvous(profile)
    require_distinct_ports(profile)
    p = profile.parallel
    if p.nnodes > 1 and node_rank is None:
        raise UserError(
            f"profile {profile.name} spans parallel.nnodes = {p.nnodes} nodes: each node runs its own unit "
            "or container, with its rank",
            f"render one per node: --node-rank 0 .. --node-rank {p.nnodes - 1}",
        )
    registry.select(registry.load_patches(patch_dirs), profile.patches, f"profile {profile.name}'s patches")
    ref = str(Path(name).expanduser().resolve()) if name.endswith(".toml") or "/" in name else name
    user_profiles = loader.search_path(profile_dirs)[:-1]  # without the shipped set
    user_patches = registry.search_path(patch_dirs)[:-1]
    return Deployment(
        profile,
        ref,
        tuple(str(d.resolve()) for d in user_profiles),
        tuple(sets or ()),
        python,
        node_rank if p.nnodes > 1 else None,
        tuple(str(d.resolve()) for d in user_patches),
        tuple(dict.fromkeys(allowed)),
    )


def require_rendezvous(profile: Profile) -> None:
    """A multi-node profile names rank 0's host:port (parallel.dist_init_addr): every rank
    meets there; without the port no node can."""
    p = profile.parallel
    if p.nnodes == 1:
        return
    host, colon, port = (p.dist_init_addr or "").rpartition(":")
    if not (colon and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise UserError(
            f"profile {profile.name} ({profile.source}) spans parallel.nnodes = {p.nnodes} nodes but "
            f"parallel.dist_init_addr = {p.dist_init_addr!r} names no rendezvous port",
            'set parallel.dist_init_addr = "HOST:PORT" of rank 0, e.g. --set parallel.dist_init_addr=10.0.0.1:5000',
        )


def require_distinct_ports(profile: Profile) -> None:
    """The profile's ports each its own, as serve's preflight checks them (the server's and
    server.metrics_port): a clash fails every start, so a unit, a container or a pod of it
    is refused (a UserError, exit 2, nothing printed)."""
    from sm120kit.node.check import Status
    from sm120kit.node.checks.serving import distinct_ports

    found = distinct_ports(profile, profile.server.metrics_port)
    if found is not None and found.status is Status.FAIL:
        raise UserError(f"profile {profile.name} ({profile.source}): {found.detail}", found.fix)


def give_up_floor_s(profile: Profile) -> float:
    """The shortest time serve takes to give up: its backoffs before each of its
    health.max_restarts restarts, every run dying at once."""
    h = profile.health
    return sum(min(h.backoff_initial_s * 2**k, h.backoff_max_s) for k in range(h.max_restarts))


def stop_budget_s(profile: Profile) -> int:
    """How long a stop may take before it is cut short with SIGKILL: health.stop_timeout_s
    and the margin, once for one server, twice for a fleet (its router stops first, then its
    replicas, each group within that)."""
    groups = 2 if profile.fleet is not None else 1
    return groups * (math.ceil(profile.health.stop_timeout_s) + STOP_MARGIN_S)


def seconds(value: float) -> str:
    """A number of seconds as a unit or compose file spells it: 105, 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
