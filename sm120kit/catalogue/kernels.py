"""The kernel table (patches/kernels.toml): every kernel family that sglang's selection can
dispatch on an SM12x node, and whether the release installed on the node has an SM12x
build of it, with the evidence in the wheel.

A kernel is dispatched by a *slot* of the resolved launch taking a value
(`attention.decode = trtllm_mla`), optionally only when other slots or resolved fields
hold (`when = ["kv_cache_dtype=fp8_e4m3"]`). Its `support` rows say, per release range of
the package whose code decides (sglang's selection, flashinfer's kernels, sgl-kernel's
build), whether 12.0 and 12.1 run it; a row whose package is not installed is not read.
The slots are filled from sglang's own resolution (sm120kit.resolution), and judged by
sm120kit.resolution.judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sm120kit import search_paths
from sm120kit.errors import UserError

FILENAME = "kernels.toml"
SHIPPED = search_paths.shipped("patches") / FILENAME  # beside the survey, in the wheel too
STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
Id = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$", max_length=80)]
Line = Annotated[str, Field(min_length=1, max_length=2000)]
# What a launch dispatches, named by phase: sm120kit.resolution.slots fills these from
# sglang's resolved record (each release spells the fields its own way).
SLOTS = (
    "attention.prefill",
    "attention.decode",
    "dsa.prefill",
    "dsa.decode",
    "moe.runner",
    "kv_cache_dtype",
    "quantization",
    "sampling",
    "fp8_gemm",
    "fp4_gemm",
    "allreduce",
    "cuda_graph",
    "speculative",
    "architecture",
)
Package = Literal[
    "sglang", "flashinfer-python", "sglang-kernel", "sgl-kernel", "sgl-deep-gemm", "sgl-flash-mla", "deep-gemm", "nvcc"
]


def _assignment(value: str) -> str:
    slot, eq, choice = value.partition("=")
    slot = slot.removesuffix("!")
    if not eq or not choice:
        raise ValueError(f"{value!r} is not SLOT=VALUE (e.g. attention.decode=trtllm_mla)")
    if "." in slot and slot not in SLOTS and not slot.startswith("env."):
        raise ValueError(f"{slot!r} is not a slot: one of {', '.join(SLOTS)}, or env.NAME")
    return value


# SLOT=VALUE, a resolved field (moe_a2a_backend=none), or env.NAME=VALUE (the server's
# environment); KEY!=VALUE holds where the key has another value or none.
Assignment = Annotated[Line, Field(pattern=r"^[A-Za-z0-9_.]+!?=[^=]+$")]


class Support(BaseModel):
    """Whether the releases `releases` of `package` run the kernel on 12.0 and on 12.1."""

    model_config = STRICT

    package: Package
    releases: Line  # PEP 440, e.g. ">=0.5.9,<0.5.17"
    sm120: bool
    sm121: bool
    evidence: Line  # the file and function in the wheel, and what they say

    @field_validator("releases")
    @classmethod
    def _specifier(cls, value: str) -> str:
        try:
            spec = SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"{value!r} is not a PEP 440 range (e.g. >=0.5.17,<=0.5.23)") from None
        if not list(spec):
            raise ValueError("names no releases: write the range the real code was read in")
        return value

    @cached_property
    def specifier(self) -> SpecifierSet:
        return SpecifierSet(self.releases)

    def covers(self, version: str) -> bool:
        try:
            return self.specifier.contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    def runs_on(self, capability: str) -> bool:
        return self.sm121 if capability == "12.1" else self.sm120


class Kernel(BaseModel):
    model_config = STRICT

    id: Id
    title: Line
    dispatched_by: list[Assignment] = Field(min_length=1)  # any of these slot values
    when: list[Assignment] = []  # and all of these
    support: list[Support] = Field(min_length=1)
    upstream: list[Line] = []  # issue / pull request links
    survey: list[Id] = []  # the known-failures entries this kernel row accounts for
    patched_by: Id | None = None  # an sm120kit patch that reroutes it to a kernel that runs: in place, covered

    @field_validator("dispatched_by", "when")
    @classmethod
    def _assignments(cls, values: list[str]) -> list[str]:
        return [_assignment(v) for v in values]

    def judge(
        self, versions: Mapping[str, str], capability: str, read_through: Mapping[str, str] | None = None
    ) -> tuple[bool | None, Support | None, str]:
        """(runs, the row that decides, what was read where the installed release is newer):
        False with the first row that says no; True when a row covers the installed release
        and none says no; None when no row covers it. A release newer than the newest the
        table read of its package (`read_through`) is judged as that one: the table's verdict
        counts past it, as the survey's open failures do, and says it was not verified."""
        judged, past = dict(versions), ""
        for package, newest in (read_through or {}).items():
            if package in judged and _after(judged[package], newest):
                judged[package], past = newest, past or f"{package} read through {newest}"
        covering = [s for s in self.support if s.package in judged and s.covers(judged[s.package])]
        for row in covering:
            if not row.runs_on(capability):
                return False, row, past
        return (True, covering[0], past) if covering else (None, None, "")


def _after(version: str, newest: str) -> bool:
    try:
        return Version(version) > Version(newest)
    except InvalidVersion:
        return False


class _Document(BaseModel):
    model_config = STRICT
    kernel: list[Kernel] = Field(min_length=1)


@dataclass(frozen=True)
class KernelTable:
    kernels: tuple[Kernel, ...]
    source: Path

    def get(self, kernel_id: str) -> Kernel | None:
        return next((k for k in self.kernels if k.id == kernel_id), None)

    @cached_property
    def read_through(self) -> dict[str, str]:
        """package -> the newest release any row names as read (a bound inside a range)."""
        newest: dict[str, str] = {}
        for row in (r for k in self.kernels for r in k.support):
            for spec in row.specifier:
                if row.covers(spec.version) and not _after(newest.get(row.package, "0"), spec.version):
                    newest[row.package] = spec.version
        return newest


def read_table(path: Path = SHIPPED) -> KernelTable:
    """The kernel table, validated; a defect is a UserError naming the file and the key."""
    from sm120kit.catalogue.survey import HINT, read_document

    parsed = read_document(path, _Document, "kernel table", lambda doc, loc: ".".join(map(str, loc)))
    seen: set[str] = set()
    for kernel in parsed.kernel:
        if kernel.id in seen:
            raise UserError(f"{path}: kernel {kernel.id}: listed twice", HINT)
        seen.add(kernel.id)
    return KernelTable(tuple(parsed.kernel), path)
