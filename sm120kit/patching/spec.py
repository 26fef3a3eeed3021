"""What a patch declares, and what its transform returns.

A patch is one small declared unit, like a libcst codemod: metadata plus one or more
rewrites, each a (file, version range, transform). A transform takes the parsed module and
returns a result value; it never raises for a shape it does not know and never touches
the disk. The engine owns everything else (I/O, check mode, verification, state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    import libcst as cst


class Outcome(str, enum.Enum):
    APPLIED = "applied"
    WOULD_APPLY = "would-apply"
    ALREADY_APPLIED = "already-applied"
    FIXED_UPSTREAM = "fixed-upstream"
    NOT_APPLICABLE = "not-applicable"
    ANCHOR_MISSING = "anchor-missing"
    FOREIGN_EDIT = "foreign-edit"
    FAILED = "failed"  # the patch itself misbehaved (raised, unstable, bad syntax)

    @property
    def is_error(self) -> bool:
        return self in (Outcome.ANCHOR_MISSING, Outcome.FOREIGN_EDIT, Outcome.FAILED)


@dataclass(frozen=True)
class Context:
    """What a transform may know besides the code: which patch it serves, and the marker
    comment it must leave on the statement it changes (so applied code is recognisable
    without the ledger)."""

    patch_id: str
    revision: int

    @property
    def any_revision(self) -> str:
        """What the marker of every revision of this patch starts with."""
        return f"# sm120kit: {self.patch_id} r"

    @property
    def marker(self) -> str:
        return f"{self.any_revision}{self.revision}"


@dataclass(frozen=True)
class Rewritten:
    module: cst.Module


@dataclass(frozen=True)
class AlreadyApplied:
    pass


@dataclass(frozen=True)
class FixedUpstream:
    reason: str


@dataclass(frozen=True)
class AnchorMissing:
    reason: str


TransformResult = Union[Rewritten, AlreadyApplied, FixedUpstream, AnchorMissing]
Transform = Callable[["cst.Module", Context], TransformResult]


@dataclass(frozen=True)
class Rewrite:
    """One file of one patch, for the releases whose code has the shape `transform` knows."""

    path: str  # relative to the package's install root, e.g. "sglang/srt/model_executor/model_runner.py"
    versions: str  # PEP 440 specifier set, e.g. ">=0.5.9,<0.5.14"
    transform: Transform
    fixed_in: str | None = None  # when this part was fixed upstream, if not the patch's fixed_in

    def covers(self, version: str) -> bool:
        return SpecifierSet(self.versions).contains(Version(version), prereleases=True)


@dataclass(frozen=True)
class Patch:
    id: str
    package: str  # distribution name, e.g. "sglang" or "flashinfer-python"
    summary: str  # one line
    why: str  # why it exists, with the upstream issue / PR
    rewrites: tuple[Rewrite, ...]
    fixed_in: str | None = None  # the upstream release that carries the fix
    refs: tuple[str, ...] = ()
    revision: int = 1  # bump when the rewrite changes, so applied code is re-checked
    source: str = ""  # the module it was loaded from (set by the registry)
    source_sha256: str = ""  # of that module: outcomes are cached under it

    def context(self) -> Context:
        return Context(self.id, self.revision)

    def rewrites_for(self, version: str) -> list[Rewrite]:
        return [r for r in self.rewrites if r.covers(version)]

    def fixed_in_for(self, rewrite: Rewrite) -> str | None:
        """When upstream fixed this part: the rewrite's own release, else the patch's."""
        return rewrite.fixed_in or self.fixed_in

    def is_fixed_in(self, version: str) -> bool:
        return self.fixed_in is not None and Version(version) >= Version(self.fixed_in)
