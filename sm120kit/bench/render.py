"""bench's results as text: the line per level as the sweep goes, the tables and the
verdict at its end, and `bench compare`, fitted to a width (None: --wide). A table wider
than the width is split into its column groups (throughput, latency), each led by the
concurrency."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit import report
from sm120kit.bench import analysis
from sm120kit.bench.command import Comparison, Progress, SweepResult

if TYPE_CHECKING:
    from sm120kit.bench.search_estimate import Estimate
    from sm120kit.bench.search_result import SearchResult
    from sm120kit.bench.search_state import VariantResult
    from sm120kit.bench.variants import Plan, Planned
    from sm120kit.quality.smoke_report import SmokeReport

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

    def smoke_started(self, url: str) -> None:
        self._say(f"smoke: is {url} answering right? (--no-smoke skips it)")

    def smoke_done(self, report: SmokeReport) -> None:
        self._say(f"  {report.summary()}")
        for failure in report.failures:
            self._say(f"    {failure}")


class SearchProgress:
    """A search as it goes: the plan, then a few lines per variant (its sweep's as bench's)."""

    def __init__(self, width: int | None, out=None) -> None:
        self.width, self.out = width, out or sys.stdout
        self.sweep: Progress = TextProgress(width, self.out)  # the search's Progress sets no narrower type
        self.directory = Path()

    def _say(self, text: str) -> None:
        print(report.wrap(text, self.width), file=self.out, flush=True)

    def planned(self, plan: Plan, directory: Path, estimate: Estimate) -> None:
        self.directory = directory
        self._say(plan_text(plan, estimate, self.width))
        self._say(f"results in {directory}")

    def resumed(self, result: VariantResult) -> None:
        again = "" if str(result.status) == "done" else f" (remove {self.directory / result.name} to run it again)"
        self._say(f"{result.name}: already {result.status} in this directory, not run again{again}")

    def variant_started(self, number: int, count: int, planned: Planned) -> None:
        sets = " ".join(f"--set {w}" for w in planned.variant.sets) or "(the profile as written)"
        self._say(f"\n== variant {number}/{count}: {planned.name}  {sets}")
        for warning in planned.warnings:
            self._say(f"  warning: {warning}")

    def smoke_step(self, text: str) -> None:
        self._say(f"  smoke: {text}")

    def smoke_done(self, report: SmokeReport) -> None:
        self.sweep.smoke_done(report)

    def variant_done(self, result: VariantResult) -> None:
        took = f" in {result.seconds:.0f} s" if result.seconds is not None else ""
        why = f": {result.why}" if result.why else ""
        self._say(f"== {result.name}: {result.status}{took}{why}{stop_note(result.stop)}")
        label = "failed" if str(result.status) == "excluded" else "diagnosis"
        for line in result.diagnosis:
            self._say(f"   {label}: {line}")


def stop_note(stop: dict | None) -> str:
    """What the variant's stop proved, in a few words."""
    if not stop or stop.get("clean") is None:
        return ""
    if not stop["clean"]:
        return "; its stop was NOT clean"
    gpus = stop.get("gpu_released_after_s")
    return "; stopped clean" + (f", GPU memory released after {gpus:.1f} s" if gpus is not None else "")


def plan_text(plan: Plan, estimate: Estimate | None, width: int | None) -> str:
    """The variants (runnable, or skipped and why) and the estimated time."""
    named = plan.source != "--vary"  # a --vary variant's name is its settings already
    rows = [[p.name, str(p.status), *([" ".join(p.variant.sets) or "-"] if named else [])] for p in plan.variants]
    headers = ["VARIANT", "STATUS", *(["SET"] if named else [])]
    lines = [
        report.wrap(f"search of {plan.profile}: {len(plan.variants)} variants from {plan.source}", width),
        report.table(headers, rows, width, narrow=(2,) if named else (0,)),
    ]
    lines += [report.wrap(f"{p.status}: {p.name}: {p.why}", width) for p in plan.skipped]  # or refused
    lines += [report.wrap(f"note: {n}", width) for n in plan.notes]
    if estimate is not None:
        lines.append(report.wrap(f"estimated time: {estimate.lines[0]}", width))
        lines += [report.wrap(f"  {line}", width) for line in estimate.lines[1:]]
    return "\n".join(lines)


def search_text(result: SearchResult, width: int | None) -> str:
    """The end of a search (or of `bench compare RUN_DIR`): the table and the verdicts."""
    from sm120kit.bench.search_report import table

    if result.dry_run is not None:
        return (
            plan_text(result.plan, result.dry_run, width)
            + "\n"
            + report.wrap(f"dry run: nothing was started; results would go to {result.directory}", width)
        )
    headers, rows = table(result)
    lines = ["", report.wrap(f"{result.plan.profile}: total tok/s by variant and concurrency", width)]
    lines += [report.table(headers, rows, width, narrow=(0,)), ""]
    lines += [report.wrap(line, width) for line in result.lines]
    if result.adopt:
        lines += ["", report.wrap(f"to adopt {result.adopt['variant']}:", width), f"  {result.adopt['command']}"]
        snippet = result.adopt["snippet"].splitlines()
        lines += ["  or in a profile file:", *(f"    {line}" if line else "" for line in snippet)]
    note = f" ({result.plot_note})" if result.plot_note else ""
    lines += ["", report.wrap(f"results: {result.directory}{note}", width)]
    if result.interrupted:
        lines.append(
            report.wrap(f"interrupted: what is done is kept; rerun with --out {result.directory} to go on", width)
        )
    return "\n".join(lines)


def live_line(level: analysis.Level) -> str:
    if not level.figures:
        return f"  FAILED: {level.error}"
    f = level.figures
    failed = f", {level.failed} of {level.prompts} FAILED" if level.failed else ""
    garbage = f"; its outputs are GARBAGE: {level.garbage}" if level.garbled else ""
    return (
        f"  total {f.get('total_throughput', 0):,.1f} tok/s (output {f.get('output_throughput', 0):,.1f}, "
        f"peak {f.get('max_output_tokens_per_s') or 0:,.0f}), TTFT p50 {f.get('median_ttft_ms') or 0:,.0f} ms, "
        f"ITL p50 {f.get('median_itl_ms') or 0:.1f} ms{failed}{garbage}"
    )


def fitted(headers: list[str], rows: list[list[str]], groups, width: int | None) -> str:
    """The table, or its column groups one under the other where it is wider than width."""
    whole = report.table(headers, rows)
    if width is None or max(len(line) for line in whole.splitlines()) <= width:
        return whole
    return "\n\n".join(report.table([headers[i] for i in g], [[r[i] for i in g] for r in rows], width) for g in groups)


def sweep_text(result: SweepResult, width: int | None) -> str:
    if result.verdict is None:  # interrupted
        return f"interrupted: the {len(result.levels)} finished level(s) are kept in {result.directory}"
    headers, rows = analysis.table_rows(result.levels)
    groups = SWEEP_GROUPS if len(headers) <= 14 else ((*SWEEP_GROUPS[0], 14), SWEEP_GROUPS[1])
    lines = ["", fitted(headers, rows, groups, width), ""]
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
