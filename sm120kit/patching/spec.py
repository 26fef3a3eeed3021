"""What a patch declares, and what its transform returns.

A patch is one small declared unit, like a libcst codemod: metadata plus one or more
rewrites, each a (file, version range, transform). A transform takes the parsed module and
returns a result value; it never raises for a shape it does not know and never touches
the disk. The rest of sm120kit.patching owns everything else (I/O, check mode,
verification, state).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    import libcst as cst

    from sm120kit.patching.ast_tools import Code


class Outcome(str, enum.Enum):
    APPLIED = "applied"
    WOULD_APPLY = "would-apply"
    ALREADY_APPLIED = "already-applied"
    FIXED_UPSTREAM = "fixed-upstream"
    NOT_APPLICABLE = "not-applicable"
    ANCHOR_MISSING = "anchor-missing"
    FOREIGN_EDIT = "foreign-edit"
    OUTDATED = "outdated"  # the code carries another revision of this patch: `patch` rebuilds it
    FAILED = "failed"  # the patch itself misbehaved (raised, unstable, bad syntax)

    @property
    def is_error(self) -> bool:
        return self in (Outcome.ANCHOR_MISSING, Outcome.FOREIGN_EDIT, Outcome.FAILED)


# `# sm120kit: <id> r<revision>`, optionally followed by `: why`. Planning reads every
# marker in a file; a transform only ever looks for its own current one.
MARKER = re.compile(r"#\s*sm120kit:\s*(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*)\s+r(?P<revision>\d+)\b")


def marker_revisions(text: str, patch_id: str) -> set[int]:
    """The revisions of `patch_id` whose markers appear in `text`."""
    return {int(m["revision"]) for m in MARKER.finditer(text) if m["id"] == patch_id}


@dataclass(frozen=True)
class Context:
    """What a transform may know besides the code: which patch it serves, and the marker
    comment it must leave on the statement it changes (so applied code is recognisable
    without the ledger). Other revisions' markers are planning's business: a transform
    never sees a file that carries one."""

    patch_id: str
    revision: int

    @property
    def marker(self) -> str:
        return f"# sm120kit: {self.patch_id} r{self.revision}"

    def is_marker(self, comment: str) -> bool:
        """Whether a comment is this revision's marker (r1 is not r10)."""
        return comment == self.marker or comment.startswith(self.marker + ":")


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


@dataclass(frozen=True)
class WouldRewrite:
    """A quick read's verdict where the transform would return Rewritten: the code has the
    shape the transform changes (its anchor, not applied, not fixed)."""


TransformResult = Rewritten | AlreadyApplied | FixedUpstream | AnchorMissing
Transform = Callable[["cst.Module", Context], TransformResult]
# A quick read: the transform's verdict read from the code without libcst (ast and tokens,
# sm120kit/patching/ast_tools.py), the same result and reason; None (or ast_tools.Undecided)
# where the cheap read cannot tell, and the transform decides.
QuickResult = WouldRewrite | AlreadyApplied | FixedUpstream | AnchorMissing | None
Quick = Callable[["Code", Context], QuickResult]


@dataclass(frozen=True)
class Rewrite:
    """One file of one patch, for the releases whose code has the shape `transform` knows."""

    path: str  # relative to the package's install root, e.g. "sglang/srt/model_executor/model_runner.py"
    versions: str  # PEP 440 specifier set, e.g. ">=0.5.9,<0.5.14"
    transform: Transform
    fixed_in: str | None = None  # when this part was fixed upstream, if not the patch's fixed_in
    quick: Quick | None = None  # the transform's verdict without libcst, where it can tell (optional)

    def covers(self, version: str) -> bool:
        return self._specifiers.contains(Version(version), prereleases=True)

    @cached_property
    def _specifiers(self) -> SpecifierSet:
        return SpecifierSet(self.versions)

    @cached_property
    def upper(self) -> tuple[Version, bool] | None:
        """The top of the range: (release, inclusive), or None for an open-ended range."""
        bounds = [
            (Version(s.version), s.operator != "<")
            for s in self._specifiers
            if s.operator in ("<", "<=", "==", "===") and "*" not in s.version
        ]
        return min(bounds, key=lambda b: (b[0], not b[1])) if bounds else None

    @cached_property
    def lower(self) -> Version | None:
        bounds = [Version(s.version) for s in self._specifiers if s.operator in (">=", ">", "==", "~=")]
        return max(bounds) if bounds else None

    def is_past(self, version: str) -> bool:
        """Whether `version` is newer than every release of the range."""
        if self.upper is None:
            return False
        bound, inclusive = self.upper
        v = Version(version)
        return v > bound if inclusive else v >= bound


