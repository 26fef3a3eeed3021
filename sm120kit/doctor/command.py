"""`sm120kit doctor`: every check of the node in one report, each problem with its fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode
from sm120kit.node import registry
from sm120kit.node.check import Check, Status
from sm120kit.node.snapshot import Snapshot

if TYPE_CHECKING:
    from sm120kit.node.checks.nccl import Request
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
    nccl: Request | None = None  # --nccl (None: the check says SKIP)


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
    )
    return DoctorReport(profile.name if profile else None, registry.run(registry.DOCTOR, inputs), node)
