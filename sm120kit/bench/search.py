"""`bench --vary` / `bench --variants`: the search for the fastest configuration that still
answers right. For each runnable variant of the plan (variants.py), the profile as written
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
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sm120kit.bench import analysis
from sm120kit.bench.analysis import Level
from sm120kit.bench.command import BenchOptions
from sm120kit.bench.variants import Plan, Planned
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode
from sm120kit.patching.ledger import write_atomic

if TYPE_CHECKING:
    from sm120kit.bench import command
    from sm120kit.serve.command import ServeOptions

SEARCH_FILE = "search.json"
VARIANT_FILE = "variant.json"
SMOKE_FILE = "smoke.json"
SERVER_LOG = "server.log"
FORMAT = 1

# The estimate's assumptions where nothing measured is at hand.
SMOKE_ESTIMATE_S = 60.0  # the smoke: "well under a minute on a healthy server"
LEVEL_ESTIMATE_S = 90.0  # one client run of a level on a real server


class Outcome(str, Enum):
    DONE = "done"  # smoked (or --no-smoke) and swept: every level has figures, none of them of garbage
    EXCLUDED = "excluded"  # its smoke failed (not swept), or its sweep's outputs are garbage
    FAILED = "failed"  # swept, but a level gave no figures: not a result, runs again on a rerun
    CRASHED = "crashed"  # did not get ready, or its server died during the sweep
    REFUSED = "refused"  # serve's preflight refused to start it (the node's state): runs again on a rerun
    SKIPPED = "skipped"  # the plan: nothing started
    INTERRUPTED = "interrupted"  # Ctrl-C: runs again on a rerun
    RUNNING = "running"  # a variant.json whose bench was killed outright: runs again

    def __str__(self) -> str:
        return self.value


REFUSED_WHY = "refused by the preflight"
FINAL = frozenset({Outcome.DONE, Outcome.EXCLUDED, Outcome.CRASHED})


@dataclass(frozen=True)
class SearchOptions:
    bench: BenchOptions  # levels, lengths, repeat, smoke, out, python, patch_dirs
    serve: ServeOptions | None  # how each variant's server is started (None: never started, a test's fake)
    debug: bool = False


@dataclass
class VariantResult:
    name: str
    sets: list[str]
    status: Outcome
    why: str = ""
    levels: list[Level] = field(default_factory=list)
    smoke: dict | None = None  # SmokeReport.as_json()
    stop: dict | None = None  # the serve child's exit code and what its stop proved
    diagnosis: list[str] = field(default_factory=list)  # the supervisor's, for a crash
    seconds: float | None = None
    scaling: str = ""  # the first line of its sweep's plateau verdict
    resumed: bool = False  # found done in the directory: not run again

    @property
    def unclean(self) -> bool:
        return bool(self.stop) and self.stop.get("exit_code") == int(ExitCode.UNCLEAN)

    def as_json(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "set": self.sets,
            "status": str(self.status),
            "why": self.why,
            "levels": [lv.as_json() for lv in self.levels],
            "smoke": self.smoke,
            "stop": self.stop,
            "diagnosis": self.diagnosis,
            "seconds": self.seconds,
            "scaling": self.scaling,
        }

    @classmethod
    def skipped(cls, planned: Planned) -> VariantResult:
        """A variant the plan skipped: nothing started, why says."""
        return cls(planned.name, list(planned.variant.sets), Outcome.SKIPPED, planned.why)

    @classmethod
    def from_json(cls, doc: dict) -> VariantResult:
        return cls(
            doc["name"],
            list(doc.get("set", [])),
            Outcome(doc["status"]),
            doc.get("why", ""),
            [analysis.level_from_json(d) for d in doc.get("levels", [])],
            doc.get("smoke"),
            doc.get("stop"),
            list(doc.get("diagnosis", [])),
            doc.get("seconds"),
            doc.get("scaling", ""),
        )


@dataclass(frozen=True)
class Estimate:
    seconds: float
    lines: list[str]  # what it is made of, and from where


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
        if self.dry_run is not None or self.read_back:
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


class Progress(Protocol):
    """What a search tells as it goes (bench/render.py prints it)."""

    sweep: command.Progress  # each variant's sweep

    def planned(self, plan: Plan, directory: Path, estimate: Estimate) -> None: ...

    def resumed(self, result: VariantResult) -> None: ...

    def variant_started(self, number: int, count: int, planned: Planned) -> None: ...

    def smoke_step(self, text: str) -> None: ...

    def smoke_done(self, report) -> None: ...

    def variant_done(self, result: VariantResult) -> None: ...


# -- settings, state and resume ----------------------------------------------------------


def settings_of(options: BenchOptions, plan: Plan, base_sets: list[str]) -> dict:
    """What makes two searches' figures comparable: a rerun into the same directory must
    have the same."""
    return {
        "profile": plan.profile,
        "base_set": list(base_sets),
        "levels": options.levels,
        "repeat": options.repeat,
        "input_len": options.input_len,
        "output_len": options.output_len,
        "prompts_per_level": options.prompts_per_level,
        "smoke": options.smoke,
        "sglang": plan.variants[0].launch.sglang if plan.variants and plan.variants[0].launch else None,
    }


def default_directory(profile: str) -> Path:
    return Path("sm120kit-bench") / f"{profile}-search-{time.strftime('%Y%m%d-%H%M%S')}"


def _write_json(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, indent=2).encode())  # a Ctrl-C mid-write must not leave a broken file


def read_json(path: Path, hint: str | None = None) -> dict | None:
    """A search's JSON file (search.json, a variant.json); None when there is none."""
    hint = hint or (
        "give another --out (without it, the variants done there are not known)"
        if path.name == SEARCH_FILE
        else f"remove {path.parent} (that variant runs again) or give another --out"
    )
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({type(exc).__name__}: {exc})", hint) from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object", hint)
    return doc