_REF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)#(?P<number>\d+)$")


def _link(ref: str) -> str:
    m = _REF.match(ref)
    return f"https://github.com/{m['repo']}/issues/{m['number']}" if m else ref


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

    @property
    def upstream(self) -> tuple[str, ...]:
        """The refs as links: "owner/repo#N" is https://github.com/owner/repo/issues/N (GitHub
        sends an issue number that is a pull request on to the pull request)."""
        return tuple(_link(ref) for ref in self.refs)

    def rewrites_for(self, version: str) -> list[Rewrite]:
        return [r for r in self.rewrites if r.covers(version)]

    def fixed_in_for(self, rewrite: Rewrite) -> str | None:
        """When upstream fixed this part: the rewrite's own release, else the patch's."""
        return rewrite.fixed_in or self.fixed_in

    def is_fixed_in(self, version: str) -> bool:
        return self.fixed_in is not None and Version(version) >= Version(self.fixed_in)

    def rewrites_to_run(self, version: str) -> list[Rewrite]:
        """The rewrites whose transforms run on `version`: those proven on it, or past the
        window the current ones, all of them. A part known fixed upstream is read from the
        code there too: a release number says nothing of the code it carries (a regression,
        a fork's build, a local build of a development version)."""
        if rewrites := self.rewrites_for(version):
            return rewrites
        if self.is_past_window(version):
            return list(self.current_rewrites)
        return []

    # -- the proven window: the releases the rewrites were proven on ----------------------

    @cached_property
    def current_rewrites(self) -> tuple[Rewrite, ...]:
        """The rewrites that reach the top of the window (the others were superseded by a
        moved file or ended with their code): past the window, these run by shape."""
        tops = [r.upper for r in self.rewrites if r.upper is not None]
        if not tops or len(tops) < len(self.rewrites):  # none, or one without a top: no window to be past
            return ()
        top = max(tops, key=lambda b: (b[0], b[1]))
        return tuple(r for r in self.rewrites if r.upper == top)

    def is_past_window(self, version: str) -> bool:
        """Newer than every release this patch was proven on."""
        return bool(self.current_rewrites) and all(r.is_past(version) for r in self.rewrites)

    @cached_property
    def window(self) -> str:
        """The proven releases: "0.5.9–0.5.23" for an inclusive top, else the specifiers."""
        lows = [r.lower for r in self.rewrites if r.lower is not None]
        low = str(min(lows)) if lows and len(lows) == len(self.rewrites) else None
        if self._top is None:
            return f">={low}" if low else "any release"
        top, inclusive = self._top
        if inclusive:
            return f"{low}–{top}" if low else f"up to {top}"
        return f">={low},<{top}" if low else f"<{top}"

    @cached_property
    def last_proven(self) -> str | None:
        """The newest release the window names (only an inclusive bound names one)."""
        if self._top is None:
            return None
        top, inclusive = self._top
        return str(top) if inclusive else None

    @property
    def _top(self) -> tuple[Version, bool] | None:
        """The window's top bound, the current rewrites' (None: no window)."""
        return self.current_rewrites[0].upper if self.current_rewrites else None
