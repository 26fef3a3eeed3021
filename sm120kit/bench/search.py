"""`bench --vary` / `bench --variants`: the search for the fastest configuration that still
answers right. For each runnable variant of the plan (variant_plan.py), the profile as written
first: start its server with serve's Python API (bench/serving.py), wait until it
generates, smoke it, sweep it into its own directory, stop it and read what the stop
proved (serve's exit code and its `stopped` event: no process, port or GPU memory of the
server left), then the next. A variant that does not get ready, or whose server dies
during its sweep, is recorded with the supervisor's diagnosis, and the search goes on; one
whose smoke fails is excluded (not swept: a configuration that answers wrong has no speed
worth knowing, and the time goes to the others), and so is one whose sweep's own outputs
are garbage (a sample of the texts each level generated, streamed, through the smoke's
detectors: analysis.sample_outputs). A sweep with a level that gave no figures is not a
result: the variant failed, and a rerun runs it again. A stop that left something ends the
search: the next variant would start on GPUs that are not free.

The search directory (--out), enough to resume it and to compare it later:

    search.json          the settings, the plan (every variant, runnable or skipped and
                         why) and each variant's status; rewritten as the search goes
    summary.md           the verdicts: the best variant per concurrency and overall, its
                         gain over as-written, every variant excluded, skipped or crashed
                         and why, and how to adopt the winner
    results.csv          one row per variant and concurrency: median and spread
    plot.png             total tok/s against concurrency, one curve per variant
    <variant>/variant.json   the variant's state: status, why, its smoke verdict, the stop
    <variant>/smoke.json     its smoke report
    <variant>/server.log     a crashed variant's server log (the supervisor's last start)
    <variant>/run.json ...   its sweep: bench's results directory (results.py)

A rerun with the same --out and the same settings skips the variants already done,
excluded or crashed (and says so); an interrupted one, one the preflight refused, or one
that failed (a level without figures; also one an earlier sm120kit recorded as done so),
runs again. Remove a variant's directory to run it again."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

from sm120kit.bench.analysis import Level
from sm120kit.bench.command import BenchOptions
from sm120kit.bench.search_estimate import Estimate, estimate
from sm120kit.bench.search_events import (
    crash_from_events,
    died_from_events,
    events_path,
    events_since,
    stop_from_events,
    stopped_early_why,
)
from sm120kit.bench.search_report import write_report
from sm120kit.bench.search_result import SearchResult
from sm120kit.bench.search_state import (
    REFUSED_WHY,
    SEARCH_FILE,
    SERVER_LOG,
    SMOKE_FILE,
    VARIANT_FILE,
    Outcome,
    VariantResult,
    check_resumable,
    default_directory,
    search_doc,
    settings_of,
    write_json,
)
from sm120kit.bench.variants import Plan, Planned
from sm120kit.errors import UserError
from sm120kit.serve.status import EventKind

if TYPE_CHECKING:
    from sm120kit.bench import command
    from sm120kit.quality.smoke_report import SmokeReport
    from sm120kit.serve.options import ServeOptions
    from sm120kit.target import Target


@dataclass(frozen=True)
class SearchOptions:
    bench: BenchOptions  # levels, lengths, repeat, smoke, out, python, patch_dirs
    serve: ServeOptions  # how each variant's server is started
    debug: bool = False


class Progress(Protocol):
    """What a search tells as it goes (bench/render.py prints it)."""

    sweep: command.Progress  # each variant's sweep

    def planned(self, plan: Plan, directory: Path, estimate: Estimate) -> None: ...

    def resumed(self, result: VariantResult) -> None: ...

    def variant_started(self, number: int, count: int, planned: Planned) -> None: ...

    def smoke_step(self, text: str) -> None: ...

    def smoke_done(self, report: SmokeReport) -> None: ...

    def variant_done(self, result: VariantResult) -> None: ...


def dry_run(plan: Plan, options: BenchOptions, directory: Path, base_sets: list[str]) -> SearchResult:
    """The plan and the estimate; nothing is started or written."""
    settings = settings_of(options, plan, base_sets)
    done = check_resumable(directory, settings, plan) if directory.exists() else {}
    results = [done.get(p.name) or VariantResult.skipped(p) for p in plan.variants if not p.runnable or p.name in done]
    return SearchResult(directory, plan, settings, results, dry_run=estimate(plan, options, done))


# -- the search --------------------------------------------------------------------------


def search(
    options: SearchOptions,
    plan: Plan,
    base_sets: list[str],
    target: Target,
    progress: Progress,
    width: int | None,
    out: TextIO,
) -> SearchResult:
    from sm120kit.bench.serving import stop_signals_interrupt

    directory = options.bench.out or default_directory(plan.profile)
    settings = settings_of(options.bench, plan, base_sets)
    done = check_resumable(directory, settings, plan)
    directory.mkdir(parents=True, exist_ok=True)
    results: dict[str, VariantResult] = {}
    for p in plan.skipped:
        results[p.name] = VariantResult.skipped(p)
    write_json(directory / SEARCH_FILE, search_doc(settings, plan, results | done))
    progress.planned(plan, directory, estimate(plan, options.bench, done))
    interrupted, stopped_early = False, ""
    runnable = plan.runnable
    with stop_signals_interrupt():  # SIGTERM, SIGHUP between two variants: as Ctrl-C
        try:
            for number, planned in enumerate(runnable, 1):
                if planned.name in done:
                    results[planned.name] = done[planned.name]
                    progress.resumed(done[planned.name])
                    continue
                progress.variant_started(number, len(runnable), planned)
                result = _run_variant(options, planned, directory / planned.name, target, progress, width, out)
                results[planned.name] = result
                write_json(directory / SEARCH_FILE, search_doc(settings, plan, results))
                progress.variant_done(result)
                if result.status is Outcome.INTERRUPTED:
                    interrupted = True
                    break
                if result.unclean:
                    stopped_early = (
                        f"the stop of {result.name} left a process, port or GPU memory of its server "
                        f"({result.why}): the search stopped, the next variant would not start on free GPUs"
                    )
                    break
        except KeyboardInterrupt:
            interrupted = True
    ordered = [results[p.name] for p in plan.variants if p.name in results]
    report = SearchResult(directory, plan, settings, ordered, interrupted=interrupted, stopped_early=stopped_early)
    write_report(report)
    write_json(directory / SEARCH_FILE, search_doc(settings, plan, results))
    return report


class _SmokeSteps:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def step(self, text: str) -> None:
        self.progress.smoke_step(text)


def _run_variant(
    options: SearchOptions,
    planned: Planned,
    vdir: Path,
    target: Target,
    progress: Progress,
    width: int | None,
    out: TextIO,
) -> VariantResult:
    from sm120kit.bench.serving import Served, served

    vdir.mkdir(parents=True, exist_ok=True)
    result = VariantResult(planned.name, list(planned.variant.sets), Outcome.RUNNING)
    write_json(vdir / VARIANT_FILE, result.as_json())
    began = time.monotonic()
    record = events_path(planned.profile)
    offset = record.stat().st_size if record.exists() else 0
    ready = False
    handle = Served(record)
    try:
        with served(planned.profile, planned.launch, target, options.serve, width, out, options.debug, handle):
            ready = True
            by_serve = [e for e in events_since(record, offset) if e["event"] is EventKind.SMOKE]
            _smoke_and_sweep(options, planned, vdir, target, progress, result, by_serve[-1:], handle.alive)
    except KeyboardInterrupt:
        result.status, result.why = Outcome.INTERRUPTED, "interrupted: runs again on a rerun with the same --out"
    except UserError as exc:  # not ready; or, once ready, no longer answering
        events = events_since(record, offset)
        result.why, result.diagnosis = crash_from_events(events, exc.message)
        result.status = Outcome.REFUSED if result.why.startswith(REFUSED_WHY) else Outcome.CRASHED
        failed = [e for e in events if e["event"] is EventKind.SMOKE and not e.get("passed")]
        if failed and not ready:  # health.smoke: serve ran the smoke and refused to call it ready
            result.status, result.why = Outcome.EXCLUDED, f"{failed[-1].get('summary', 'smoke FAILED')} (health.smoke)"
            result.diagnosis = [_short(f) for f in failed[-1].get("failures", [])]
            result.smoke = {"passed": False, "summary": failed[-1].get("summary"), "failures": result.diagnosis}
        elif ready:
            result.why = f"{exc.message} ({result.why})" if result.why != exc.message else exc.message
        if result.status is not Outcome.REFUSED:  # refused: nothing started, the log is an earlier server's
            _keep_log(record.parent / SERVER_LOG, vdir / SERVER_LOG)
    if handle.exit_code is not None:
        events = events_since(record, offset)  # the whole record of this variant's starts, read once
        result.stop = stop_from_events(events, handle.exit_code)
        if ready and result.status is not Outcome.INTERRUPTED:
            died = died_from_events(events)
            if died:  # the supervisor restarted it, or gave up: its figures are not of one server
                result.status = Outcome.CRASHED
                result.why, result.diagnosis = died
                _keep_log(record.parent / SERVER_LOG, vdir / SERVER_LOG)
            elif handle.ended_early and result.status in (Outcome.DONE, Outcome.FAILED):  # levels ran against nothing
                result.status = Outcome.CRASHED
                result.why = stopped_early_why(events, handle.exit_code)
        if result.unclean:
            result.why = (result.why + "; " if result.why else "") + result.stop.get("said", "unclean stop")
    result.seconds = round(time.monotonic() - began, 1)
    write_json(vdir / VARIANT_FILE, result.as_json())
    return result


def _smoke_and_sweep(
    options: SearchOptions,
    planned: Planned,
    vdir: Path,
    target: Target,
    progress: Progress,
    result: VariantResult,
    by_serve: list[dict],
    alive: Callable[[], bool],
) -> None:
    """Inside the served block: the smoke (serve's own, where health.smoke ran it before
    calling the server ready), then (when it passed) the sweep."""
    from sm120kit.bench import command
    from sm120kit.quality.command import smoke
    from sm120kit.quality.options import options_for

    smoke_doc: dict = {"skipped": "--no-smoke"}
    if options.bench.smoke and by_serve and by_serve[0].get("passed"):
        smoke_doc = {"passed": True, "summary": by_serve[0].get("summary"), "failures": [], "by": "health.smoke"}
        result.smoke = smoke_doc
        write_json(vdir / SMOKE_FILE, smoke_doc)
    elif options.bench.smoke:
        try:
            report = smoke(options_for(planned.profile), _SmokeSteps(progress))
        except UserError as exc:
            result.status, result.why = Outcome.EXCLUDED, f"the smoke could not run: {exc.message}"
            result.smoke = {
                "passed": False,
                "failures": [exc.message],
                "summary": f"smoke could not run: {exc.message}",
            }
            write_json(vdir / SMOKE_FILE, result.smoke)
            return
        progress.smoke_done(report)
        smoke_doc = report.as_json()
        write_json(vdir / SMOKE_FILE, smoke_doc)
        result.smoke = smoke_doc
        if not report.passed:
            result.status, result.why = Outcome.EXCLUDED, report.summary()
            result.diagnosis = [_short(f) for f in report.failures]
            return
    bench = dataclasses.replace(options.bench, out=vdir, url=None, smoke=False)
    swept = command.sweep(bench, planned.profile, target, progress.sweep, None, smoke=smoke_doc, alive=alive)
    result.levels = swept.levels
    if swept.verdict is None:  # interrupted
        raise KeyboardInterrupt
    result.status, result.why, result.diagnosis = _swept_outcome(swept.levels)
    result.scaling = swept.verdict.lines[0] if swept.verdict.lines and result.status is Outcome.DONE else ""


def _swept_outcome(levels: list[Level]) -> tuple[Outcome, str, list[str]]:
    """What a finished sweep makes of its variant: excluded where a level's outputs are
    garbage (the configuration answers garbage: its speed is worth nothing, as a failed
    smoke's); failed where a level gave no figures (not a result: the rerun tries again);
    else done."""
    garbled = [lv for lv in levels if lv.garbled]
    if garbled:
        where = ", ".join(f"concurrency {lv.concurrency}" for lv in garbled)
        return (
            Outcome.EXCLUDED,
            f"its sweep's outputs are garbage at {where}: the figures time garbage, not answers",
            [f"concurrency {lv.concurrency}: {lv.garbage}" for lv in garbled],
        )
    empty = [lv for lv in levels if not lv.figures]
    if empty or not levels:
        where = ", ".join(f"concurrency {lv.concurrency}" for lv in empty) or "every level (none ran)"
        return (
            Outcome.FAILED,
            f"no figures at {where}: a level without figures is not a result (a rerun with the same --out "
            "runs this variant again)",
            [f"concurrency {lv.concurrency}: {lv.error}" for lv in empty if lv.error],
        )
    return Outcome.DONE, "", []


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keep_log(source: Path, dest: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.copyfile(source, dest)
