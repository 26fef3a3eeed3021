"""What NVML says about the node, as one plain JSON-able document: the seam between the
driver and everything that asks about the GPUs (the checks, and serve's stop proof), so
that every command gives one verdict. `read()` asks the real NVML (nvidia-ml-py, a
dependency); `load(FILE)` replays a document that `sm120kit doctor --json` recorded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sm120kit import shallow_json
from sm120kit.errors import UserError
from sm120kit.node.nvml_schema import Gpu, NvmlDocument, validate

MIB = 1 << 20

# nvmlGpuTopologyLevel_t, nearest first (nvml.h)
TOPOLOGY = {
    0: "internal",
    10: "single-switch",
    20: "multiple-switches",
    30: "host-bridge",
    40: "numa-node",
    50: "across-sockets",
}
P2P_STATUS = {  # nvmlGpuP2PStatus_t
    0: "ok",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}


class NvmlUnavailable(Exception):
    """NVML (the driver) cannot be loaded, or nvidia-ml-py is missing from a broken install."""


def read(pairs: bool = True) -> dict:
    """The live node. {"error": ...} when nvidia-ml-py, the driver or a GPU fails: that is
    the answer. Without pairs, no P2P or topology matrix (the GPU checks need neither)."""
    try:
        return _with_nvml(lambda nv: _read(nv, pairs))
    except NvmlUnavailable as exc:
        return {"error": str(exc)}


def read_gpus() -> list[Gpu]:
    """Every GPU on the node now, in NVML order. Raises NvmlUnavailable."""
    doc = read(pairs=False)
    if "error" in doc:
        raise NvmlUnavailable(doc["error"])
    return NvmlDocument.model_validate(doc).gpus


def gpus_here() -> list[Gpu]:
    """read_gpus, or none where NVML cannot be read (no driver, no GPU)."""
    try:
        return read_gpus()
    except NvmlUnavailable:
        return []


def gpu_name_here() -> str | None:
    """GPU 0's name, which sglang's config tables are named for; None without a GPU or NVML."""
    gpus = gpus_here()
    return gpus[0].name if gpus else None


def load(path: str) -> dict:
    """A recorded document: `sm120kit doctor --json`'s "nvml" object, or the object itself."""
    hint = "pass a file written by `sm120kit doctor --json`"
    try:
        doc = shallow_json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--nvml {path}: cannot read an NVML document ({exc})", hint) from None
    doc = doc.get("nvml", doc) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not ("gpus" in doc or "error" in doc):
        raise UserError(f'--nvml {path}: not an NVML document (no "gpus" or "error")', hint)
    if found := validate(doc):
        raise UserError(f"--nvml {path}: not an NVML document as `doctor --json` writes it: {found}", hint)
    return doc


def _with_nvml(read: Callable):
    """read(pynvml) between nvmlInit and nvmlShutdown; every NVML problem (no package, no
    driver, a GPU lost or needing a reset) becomes NvmlUnavailable with a plain reason."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable(
            "nvidia-ml-py, a dependency of sm120kit, is missing from this environment (pip install nvidia-ml-py)"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"no NVIDIA driver: NVML cannot start ({exc})") from None
    try:
        return read(pynvml)
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML failed: {exc}") from None
    finally:
        pynvml.nvmlShutdown()


def _text(value) -> str:
    """NVML strings are bytes in older nvidia-ml-py releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


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


def _gpu(nv, index: int, handle) -> dict:
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    persistence = _try(nv.nvmlDeviceGetPersistenceMode, handle)
    return {
        "index": index,
        "name": _text(nv.nvmlDeviceGetName(handle)),
        "uuid": _text(nv.nvmlDeviceGetUUID(handle)),
        "pci_bus_id": _text(nv.nvmlDeviceGetPciInfo(handle).busId),
        "compute_capability": f"{major}.{minor}",
        "memory_total_mib": memory.total // MIB,
        "memory_used_mib": memory.used // MIB,
        "memory_free_mib": memory.free // MIB,
        "persistence_mode": None if persistence is None else persistence == 1,
        "pcie": {
            "gen": _try(nv.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "max_gen": _try(nv.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "width": _try(nv.nvmlDeviceGetCurrPcieLinkWidth, handle),
            "max_width": _try(nv.nvmlDeviceGetMaxPcieLinkWidth, handle),
        },
        "processes": _processes(nv, handle),
    }


def _read(nv, pairs: bool) -> dict:
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    p2p, topology = [], []
    for a in handles if pairs else []:
        p2p.append(
            [None if a is b else {"read": _p2p(nv, a, b, "READ"), "write": _p2p(nv, a, b, "WRITE")} for b in handles]
        )
        topology.append(
            [
                None if a is b else TOPOLOGY.get(_try(nv.nvmlDeviceGetTopologyCommonAncestor, a, b), "unknown")
                for b in handles
            ]
        )
    return {
        "driver_version": _text(nv.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": _try(nv.nvmlSystemGetCudaDriverVersion),
        "gpus": [_gpu(nv, i, h) for i, h in enumerate(handles)],
        "p2p": p2p,
        "topology": topology,
    }


def _p2p(nv, a, b, what: str) -> str:
    """ "ok", or why not (nvmlGpuP2PStatus_t); what: READ or WRITE."""
    status = _try(nv.nvmlDeviceGetP2PStatus, a, b, getattr(nv, f"NVML_P2P_CAPS_INDEX_{what}"))
    return P2P_STATUS.get(status, "unknown")
