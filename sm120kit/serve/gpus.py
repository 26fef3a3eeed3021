"""The node's GPUs as NVML sees them (nvidia-ml-py, a dependency): count, compute
capability, memory, and the processes that hold memory on each. Read-only. They are read
through doctor's NVML document (sm120kit.doctor.nvml): one reader, one verdict."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    capability: str  # "12.0"
    total: int  # bytes
    free: int
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes used (0: not reported)


class NvmlUnavailable(Exception):
    """NVML (the driver) cannot be loaded, or nvidia-ml-py is missing from a broken install."""


def with_nvml(read: Callable):
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


def text(value) -> str:
    """NVML strings are bytes in older nvidia-ml-py releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus() -> list[Gpu]:
    """Every GPU on the node, in NVML order, as `sm120kit doctor` reads them. Raises
    NvmlUnavailable."""
    from sm120kit.doctor import nvml

    return from_document(nvml.read(pairs=False))


def from_document(doc: dict) -> list[Gpu]:
    """The GPUs of an NVML document (sm120kit.doctor.nvml); its error as NvmlUnavailable."""
    if "error" in doc:
        raise NvmlUnavailable(doc["error"])
    gpus = []
    for g in doc.get("gpus", []):
        total = g["memory_total_mib"] * MIB
        free = g.get("memory_free_mib", g["memory_total_mib"] - g["memory_used_mib"]) * MIB
        processes = {int(pid): mib * MIB for pid, mib in g.get("processes", {}).items()}
        gpus.append(Gpu(g["index"], g["name"], g["uuid"], g["compute_capability"], total, free, processes))
    return gpus


def visible(gpus: list[Gpu], env: dict[str, str] | None = None) -> list[Gpu]:
    """The GPUs that CUDA_VISIBLE_DEVICES (indices or UUID prefixes) leaves to the server."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return gpus
    chosen = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        match = [
            g
            for g in gpus
            if (item.isdigit() and g.index == int(item)) or (not item.isdigit() and g.uuid.startswith(item))
        ]
        if not match:
            break  # CUDA stops at the first entry that names no device
        chosen.append(match[0])
    return chosen
