"""A SmokeReport as text: a header, one row per check (PASS/FAIL, its figures, what failed
under it), the baseline written or not, and the one-line summary; fitted to a width (None:
--wide). The JSON document is SmokeReport.as_json."""

from __future__ import annotations

import sys

from sm120kit import report
from sm120kit.quality.smoke_report import SmokeReport


class TextProgress:
    """What the smoke is doing, a line a step (on stderr with --json)."""

    def __init__(self, width: int | None, out=None) -> None:
        self.width, self.out = width, out or sys.stdout

    def step(self, text: str) -> None:
        print(report.wrap(text, self.width), file=self.out, flush=True)


def header(result: SmokeReport) -> str:
    about = ", ".join(f"{k} {v}" for k, v in (("model", result.model), ("sglang", result.sglang)) if v)
    return (
        (f"smoke of {result.name} at {result.url}" if result.name else f"smoke of {result.url}")
        + (f" ({about})" if about else "")
        + f": "
        f"{result.tasks} tasks, a burst of {result.concurrency}"
        + (f", against the baseline {result.baseline}" if result.baseline else "")
    )


def smoke_text(result: SmokeReport, width: int | None) -> str:
    rows = [["PASS" if c.passed else "FAIL", str(c.name), c.detail] for c in result.checks]
    notes = ["\n".join(f"e.g. {e}" for e in c.examples) if c.examples else "" for c in result.checks]
    lines = [report.wrap(header(result), width), "", report.table(["", "check", "result"], rows, width, (2,), notes)]
    lines.append("")
    if result.recorded:
        lines.append(report.wrap(f"baseline recorded: {result.recorded}", width))
    if result.stalled:
        lines.append(report.wrap(f"stopped sending early: {result.stalled}", width))
    if result.note:
        lines.append(report.wrap(result.note, width))
    lines.append(report.wrap(result.summary(), width))
    return "\n".join(lines)
