"""What a variant search found: the verdict per concurrency (Pick) and the whole result
(SearchResult), read by the search that makes it, the report that writes it and the
renderer that prints it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit.bench.search_estimate import Estimate
from sm120kit.bench.search_state import Outcome, VariantResult
from sm120kit.bench.variants import Plan
from sm120kit.exit_codes import ExitCode


@dataclass(frozen=True)
class Pick:
    """The verdict at one concurrency (None: overall, each variant at its best level)."""

    concurrency: int | None
    best: str | None  # None: no variant beats the next by more than the spread
    leader: str  # the highest median
    line: str


@dataclass
class SearchResult:
    directory: Path
    plan: Plan
    settings: dict
    results: list[VariantResult]
    picks: list[Pick] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the verdicts, as summary.md says them
    adopt: dict | None = None  # {"variant", "set", "command", "snippet"}
    interrupted: bool = False
    stopped_early: str = ""  # why the search ended before its last variant
    plot_note: str | None = None
    dry_run: Estimate | None = None
    read_back: bool = False  # `bench compare RUN_DIR`: printed, whatever the search found (exit 0)

    @property
    def exit_code(self) -> ExitCode:
        if self.dry_run is not None:  # a variant serve would refuse: said, as the search would end
            return ExitCode.FINDINGS if self.plan.refused else ExitCode.OK
        if self.read_back:
            return ExitCode.OK
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if any(r.unclean for r in self.results):
            return ExitCode.UNCLEAN
        bad = {Outcome.EXCLUDED, Outcome.CRASHED, Outcome.REFUSED, Outcome.FAILED}
        failed_levels = any(lv.failed or not lv.figures or lv.error for r in self.results for lv in r.levels)
        return ExitCode.FINDINGS if failed_levels or any(r.status in bad for r in self.results) else ExitCode.OK

    def as_json(self) -> dict:
        doc = {
            "directory": str(self.directory),
            "settings": self.settings,
            "plan": self.plan.as_json(),
            "variants": [r.as_json() | {"resumed": r.resumed} for r in self.results],
            "picks": [dataclasses.asdict(p) for p in self.picks],
            "verdict": self.lines,
            "adopt": self.adopt,
            "interrupted": self.interrupted,
            "stopped_early": self.stopped_early or None,
            "plot": self.plot_note,
            "exit_code": int(self.exit_code),
        }
        if self.dry_run is not None:
            doc["estimate"] = {"seconds": round(self.dry_run.seconds), "lines": self.dry_run.lines}
        return doc