def check_resumable(directory: Path, settings: dict, plan: Plan) -> dict[str, VariantResult]:
    """The variants already finished in `directory` (a rerun skips them). A directory with
    other settings, or a variant of the same name with other sets, is refused: their
    figures would not compare."""
    doc = read_json(directory / SEARCH_FILE) if directory.is_dir() else None
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is not a directory", "give a directory for the search's results")
    if doc is None:
        if directory.is_dir() and (directory / "run.json").exists():
            raise UserError(
                f"--out {directory} holds a plain sweep (run.json), not a search", "give another --out for the search"
            )
        return {}
    before = doc.get("settings", {})
    changed = [k for k in settings if before.get(k) != settings[k]]
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} then, {settings[k]!r} now" for k in changed)
        raise UserError(
            f"--out {directory} holds a search with other settings ({shown}): its figures would not compare",
            "run with the same options to resume it, or give another --out",
        )
    sets = {p.name: list(p.variant.sets) for p in plan.variants}
    done: dict[str, VariantResult] = {}
    for name in sets:
        vdoc = read_json(directory / name / VARIANT_FILE) if (directory / name).is_dir() else None
        if vdoc is None:
            continue
        try:
            result = VariantResult.from_json(vdoc)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"{directory / name / VARIANT_FILE} is damaged ({type(exc).__name__}: {exc})",
                f"remove {directory / name} (that variant runs again)",
            ) from None
        if result.sets != sets[name]:
            raise UserError(
                f"{directory / name} was variant {name} with --set {' '.join(result.sets) or '(none)'}; "
                f"now it sets {' '.join(sets[name]) or '(none)'}",
                "give another --out, or remove that directory",
            )
        if result.status in FINAL and not _without_figures(result):
            result.resumed = True
            done[name] = result
    return done


def _without_figures(result: VariantResult) -> bool:
    """A variant recorded done with a level that gave no figures (an earlier sm120kit wrote
    such a one as done): not a result, so not finished."""
    return result.status is Outcome.DONE and (not result.levels or any(not lv.figures for lv in result.levels))


