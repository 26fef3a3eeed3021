"""bench's results as text: the line per level as the sweep goes, the tables and the
verdict at its end, and `bench compare`, fitted to a width (None: --wide). A table wider
than the width is split into its column groups (throughput, latency), each led by the
concurrency."""

from __future__ import annotations

import sys
from pathlib import Path

from sm120kit import report
from sm120kit.bench import analysis
from sm120kit.bench.command import Comparison, SweepResult

# Columns of analysis.table_rows and analysis.compare_rows, as groups that fit 100 columns.
SWEEP_GROUPS = ((0, 1, 2, 3, 4, 5, 12, 13), (0, 6, 7, 8, 9, 10, 11))  # throughput, done / failed; latency
COMPARE_GROUPS = ((0, 1, 2, 3, 4, 5, 6), (0, 7, 8, 9, 10, 11, 12))  # total and output tok/s; TTFT and ITL


class TextProgress:
    """A sweep as it goes, a line or two per level."""

    def __init__(self, width: int | None, out=None) -> None:
        self.width, self.out = width, out or sys.stdout

    def _say(self, text: str) -> None:
        print(report.wrap(text, self.width), file=self.out, flush=True)

    def sweeping(self, url: str, module: str, sglang: str, levels: list[int], directory: Path) -> None:
        self._say(
            f"sweeping {url} with {module} (sglang {sglang}): concurrency {', '.join(map(str, levels))}; "
            f"results in {directory}"
        )

    def level_started(self, number: int, count: int, concurrency: int, prompts: int) -> None:
        bar = "#" * (number - 1) + "." * (count - number + 1)
        self._say(f"[{bar}] {number}/{count} concurrency {concurrency}: {prompts} prompts ...")

    def level_done(self, level: analysis.Level) -> None:
        self._say(live_line(level))


def live_line(level: analysis.Level) -> str:
    if not level.figures:
        return f"  FAILED: {level.error}"
    f = level.figures
    failed = f", {level.failed} of {level.prompts} FAILED" if level.failed else ""
    return (
        f"  total {f.get('total_throughput', 0):,.1f} tok/s (output {f.get('output_throughput', 0):,.1f}, "
        f"peak {f.get('max_output_tokens_per_s') or 0:,.0f}), TTFT p50 {f.get('median_ttft_ms') or 0:,.0f} ms, "
        f"ITL p50 {f.get('median_itl_ms') or 0:.1f} ms{failed}"
    )


def fitted(headers: list[str], rows: list[list[str]], groups, width: int | None) -> str:
    """The table, or its column groups one under the other where it is wider than width."""
    whole = report.table(headers, rows)
    if width is None or max(len(line) for line in whole.splitlines()) <= width:
        return whole
    return "\n\n".join(report.table([headers[i] for i in g], [[r[i] for i in g] for r in rows], width) for g in groups)


def sweep_text(result: SweepResult, width: int | None) -> str:
    if result.interrupted:
        return f"interrupted: the {len(result.levels)} finished level(s) are kept in {result.directory}"
    headers, rows = analysis.table_rows(result.levels)
    lines = ["", fitted(headers, rows, SWEEP_GROUPS, width), ""]
    lines += [report.wrap(line, width) for line in result.verdict.lines]
    note = f" ({result.plot_note})" if result.plot_note else ""
    lines += ["", report.wrap(f"results: {result.directory}{note}", width)]
    return "\n".join(lines)


def comparison_text(comparison: Comparison, width: int | None) -> str:
    (before, before_title), (after, after_title) = comparison.before, comparison.after
    lines = [
        report.wrap(f"before: {before}  ({before_title})", width),
        report.wrap(f"after:  {after}  ({after_title})", width),
        "",
        fitted(comparison.headers, comparison.rows, COMPARE_GROUPS, width),
    ]
    return "\n".join(lines)
