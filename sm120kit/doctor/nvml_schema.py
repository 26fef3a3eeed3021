"""The NVML document's schema (what `read()` writes and `doctor --nvml FILE` replays),
strict: a replayed document whose values have the wrong types is refused up front, so that
no check fails on it half-way and reports "this node can serve"."""

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


class Gpu(BaseModel):
    model_config = STRICT

    index: int = Field(ge=0)
    name: str
    uuid: str = ""
    pci_bus_id: str = ""
    compute_capability: str = Field(pattern=r"^\d+\.\d+$")
    memory_total_mib: int = Field(ge=0)
    memory_used_mib: int = Field(ge=0)
    memory_free_mib: int | None = Field(None, ge=0)
    persistence_mode: bool | None = None
    pcie: Pcie = Pcie()
    processes: dict[str, int] = {}


class PeerAccess(BaseModel):
    model_config = STRICT

    read: str
    write: str


class Document(BaseModel):
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
        Document.model_validate(doc)
    except ValidationError as exc:
        return problems(exc)
    return ""
