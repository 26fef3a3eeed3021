"""What a concurrency sweep says: one Level per concurrency from the figures sglang's own
benchmark client wrote (its --output-file JSON line), the plateau verdict, the table,
and the comparison of two sweeps. Pure: numbers in, words and rows out."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

DEFAULT_THRESHOLD = 0.10  # a doubling that gains less than this is a plateau
MAX_LEVEL = 1_000_000  # concurrent requests in one level (the profile model's MAX_REQUESTS)
# The client's per-request lists (--output-details): read for the outputs' sample, not kept as figures.
DETAILS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "cached_tokens",
    "cached_tokens_details",
)
SAMPLED_OUTPUTS = 64  # generated texts of one client run read through the smoke's garbage detectors
# A level whose sampled outputs are garbage past this share is not a result. Not any one: the
# prompts are random token ids and the client ignores EOS, so a healthy model may loop or cut a
# character in two now and then; a broken numeric path or stream garbles (nearly) all of them.
GARBAGE_SHARE = 0.5

# (column, key in the client's JSON line, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("total tok/s", "total_throughput", "{:,.1f}"),
    ("input tok/s", "input_throughput", "{:,.1f}"),
    ("output tok/s", "output_throughput", "{:,.1f}"),
    ("peak out tok/s", "max_output_tokens_per_s", "{:,.0f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:,.0f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:,.0f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.1f}"),
    ("TPOT p99 ms", "p99_tpot_ms", "{:.1f}"),
    ("ITL p50 ms", "median_itl_ms", "{:.1f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.1f}"),
)


class BadLevels(ValueError):
    pass


def parse_levels(text: str) -> list[int]:
    """ "64,128,256" -> [64, 128, 256]: positive whole numbers, each once, ascending."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise BadLevels("the concurrency list is empty")
    bad = [t for t in items if not t.isdigit() or not 1 <= int(t) <= MAX_LEVEL]
    if bad:
        raise BadLevels(f"{', '.join(map(repr, bad))} is not a whole number from 1 to {MAX_LEVEL}")
    return sorted({int(t) for t in items})


@dataclass
class Level:
    concurrency: int
    prompts: int
    figures: dict | None  # the client's JSON line (with --repeat: the median of each figure); None: none
    error: str = ""  # why the level (or, with --repeat, one of its runs) produced no figures
    runs: list[dict | None] = field(default_factory=list)  # with --repeat: each run's JSON line (None: none)
    outputs: dict | None = None  # what the garbage detectors found in a sample of its generated texts

    @property
    def garbled(self) -> bool:
        """Its sampled outputs are garbage (GARBAGE_SHARE): its figures time garbage."""
        o = self.outputs or {}
        return bool(o.get("sampled")) and o.get("flagged", 0) > GARBAGE_SHARE * o["sampled"]

    @property
    def garbage(self) -> str:
        """ "bang in 16 of 16 sampled outputs (e.g. '!!!!...')": what the detectors found."""
        o = self.outputs or {}
        fired = ", ".join(f"{name} in {n}" for name, n in (o.get("detectors") or {}).items() if n)
        example = f" (e.g. {o['example']})" if o.get("example") else ""
        return f"{fired or 'nothing'} of {o.get('sampled', 0)} sampled outputs{example}"

    @property
    def completed(self) -> int:
        return int(self.figures.get("completed", 0)) if self.figures else 0

    @property
    def failed(self) -> int:
        return self.prompts - self.completed

    @property
    def total(self) -> float | None:
        return self.figures.get("total_throughput") if self.figures else None

    @property
    def measured_total(self) -> float:
        """The total tok/s of a level known to have one (its callers keep only levels with a total)."""
        total = self.total
        if total is None:
            raise ValueError(f"concurrency {self.concurrency} has no total tok/s")
        return total

    @property
    def totals(self) -> list[float]:
        """The total tok/s of each run that gave one (one run without --repeat)."""
        if self.runs:
            return [r["total_throughput"] for r in self.runs if r and r.get("total_throughput")]
        return [self.total] if self.total else []

    @property
    def bounds(self) -> tuple[float, float] | None:
        """(lowest, highest) run's total tok/s: the spread; a single run is its own bounds."""
        totals = self.totals
        return (min(totals), max(totals)) if totals else None

    @property
    def measured_bounds(self) -> tuple[float, float]:
        """bounds of a level known to have a total: its own total twice when it has no runs' spread."""
        return self.bounds or (self.measured_total, self.measured_total)

    @property
    def spread(self) -> float | None:
        """(highest - lowest) / median of the runs' totals; None with fewer than two runs."""
        totals = self.totals
        if len(totals) < 2 or not self.total:
            return None
        return (max(totals) - min(totals)) / self.total

    def as_json(self) -> dict:
        doc = {
            "concurrency": self.concurrency,
            "prompts": self.prompts,
            "completed": self.completed,
            "failed": self.failed,
            "error": self.error,
            "figures": self.figures,
        }
        if self.runs:
            low, high = self.bounds or (None, None)
            doc.update(runs=self.runs, total_min=low, total_max=high)
        if self.outputs is not None:
            doc["outputs"] = self.outputs
        return doc


