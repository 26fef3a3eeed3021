"""The NVML document's schema (what `nvml.read()` writes and `doctor --nvml FILE` replays),
strict, and the typed view the checks read: a replayed document whose values have the
wrong types is refused up front, so that no check fails on it half-way and reports "this
node can serve". Memory is in MiB throughout, as NVML's document has it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sm120kit.errors import problems

STRICT = ConfigDict(strict=True, extra="allow")  # strict types; keys a newer sm120kit adds are fine


class Pcie(BaseModel):
    model_config = STRICT

    gen: int | None = None
    max_gen: int | None = None
    width: int | None = None
    max_width: int | None = None

    @property
    def narrow(self) -> bool:
        """Trained below its maximum width (a slow link throttles every rank of a TP group)."""
        return bool(self.width and self.max_width and self.width < self.max_width)


class Gpu(BaseModel):
    model_config = STRICT

    index: int = Field(ge=0)
    name: str
    uuid: str = ""
    pci_bus_id: str = ""
    compute_capability: str = Field(pattern=r"^\d+\.\d+$")
    memory_total_mib: int = Field(ge=0)
    memory_used_mib: int = Field(ge=0)
    memory_free_mib: int | None = Field(None, ge=0)  # absent in documents recorded before it was read
    persistence_mode: bool | None = None
    pcie: Pcie = Pcie()
    processes: dict[str, int] = {}  # pid (JSON keys are text) -> MiB used; 0: not reported

    @property
    def free_mib(self) -> int:
        return self.memory_total_mib - self.memory_used_mib if self.memory_free_mib is None else self.memory_free_mib

    @property
    def in_use_mib(self) -> int:
        return self.memory_total_mib - self.free_mib

    @property
    def pids(self) -> dict[int, int]:
        return {int(pid): mib for pid, mib in self.processes.items()}


class PeerAccess(BaseModel):
    model_config = STRICT

    read: str
    write: str

    @property
    def ok(self) -> bool:
        return self.read == "ok" and self.write == "ok"


class NvmlDocument(BaseModel):
    model_config = STRICT

    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    gpus: list[Gpu] = []
    p2p: list[list[PeerAccess | None]] = []
    topology: list[list[str | None]] = []


def validate(doc: dict) -> str:
    """ "" for a valid document, else where and what is wrong."""
    try:
        NvmlDocument.model_validate(doc)
    except ValidationError as exc:
        return problems(exc)
    return ""


def visible(gpus: list[Gpu], env: dict[str, str]) -> list[Gpu]:
    """The GPUs that CUDA_VISIBLE_DEVICES (indices or UUID prefixes) leaves to a process
    with this environment, in CUDA's order."""
    value = env.get("CUDA_VISIBLE_DEVICES")
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