def _search_doc(settings: dict, plan: Plan, results: dict[str, VariantResult]) -> dict:
    return {
        "format": FORMAT,
        "settings": settings,
        "plan": plan.as_json(),
        "status": {name: str(r.status) for name, r in results.items()},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# -- the estimate ------------------------------------------------------------------------


def last_startup_s(profile_name: str) -> float | None:
    """How long the profile's last start took to get ready, from its serve record (the
    `ready` event's after_s; the end of events.jsonl is read, not all of it)."""
    from sm120kit.serve.rundir import serve_root

    path = serve_root() / profile_name / "events.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - (256 << 10)))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            doc = json.loads(line)
            if doc.get("event") == "ready" and isinstance(doc.get("after_s"), (int, float)):
                return float(doc["after_s"])
        except ValueError:
            continue
    return None


def estimate(plan: Plan, options: BenchOptions, done: dict[str, VariantResult]) -> Estimate:
    """The time the search will take: per variant to run, the start (the profile's last
    measured start, else its startup budget health.startup_timeout_s, an upper bound), the
    smoke, each level x --repeat, and the stop (health.stop_timeout_s, an upper bound)."""
    todo = [p for p in plan.runnable if p.name not in done]
    if not todo:
        return Estimate(0.0, ["nothing to run: every runnable variant is done in the directory"])
    measured = last_startup_s(plan.profile)
    level_s = _measured_level_s(done)
    runs = len(options.levels) * options.repeat
    smoke_s = SMOKE_ESTIMATE_S if options.smoke else 0.0
    total = 0.0
    for p in todo:  # each variant's own budgets: a variant may set health.*
        start = measured if measured is not None else p.profile.health.startup_timeout_s
        total += start + smoke_s + runs * (level_s or LEVEL_ESTIMATE_S) + p.profile.health.stop_timeout_s
    health = todo[0].profile.health
    said_start = (
        f"start ~{measured:,.0f} s (the profile's last start, from its serve record)"
        if measured is not None
        else f"start up to {health.startup_timeout_s:,.0f} s (health.startup_timeout_s)"
    )
    each, all_ = _duration(total / len(todo)), _duration(total)
    lines = [
        f"{len(todo)} variant(s) to run, about {each} each: {all_} in all"
        if measured is not None  # else each start counts at its whole budget: a bound, not a guess
        else f"{len(todo)} variant(s) to run, up to ~{each} each: ~{all_} in all at most",
        f"each: {said_start}"
        + (f" + smoke ~{smoke_s:.0f} s" if smoke_s else "")
        + f" + {len(options.levels)} level(s) x {options.repeat} run(s) x ~{level_s or LEVEL_ESTIMATE_S:.0f} s"
        + (" (measured in this directory)" if level_s else " (assumed: no level measured yet)")
        + f" + stop up to {health.stop_timeout_s:g} s (health.stop_timeout_s)",
    ]
    if done:
        lines.append(f"{len(done)} variant(s) already finished in the directory are skipped")
    return Estimate(total, lines)


def _measured_level_s(done: dict[str, VariantResult]) -> float | None:
    durations = [
        (r or {}).get("duration")
        for v in done.values()
        for lv in v.levels
        for r in (lv.runs or [lv.figures])
        if r and isinstance(r.get("duration"), (int, float))
    ]
    return sum(durations) / len(durations) if durations else None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
    target,
    progress: Progress,
    width: int | None,
    out,
) -> SearchResult:
    from sm120kit.bench.serving import stop_signals_interrupt

    directory = options.bench.out or default_directory(plan.profile)
    settings = settings_of(options.bench, plan, base_sets)
    done = check_resumable(directory, settings, plan)
    directory.mkdir(parents=True, exist_ok=True)
    results: dict[str, VariantResult] = {}
    for p in plan.skipped:
        results[p.name] = VariantResult.skipped(p)
    _write_json(directory / SEARCH_FILE, _search_doc(settings, plan, results | done))
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
                _write_json(directory / SEARCH_FILE, _search_doc(settings, plan, results))
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
    from sm120kit.bench.search_report import write_report

    write_report(report)
    _write_json(directory / SEARCH_FILE, _search_doc(settings, plan, results))
    return report


class _SmokeSteps:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def step(self, text: str) -> None:
        self.progress.smoke_step(text)


