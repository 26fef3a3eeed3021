"""Every check by id, the subset each command runs, and the runner. A check is a function
of CheckInputs that returns a Check (None: it does not apply, e.g. no API key to check)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status
from sm120kit.node.checks import gpus, imports, known_failures, nccl, patches, serving, software, system
from sm120kit.node.snapshot import Snapshot

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile


@dataclass(frozen=True)
class CheckInputs:
    """What the checks look at: the node, the profile (if any) and the command's choices."""

    node: Snapshot
    profile: Profile | None = None
    patch_dirs: tuple[str, ...] = ()
    patch_ids: tuple[str, ...] | None = None  # must be in place; None: survey every known patch
    allow_missing: frozenset[str] = frozenset()
    allowed_failures: frozenset[str] = frozenset()  # --allow-known-failure ids
    capability: str | None = None  # --capability: the node a launch is judged for
    kill_stale: bool = False
    # What the stale-process and ports checks read, supplied by the command that runs them
    # (serve), so that the node never imports serve: the process scan, stop and port probes
    # (sm120kit.serve.procs), and the run records (sm120kit.serve.rundir.runs).
    processes: object | None = None
    runs: Callable[[], list[dict]] | None = None
    debug: bool = False  # --debug: a check that crashes raises, with its traceback
    running: frozenset[str] = frozenset()  # the ids run together (set by run())
    nccl: nccl.Request | None = None  # doctor --nccl; None: not asked
    # (python, module) of each program serve starts as `python -m MODULE`: what the imports check reads
    entry_points: tuple[tuple[str, str], ...] = ()

    @property
    def server_env(self) -> dict[str, str]:
        """The server's environment: ours, with the profile's on top."""
        return {**self.node.env, **(self.profile.env if self.profile else {})}


CHECKS: dict[str, Callable[[CheckInputs], Check | None]] = {
    "driver": gpus.driver,
    "gpus": gpus.gpus,
    "persistence": gpus.persistence,
    "pcie": gpus.pcie,
    "gpu processes": gpus.gpu_processes,
    "p2p": gpus.peer_to_peer,
    "topology": gpus.topology,
    "nccl all-reduce": nccl.nccl_all_reduce,
    "iommu": system.iommu,
    "nvidia_uvm hmm": system.uvm_hmm,
    "virtualisation": system.virtualisation,
    "/dev/shm": system.shm,
    "limits": system.limits,
    "environment": software.environment,
    "software": software.software,
    "patches": patches.patches,
    "known failures": known_failures.known_failures,
    "jit cache": software.jit_cache,
    "nvcc": software.nvcc,
    "disk": software.disk,
    "api key": serving.api_key,
    "imports": imports.imports,
    "stale processes": serving.stale_processes,
    "ports": serving.ports,
}

DOCTOR = (
    "driver",
    "gpus",
    "persistence",
    "pcie",
    "gpu processes",
    "p2p",
    "topology",
    "nccl all-reduce",
    "iommu",
    "nvidia_uvm hmm",
    "virtualisation",
    "/dev/shm",
    "limits",
    "environment",
    "software",
    "patches",
    "known failures",
    "jit cache",
    "nvcc",
    "disk",
)
PREFLIGHT = ("api key", "imports", "patches", "stale processes", "gpus", "ports")  # serve's, in this order
BENCH = ("software", "patches")  # recorded with the results: versions and each patch's outcome


def run(ids: tuple[str, ...], inputs: CheckInputs, skipped: Mapping[str, str] | None = None) -> list[Check]:
    """The checks in order. skipped: id -> the option that turned it off (said as SKIP).
    A check's bug must not hide the others, nor pass for a good answer: it fails (serve
    must not start on it), or with inputs.debug is raised; bad input (a UserError) is raised."""
    inputs = dataclasses.replace(inputs, running=frozenset(ids) - set(skipped or ()))
    results = []
    for check_id in ids:
        if skipped and check_id in skipped:
            results.append(Check(check_id, Status.SKIP, f"not checked ({skipped[check_id]})"))
            continue
        try:
            found = CHECKS[check_id](inputs)
        except UserError:
            raise
        except Exception as exc:
            if inputs.debug:
                raise
            found = Check(
                check_id,
                Status.FAIL,
                f"the check itself failed: {type(exc).__name__}: {exc}",
                "report it (rerun with --debug)",
            )
        if found is not None:
            results.append(found)
    return results
