"""The node's GPUs as NVML sees them (nvidia-ml-py, the `gpu` extra): count, compute
capability, memory, and the processes that hold memory on each. Read-only."""

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
    """nvidia-ml-py is not installed, or NVML (the driver) cannot be loaded."""


def with_nvml(read: Callable):
    """read(pynvml) between nvmlInit and nvmlShutdown; every NVML problem (no package, no
    driver, a GPU lost or needing a reset) becomes NvmlUnavailable with a plain reason."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'sm120kit[gpu]')") from None
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
    """Every GPU on the node, in NVML order. Raises NvmlUnavailable."""
    return with_nvml(_read)


def _read(nv) -> list[Gpu]:
    gpus = []
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        processes = {}
        for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in getter(handle):
                    processes[p.pid] = p.usedGpuMemory or 0
            except nv.NVMLError:
                pass
        gpus.append(Gpu(index, text(nv.nvmlDeviceGetName(handle)), text(nv.nvmlDeviceGetUUID(handle)),
                        f"{major}.{minor}", memory.total, memory.free, processes))  # fmt: skip
    return gpus


def visible(gpus: list[Gpu], env: dict[str, str] | None = None) -> list[Gpu]:
    """The GPUs that CUDA_VISIBLE_DEVICES (indices or UUID prefixes) leaves to the server."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return gpus
    chosen = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        match = [g for g in gpus if (item.isdigit() and g.index == int(item)) or (not item.isdigit() and g.uuid.startswith(item))]
        if not match:
            break  # CUDA stops at the first entry that names no device
        chosen.append(match[0])
    return chosen
