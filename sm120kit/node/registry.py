"""Every check by id, the subset each command runs, and the runner. A check is a function
of CheckInputs that returns a Check (None: it does not apply, e.g. no API key to check)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status
from sm120kit.node.checks import gpus, imports, known_failures, nccl, patches, serving, software, system
from sm120kit.node.inputs import CheckInputs

if TYPE_CHECKING:
    pass


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
    "port plan": serving.port_clash,
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
    # serve's preflight, every check of it (those it shares are above): one verdict on a start
    "api key",
    "imports",
    "port plan",
    "stale processes",
    "ports",
)
# What a launch must pass, in the order serve runs them (serve, serve --check). Those of the
# profile and the serving environment alone (ANYWHERE) are run by every command that judges
# a launch: serve --dry-run, profile check, bench's plan, doctor; the rest read this node
# (its environment, processes, GPUs, ports) and run where the command is about this node.
PREFLIGHT = ("api key", "imports", "patches", "port plan", "stale processes", "gpus", "ports")
ANYWHERE = ("imports", "patches", "port plan")
THIS_NODE = tuple(c for c in PREFLIGHT if c not in ANYWHERE)
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
