"""What a concurrency sweep says: one Level per concurrency from the figures sglang's own
benchmark client wrote (its --output-file JSON line), the plateau verdict, the table,
and the comparison of two sweeps. Pure: numbers in, words and rows out."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.10  # a doubling that gains less than this is a plateau
MAX_LEVEL = 1_000_000  # concurrent requests in one level (the profile model's MAX_REQUESTS)

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
    figures: dict | None  # the client's JSON line; None when it wrote none
    error: str = ""  # why the level produced no figures

    @property
    def completed(self) -> int:
        return int(self.figures.get("completed", 0)) if self.figures else 0

    @property
    def failed(self) -> int:
        return self.prompts - self.completed

    @property
    def total(self) -> float | None:
        return self.figures.get("total_throughput") if self.figures else None

    def as_json(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "prompts": self.prompts,
            "completed": self.completed,
            "failed": self.failed,
            "error": self.error,
            "figures": self.figures,
        }


def per_doubling(c1: int, t1: float, c2: int, t2: float) -> float:
    """The gain of a doubling of concurrency, when c2 / c1 is not exactly 2."""
    return (t2 / t1) ** (1 / math.log2(c2 / c1)) - 1


@dataclass(frozen=True)
class Verdict:
    plateau_from: int | None  # the level from which more concurrency stopped paying
    best: Level | None
    lines: list[str]


def verdict(levels: list[Level], threshold: float = DEFAULT_THRESHOLD, max_running: int | None = None) -> Verdict:
    """Where doubling the concurrency gains less than `threshold`, from then on, the
    throughput has plateaued: the limit is not concurrency."""
    ok = [lv for lv in levels if lv.total]
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
    if len(ok) < 2:
        return Verdict(
            None,
            ok[0] if ok else None,
            ["too few levels with figures to judge the scaling (two or more needed)", *notes],
        )
    lines = []
    best = max(ok, key=lambda lv: lv.total)
    steps = [(a, b, per_doubling(a.concurrency, a.total, b.concurrency, b.total)) for a, b in itertools.pairwise(ok)]
    flat_from = None
    for i in range(len(steps)):
        if all(gain < threshold for _, _, gain in steps[i:]):
            flat_from = steps[i][0]
            break
    gains = ", ".join(f"{b.concurrency} vs {a.concurrency}: {gain:+.1%}" for a, b, gain in steps)
    if flat_from is not None:
        last_a, last_b, last_gain = steps[-1]
        lines.append(
            f"{last_b.concurrency} vs {last_a.concurrency}: {last_gain:+.1%} — throughput has plateaued near "
            f"{int(best.total):,} tok/s from concurrency {flat_from.concurrency} on (each doubling gains under "
            f"{threshold:.0%}); the limit is not concurrency"
        )
    else:
        a, b, gain = steps[-1]
        lines.append(
            f"{b.concurrency} vs {a.concurrency}: {gain:+.1%} — still scaling at {b.total:,.0f} tok/s; "
            "a higher concurrency may give more"
        )
    lines.append(f"per doubling: {gains}")
    return Verdict(flat_from.concurrency if flat_from else None, best, lines + notes)


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def table_rows(levels: list[Level]) -> tuple[list[str], list[list[str]]]:
    headers = ["concurrency", *(c for c, _, _ in COLUMNS), "done", "failed"]
    rows = []
    for lv in levels:
        f = lv.figures or {}
        rows.append(
            [
                str(lv.concurrency),
                *(fmt(f.get(key), pattern) for _, key, pattern in COLUMNS),
                str(lv.completed),
                str(lv.failed),
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