def sample_outputs(doc: dict) -> dict | None:
    """The smoke's garbage detectors over up to SAMPLED_OUTPUTS of the texts one client run
    generated (its --output-details: generated_texts, errors), spread over the run; the
    requests that failed are not read. None when the run wrote no texts."""
    from sm120kit.quality import detectors

    texts, errors = doc.get("generated_texts"), doc.get("errors")
    if not isinstance(texts, list):
        return None
    errors = errors if isinstance(errors, list) and len(errors) == len(texts) else [None] * len(texts)
    answered = [t for t, e in zip(texts, errors) if isinstance(t, str) and not e]
    step = max(1, len(answered) / SAMPLED_OUTPUTS)
    sample = [answered[int(k * step)] for k in range(min(SAMPLED_OUTPUTS, len(answered)))]
    counts = dict.fromkeys(detectors.NAMES, 0)
    flagged, example = 0, ""
    for text in sample:
        fired = detectors.flags(detectors.Output(text))
        for name in fired:
            counts[name] += 1
        if fired:
            flagged += 1
            example = example or f"{fired[0]}: {text[:40]!r}{'...' if len(text) > 40 else ''}"
    return {"sampled": len(sample), "flagged": flagged, "detectors": counts, "example": example}


def merge_outputs(found: list[dict | None]) -> dict | None:
    """The samples of several runs of one level (--repeat), added up."""
    samples = [o for o in found if o]
    if not samples:
        return None
    counts = {name: sum(o["detectors"].get(name, 0) for o in samples) for name in samples[0]["detectors"]}
    return {
        "sampled": sum(o["sampled"] for o in samples),
        "flagged": sum(o["flagged"] for o in samples),
        "detectors": counts,
        "example": next((o["example"] for o in samples if o["example"]), ""),
    }


def median_figures(runs: list[dict | None]) -> dict | None:
    """One JSON line from several runs' lines: the median of each number; the rest as the
    first run has it."""
    ok = [r for r in runs if r]
    if not ok:
        return None
    merged = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers = [n for r in ok if isinstance(n := r.get(key), (int, float)) and not isinstance(n, bool)]
            merged[key] = statistics.median(numbers)
    return merged


def level_from_json(d: dict) -> Level:
    outputs = d.get("outputs") if isinstance(d.get("outputs"), dict) else None
    return Level(d["concurrency"], d["prompts"], d["figures"], d.get("error", ""), d.get("runs") or [], outputs)


def per_doubling(c1: int, t1: float, c2: int, t2: float) -> float:
    """The gain of a doubling of concurrency, when c2 / c1 is not exactly 2."""
    return (t2 / t1) ** (1 / math.log2(c2 / c1)) - 1


@dataclass(frozen=True)
class Verdict:
    plateau_from: int | None  # the level from which more concurrency stopped paying
    best: Level | None
    lines: list[str]


def _step(a: Level, b: Level) -> tuple[float, float, float]:
    """(gain per doubling of the medians, lowest, highest gain the runs allow)."""
    (a_lo, a_hi), (b_lo, b_hi) = a.measured_bounds, b.measured_bounds
    gain = per_doubling(a.concurrency, a.measured_total, b.concurrency, b.measured_total)
    low = per_doubling(a.concurrency, a_hi, b.concurrency, b_lo)
    high = per_doubling(a.concurrency, a_lo, b.concurrency, b_hi)
    return gain, min(low, gain), max(high, gain)


