"""`sm120kit doctor`: every check of the node in one report, each problem with its fix; every
check of serve's preflight among them, so that "this node can serve" is serve's verdict too
(those that read this machine's processes and ports are skipped for a copy of another node)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode
from sm120kit.node import registry
from sm120kit.node.check import Check, Status
from sm120kit.node.snapshot import Snapshot
from sm120kit.serve import procs, rundir

if TYPE_CHECKING:
    from sm120kit.node.inputs import NcclRequest
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Target


@dataclass(frozen=True)
class DoctorOptions:
    root: Path | None = None  # /proc and /sys copied from another node
    nvml_file: Path | None = None  # NVML answers recorded by `doctor --json`
    patch_dirs: tuple[str, ...] = ()
    allowed_failures: frozenset[str] = frozenset()  # --allow-known-failure
    capability: str | None = None  # --capability
    debug: bool = False  # a check that crashes raises, with its traceback
    nccl: NcclRequest | None = None  # --nccl (None: the check says SKIP)
    python: str | None = None  # the serving interpreter the imports check asks (None: --site names none)
    elsewhere: str | None = None  # the option that points doctor at another node's copy (--nvml, --root)


@dataclass(frozen=True)
class DoctorReport:
    profile: str | None
    checks: list[Check]
    node: Snapshot  # what the checks read; its NVML document is what --nvml replays

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.FINDINGS if self.count(Status.FAIL) else ExitCode.OK

    def count(self, status: Status) -> int:
        return sum(c.status is status for c in self.checks)

    @property
    def can_serve(self) -> bool:
        """Nothing failed, and there is a GPU to serve on."""
        return not self.count(Status.FAIL) and bool(self.node.gpus)

    def as_json(self) -> dict:
        return {
            "profile": self.profile,
            "checks": [c.as_json() for c in self.checks],
            "nvml": self.node.nvml_document,
            "exit_code": int(self.exit_code),
        }


def doctor(options: DoctorOptions, profile: Profile | None, target: Target) -> DoctorReport:
    """Doctor's checks of this node (or of options.root and options.nvml_file, recorded on
    another), the profile's needs judged when one is given. The report's exit_code is 0 when
    nothing failed (warnings allowed), 1 when something did."""
    from sm120kit.node import nvml, snapshot

    root = options.root
    if root and not root.is_dir():
        raise UserError(
            f"--root {root}: no such directory", "pass a directory that holds proc/ and sys/ copied from the node"
        )
    if root and not any((root / part).is_dir() for part in ("proc", "sys")):
        # An empty copy would read as a node without a GPU, an IOMMU or a hypervisor.
        raise UserError(
            f"--root {root}: holds neither proc/ nor sys/, so it is no copy of a node",
            "pass a directory that holds proc/ and sys/ copied from the node",
        )
    document = nvml.load(str(options.nvml_file)) if options.nvml_file else None
    node = snapshot.live(target, root=root, nvml_document=document)
    inputs = registry.CheckInputs(
        node,
        profile,
        patch_dirs=options.patch_dirs,
        patch_ids=tuple(profile.patches) if profile else None,
        allowed_failures=options.allowed_failures,
        capability=options.capability,
        debug=options.debug,
        nccl=options.nccl,
        processes=procs,
        runs=rundir.runs,
        entry_points=entry_points(profile, options.python),
        metrics_port=profile.server.metrics_port if profile else None,
    )
    return DoctorReport(
        profile.name if profile else None, registry.run(registry.DOCTOR, inputs, off(options, profile)), node
    )


def entry_points(profile: Profile | None, python: str | None) -> tuple[tuple[str, str], ...]:
    """What serve would start with `python -m`, for the imports check: sglang's server, and
    a fleet's router; nothing where there is no interpreter to ask (--site)."""
    if python is None:
        return ()
    from sm120kit.fleet import router
    from sm120kit.node.checks.imports import SERVER

    return ((python, SERVER),) + (((python, router.MODULE),) if profile and profile.fleet is not None else ())


def off(options: DoctorOptions, profile: Profile | None) -> dict[str, str]:
    """The checks of serve's preflight that doctor cannot run here, with why (said as SKIP):
    what --site gives no interpreter for; what reads this machine, not the copied node (the
    ports and the API key only where a profile names them)."""
    skipped = {} if options.python else {"imports": "--site names no interpreter to ask; give --python EXE"}
    if options.elsewhere:
        mine = ["stale processes"] + (["ports"] if profile else [])
        mine += ["api key"] if profile and profile.server.api_key_env else []
        skipped |= dict.fromkeys(mine, f"{options.elsewhere} describes another node: this machine's are not its")
    return skipped