def _run_variant(
    options: SearchOptions, planned: Planned, vdir: Path, target, progress: Progress, width: int | None, out
) -> VariantResult:
    from sm120kit.bench.serving import Served, served

    vdir.mkdir(parents=True, exist_ok=True)
    result = VariantResult(planned.name, list(planned.variant.sets), Outcome.RUNNING)
    _write_json(vdir / VARIANT_FILE, result.as_json())
    began = time.monotonic()
    record = _events_path(planned.profile)
    offset = record.stat().st_size if record.exists() else 0
    ready = False
    handle = Served(record)
    try:
        with served(planned.profile, planned.launch, target, options.serve, width, out, options.debug, handle):
            ready = True
            by_serve = [e for e in _events_since(record, offset) if e.get("event") == "smoke"]
            _smoke_and_sweep(options, planned, vdir, target, progress, result, by_serve[-1:], handle.alive)
    except KeyboardInterrupt:
        result.status, result.why = Outcome.INTERRUPTED, "interrupted: runs again on a rerun with the same --out"
    except UserError as exc:  # not ready; or, once ready, no longer answering
        events = _events_since(record, offset)
        result.why, result.diagnosis = _crash_from_events(events, exc.message)
        result.status = Outcome.REFUSED if result.why.startswith(REFUSED_WHY) else Outcome.CRASHED
        failed = [e for e in events if e.get("event") == "smoke" and not e.get("passed")]
        if failed and not ready:  # health.smoke: serve ran the smoke and refused to call it ready
            result.status, result.why = Outcome.EXCLUDED, f"{failed[-1].get('summary', 'smoke FAILED')} (health.smoke)"
            result.diagnosis = [_short(f) for f in failed[-1].get("failures", [])]
            result.smoke = {"passed": False, "summary": failed[-1].get("summary"), "failures": result.diagnosis}
        elif ready:
            result.why = f"{exc.message} ({result.why})" if result.why != exc.message else exc.message
        if result.status is not Outcome.REFUSED:  # refused: nothing started, the log is an earlier server's
            _keep_log(record.parent / SERVER_LOG, vdir / SERVER_LOG)
    if handle.exit_code is not None:
        events = _events_since(record, offset)  # the whole record of this variant's starts, read once
        result.stop = _stop_from_events(events, handle.exit_code)
        if ready and result.status is not Outcome.INTERRUPTED:
            died = _died_from_events(events)
            if died:  # the supervisor restarted it, or gave up: its figures are not of one server
                result.status = Outcome.CRASHED
                result.why, result.diagnosis = died
                _keep_log(record.parent / SERVER_LOG, vdir / SERVER_LOG)
            elif handle.ended_early and result.status in (Outcome.DONE, Outcome.FAILED):  # levels ran against nothing
                result.status = Outcome.CRASHED
                result.why = _stopped_early_why(events, handle.exit_code)
        if result.unclean:
            result.why = (result.why + "; " if result.why else "") + result.stop.get("said", "unclean stop")
    result.seconds = round(time.monotonic() - began, 1)
    _write_json(vdir / VARIANT_FILE, result.as_json())
    return result


def _smoke_and_sweep(
    options, planned: Planned, vdir: Path, target, progress, result: VariantResult, by_serve: list[dict], alive
) -> None:
    """Inside the served block: the smoke (serve's own, where health.smoke ran it before
    calling the server ready), then (when it passed) the sweep."""
    from sm120kit.bench import command
    from sm120kit.quality.command import options_for, smoke

    smoke_doc: dict = {"skipped": "--no-smoke"}
    if options.bench.smoke and by_serve and by_serve[0].get("passed"):
        smoke_doc = {"passed": True, "summary": by_serve[0].get("summary"), "failures": [], "by": "health.smoke"}
        result.smoke = smoke_doc
        _write_json(vdir / SMOKE_FILE, smoke_doc)
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
            _write_json(vdir / SMOKE_FILE, result.smoke)
            return
        progress.smoke_done(report)
        smoke_doc = report.as_json()
        _write_json(vdir / SMOKE_FILE, smoke_doc)
        result.smoke = smoke_doc
        if not report.passed:
            result.status, result.why = Outcome.EXCLUDED, report.summary()
            result.diagnosis = [_short(f) for f in report.failures]
            return
    bench = dataclasses.replace(options.bench, out=vdir, url=None, smoke=False)
    swept = command.sweep(bench, planned.profile, target, progress.sweep, None, smoke=smoke_doc, alive=alive)
    result.levels = swept.levels
    if swept.interrupted:
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


