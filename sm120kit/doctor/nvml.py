"""What NVML says about the node, as one plain JSON-able document: the seam between the
driver and everything that asks about the GPUs — doctor's checks, and serve's preflight
and stop proof (through sm120kit.serve.gpus), so that both give one verdict. `read()`
asks the real NVML (nvidia-ml-py, a dependency); tests and `sm120kit doctor --nvml FILE`
replay a recorded document instead."""

from __future__ import annotations

import json
from pathlib import Path

from sm120kit.serve.gpus import MIB, NvmlUnavailable, text, with_nvml

# nvmlGpuTopologyLevel_t, nearest first (nvml.h)
TOPOLOGY = {
    0: "internal",
    10: "single-switch",
    20: "multiple-switches",
    30: "host-bridge",
    40: "numa-node",
    50: "across-sockets",
}


def read(pairs: bool = True) -> dict:
    """The live node. {"error": ...} when nvidia-ml-py, the driver or a GPU fails: that is
    the answer. Without pairs, no P2P or topology matrix (serve's checks need neither)."""
    try:
        return with_nvml(lambda nv: _read(nv, pairs))
    except NvmlUnavailable as exc:
        return {"error": str(exc)}


def _try(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # an NVML call a GPU or driver does not support: unknown, not fatal
        return default


def _processes(nv, handle) -> dict[str, int]:
    """pid -> MiB used, compute and graphics contexts alike."""
    found = {}
    for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
        for p in _try(getter, handle, default=[]):
            found[str(p.pid)] = (p.usedGpuMemory or 0) // MIB  # None: not reported (e.g. in a container)
    return found


def _read(nv, pairs: bool = True) -> dict:
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    gpus = []
    for i, h in enumerate(handles):
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
        memory = nv.nvmlDeviceGetMemoryInfo(h)
        processes = _processes(nv, h)
        persistence = _try(nv.nvmlDeviceGetPersistenceMode, h)
        gpus.append(
            {
                "index": i,
                "name": text(nv.nvmlDeviceGetName(h)),
                "uuid": text(nv.nvmlDeviceGetUUID(h)),
                "pci_bus_id": text(nv.nvmlDeviceGetPciInfo(h).busId),
                "compute_capability": f"{major}.{minor}",
                "memory_total_mib": memory.total // MIB,
                "memory_used_mib": memory.used // MIB,
                "memory_free_mib": memory.free // MIB,
                "persistence_mode": None if persistence is None else persistence == 1,
                "pcie": {
                    "gen": _try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                    "max_gen": _try(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    "width": _try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                    "max_width": _try(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                },
                "processes": processes,
            }
        )
    p2p, topology = [], []
    for a in handles if pairs else []:
        p2p.append(
            [
                None
                if a is b
                else {
                    "read": _p2p(nv, a, b, "NVML_P2P_CAPS_INDEX_READ"),
                    "write": _p2p(nv, a, b, "NVML_P2P_CAPS_INDEX_WRITE"),
                }
                for b in handles
            ]
        )
        topology.append(
            [
                None if a is b else TOPOLOGY.get(_try(nv.nvmlDeviceGetTopologyCommonAncestor, a, b), "unknown")
                for b in handles
            ]
        )
    return {
        "driver_version": text(nv.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": _try(nv.nvmlSystemGetCudaDriverVersion),
        "gpus": gpus,
        "p2p": p2p,
        "topology": topology,
    }


def _p2p(nv, a, b, index: str) -> str:
    """ "ok", or why not, from nvmlP2PStatus_t."""
    status = _try(nv.nvmlDeviceGetP2PStatus, a, b, getattr(nv, index))
    names = {
        0: "ok",
        1: "chipset not supported",
        2: "GPU not supported",
        3: "IOH topology not supported",
        4: "disabled by regkey",
        5: "not supported",
        6: "unknown",
    }
    return names.get(status, "unknown")


def load(path: str) -> dict:
    """A recorded document: `sm120kit doctor --json`'s "nvml" object, or the object itself."""
    from sm120kit.errors import UserError

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--nvml {path}: cannot read an NVML document ({exc})", "pass a file written by `sm120kit doctor --json`"
        ) from None
    doc = doc.get("nvml", doc) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not ("gpus" in doc or "error" in doc):
        raise UserError(
            f'--nvml {path}: not an NVML document (no "gpus" or "error")',
            "pass a file written by `sm120kit doctor --json`",
        )
    from sm120kit.doctor.nvml_schema import validate

    if found := validate(doc):
        raise UserError(
            f"--nvml {path}: not an NVML document as `doctor --json` writes it: {found}",
            "pass a file written by `sm120kit doctor --json`",
        )
    return doc