def verdict(levels: list[Level], threshold: float = DEFAULT_THRESHOLD, max_running: int | None = None) -> Verdict:
    """Where doubling the concurrency gains less than `threshold`, from then on, the
    throughput has plateaued: the limit is not concurrency. With --repeat, a step counts
    as flat only when even its highest gain the runs allow (the lowest run before, the
    highest after) is under the threshold, and as scaling only when even its lowest is at
    or above it; between the two it is within noise, and said so."""
    ok = [lv for lv in levels if lv.total]
    garbage = [
        f"concurrency {lv.concurrency}: its outputs are GARBAGE: {lv.garbage} — these figures time garbage, not answers"
        for lv in levels
        if lv.garbled
    ]
    notes = []
    if max_running:
        over = [lv.concurrency for lv in levels if lv.concurrency > max_running]
        if over:
            notes.append(
                f"levels {', '.join(map(str, over))} exceed the server's max running requests ({max_running}): "
                "the excess only queues"
            )
    for lv in levels:
        if lv.failed:
            notes.append(
                f"concurrency {lv.concurrency}: {lv.failed} of {lv.prompts} requests failed"
                + (f" ({lv.error})" if lv.error else "")
            )
        elif lv.error and lv.figures:
            notes.append(f"concurrency {lv.concurrency}: {lv.error}")
    repeated = any(len(lv.totals) > 1 for lv in ok)
    if len(ok) < 2:
        return Verdict(
            None,
            ok[0] if ok else None,
            [*garbage, "too few levels with figures to judge the scaling (two or more needed)", *notes],
        )
    lines = []
    best = max(ok, key=lambda lv: lv.measured_total)
    steps = [(a, b, *_step(a, b)) for a, b in itertools.pairwise(ok)]
    flat_from = None
    for i in range(len(steps)):
        if all(high < threshold for *_, high in steps[i:]):
            flat_from = steps[i][0]
            break

    def span(low: float, high: float) -> str:
        return f" (runs: {low:+.1%} .. {high:+.1%})" if repeated else ""

    gains = ", ".join(f"{b.concurrency} vs {a.concurrency}: {gain:+.1%}{span(lo, hi)}" for a, b, gain, lo, hi in steps)
    last_a, last_b, last_gain, last_lo, last_hi = steps[-1]
    if flat_from is not None:
        lines.append(
            f"{last_b.concurrency} vs {last_a.concurrency}: {last_gain:+.1%} — throughput has plateaued near "
            f"{int(best.measured_total):,} tok/s from concurrency {flat_from.concurrency} on "
            f"(each doubling gains under {threshold:.0%}); the limit is not concurrency"
        )
    elif last_lo >= threshold:
        lines.append(
            f"{last_b.concurrency} vs {last_a.concurrency}: {last_gain:+.1%} — still scaling at {last_b.total:,.0f} "
            "tok/s; a higher concurrency may give more"
        )
    else:
        lines.append(
            f"{last_b.concurrency} vs {last_a.concurrency}: {last_gain:+.1%}{span(last_lo, last_hi)} — within noise: "
            f"the runs' spread straddles the {threshold:.0%} threshold, so this sweep cannot tell a plateau from "
            "scaling here; more runs per level (--repeat) or more prompts per level narrow it"
        )
    lines.append(f"per doubling: {gains}")
    if repeated:
        widest = max((lv for lv in ok if lv.spread is not None), key=lambda lv: lv.spread or 0.0)
        low, high = widest.measured_bounds
        lines.append(
            f"each level: the median of {max(len(lv.totals) for lv in ok)} runs; spread = lowest .. highest run "
            f"(widest at concurrency {widest.concurrency}: {low:,.1f} .. {high:,.1f} "
            f"tok/s, {widest.spread:.1%} of the median)"
        )
    return Verdict(flat_from.concurrency if flat_from else None, best, garbage + lines + notes)


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def spread_text(level: Level) -> str:
    """ "900.1 .. 930.4 (3.3%)": the lowest and highest run's total tok/s; "-" for one run."""
    if level.spread is None:
        return "-"
    low, high = level.measured_bounds
    return f"{low:,.1f} .. {high:,.1f} ({level.spread:.1%})"


def table_rows(levels: list[Level]) -> tuple[list[str], list[list[str]]]:
    """One row per level; with --repeat a last column, the spread of the runs' totals."""
    repeated = any(lv.runs for lv in levels)
    headers = ["concurrency", *(c for c, _, _ in COLUMNS), "done", "failed", *(["total spread"] if repeated else [])]
    rows = []
    for lv in levels:
        f = lv.figures or {}
        rows.append(
            [
                str(lv.concurrency),
                *(fmt(f.get(key), pattern) for _, key, pattern in COLUMNS),
                str(lv.completed),
                str(lv.failed),
                *([spread_text(lv)] if repeated else []),
            ]
        )
    return headers, rows


def compare_rows(before: list[Level], after: list[Level]) -> tuple[list[str], list[list[str]]]:
    """Per concurrency in either run: total and output tok/s, TTFT and ITL p50, with ratios."""
    keys = (
        ("total tok/s", "total_throughput", "{:,.1f}"),
        ("output tok/s", "output_throughput", "{:,.1f}"),
        ("TTFT p50 ms", "median_ttft_ms", "{:,.0f}"),
        ("ITL p50 ms", "median_itl_ms", "{:.1f}"),
    )
    a = {lv.concurrency: lv.figures or {} for lv in before}
    b = {lv.concurrency: lv.figures or {} for lv in after}
    headers = ["concurrency"]
    for name, _, _ in keys:
        headers += [f"{name} before", "after", "ratio"]
    rows = []
    for c in sorted(set(a) | set(b)):
        row = [str(c)]
        for _, key, pattern in keys:
            x, y = a.get(c, {}).get(key), b.get(c, {}).get(key)
            ratio = f"{y / x:.2f}x" if x and y is not None else "-"
            row += [fmt(x, pattern), fmt(y, pattern), ratio]
        rows.append(row)
    return headers, rows
