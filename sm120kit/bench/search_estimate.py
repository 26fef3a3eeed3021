"""How long a search will take, said before it starts (and by --dry-run): from the profile's
last measured start, the levels timed in the directory, or the health budgets."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sm120kit.bench.command import BenchOptions
from sm120kit.bench.search_state import VariantResult
from sm120kit.bench.variants import Plan

# The estimate's assumptions where nothing measured is at hand.
SMOKE_ESTIMATE_S = 60.0  # the smoke: "well under a minute on a healthy server"
LEVEL_ESTIMATE_S = 90.0  # one client run of a level on a real server


@dataclass(frozen=True)
class Estimate:
    seconds: float
    lines: list[str]  # what it is made of, and from where


def last_startup_s(profile_name: str) -> float | None:
    """How long the profile's last start took to get ready, from its serve record (the
    `ready` event's after_s; the end of events.jsonl is read, not all of it)."""
    from sm120kit.serve.record_schema import event_line
    from sm120kit.serve.rundir import serve_root
    from sm120kit.serve.status import EventKind

    path = serve_root() / profile_name / "events.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - (256 << 10)))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        doc = event_line(line)
        if doc is not None and doc["event"] is EventKind.READY and isinstance(doc.get("after_s"), (int, float)):
            return float(doc["after_s"])
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
    each, all_ = duration(total / len(todo)), duration(total)
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
        r["duration"]
        for v in done.values()
        for lv in v.levels
        for r in (lv.runs or [lv.figures])
        if r and isinstance(r.get("duration"), (int, float))
    ]
    return sum(durations) / len(durations) if durations else None


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