def _events_path(profile) -> Path:
    from sm120kit.serve.rundir import serve_root

    return serve_root() / profile.name / "events.jsonl"


def _events_since(path: Path, offset: int) -> list[dict]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    found = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                found.append(doc)
    return found


def _ends(events: list[dict]) -> tuple[list[str], list[str]]:
    """(what ended each failed start, the diagnoses' titles) from died/hung/start_timeout events."""
    what, diagnoses = [], []
    for e in events:
        if e.get("event") in ("died", "hung", "start_timeout"):
            phase = f" ({e['phase']})" if e.get("phase") and not e.get("ready") else ""
            what.append(f"{e['event'].replace('_', ' ')}{phase}: {e.get('detail', '')}")
            for d in e.get("diagnoses") or []:
                line = f"{d.get('title', d.get('id'))}: {d.get('advice', '')}".rstrip(": ")
                if line not in diagnoses:
                    diagnoses.append(line)
            if not e.get("diagnoses") and e.get("log_tail"):
                diagnoses.append("no known failure signature; the log ends: " + " | ".join(e["log_tail"][-3:]))
    return what, diagnoses


def _crash_from_events(events: list[dict], message: str) -> tuple[str, list[str]]:
    refused = [e for e in events if e.get("event") == "preflight" and not e.get("ok", True)]
    if refused:
        failed = [
            f"{c.get('check', '?')}: {c.get('detail', '')}"
            for c in refused[-1].get("checks", [])
            if c.get("status") == "fail"
        ]
        return REFUSED_WHY + (f": {'; '.join(failed)}" if failed else ""), failed
    what, diagnoses = _ends(events)
    if not what:
        return message, []
    gave_up = any(e.get("event") == "gave_up" for e in events)
    return f"{'gave up after ' if gave_up else ''}{len(what)} failed start(s); last: {what[-1]}", diagnoses


def _died_from_events(events: list[dict]) -> tuple[str, list[str]] | None:
    after_ready = False
    ends = []
    for e in events:
        if e.get("event") == "ready":
            after_ready = True
        elif after_ready and e.get("event") in ("died", "hung"):
            ends.append(e)
    if not ends:
        return None
    what, diagnoses = _ends(ends)
    return f"the server failed during the sweep: {what[-1]}", diagnoses


def _stopped_early_why(events: list[dict], exit_code: int) -> str:
    """A server whose `sm120kit serve` ended before the search stopped it: who stopped it."""
    stopping = [e for e in events if e.get("event") == "stopping"]
    by = f"{stopping[-1]['signal']} to its sm120kit serve" if stopping and stopping[-1].get("signal") else ""
    return (
        f"the server stopped during the sweep ({by or 'not by the search'}; sm120kit serve exit code "
        f"{exit_code}): its levels ran against no server"
    )


def _stop_from_events(events: list[dict], exit_code: int | None) -> dict:
    stopped = [e for e in events if e.get("event") == "stopped"]
    doc: dict = {"exit_code": exit_code}
    if stopped:
        e = stopped[-1]
        doc.update(
            clean=e.get("clean"),
            ports_taken=e.get("ports_taken") or [],
            on_gpu=e.get("on_gpu"),
            gpu_released_after_s=e.get("gpu_released_after_s"),
            left=e.get("left") or [],
        )
    if exit_code == int(ExitCode.UNCLEAN):
        bits = [*(doc.get("ports_taken") or []), *(doc.get("on_gpu") or [])]
        bits += [str(p) for p in doc.get("left") or []]
        doc["said"] = "its stop left: " + ("; ".join(bits) or "something (see the serve record)")
    return doc


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keep_log(source: Path, dest: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.copyfile(source, dest)
