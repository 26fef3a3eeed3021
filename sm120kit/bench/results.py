"""A sweep's results directory, enough to reproduce it and to compare it later:

run.json      what ran: profile, URL, client command, versions, patch status, levels
c<N>.jsonl    the client's own output file for each level, untouched (with --repeat K:
              c<N>.r1.jsonl .. c<N>.rK.jsonl, one per run)
c<N>.log      the client's console output for each level (c<N>.r<k>.log)
results.csv   one row per level (with --repeat: the median of the runs, and their spread)
summary.md    the table and the verdict, and the smoke's verdict
plot.png      throughput vs concurrency, TTFT / ITL percentiles (with matplotlib)
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sm120kit.atomic_write import write_atomic
from sm120kit.bench.analysis import COLUMNS, Level, Verdict, level_from_json, table_rows
from sm120kit.errors import UserError

RUN_FILE = "run.json"


def write_run(directory: Path, meta: dict, levels: list[Level], verdict: Verdict | None, finished: bool) -> dict:
    """run.json, replaced whole; returns what was written."""
    doc = {
        **meta,
        "finished": finished,
        "levels": [lv.as_json() for lv in levels],
        "verdict": verdict.lines if verdict else [],
    }
    write_atomic(directory / RUN_FILE, json.dumps(doc, indent=2).encode())  # a Ctrl-C mid-write: the old run.json
    return doc


def write_tables(directory: Path, meta: dict, levels: list[Level], verdict: Verdict) -> None:
    with open(directory / "results.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "concurrency",
                "prompts",
                "completed",
                "failed",
                *(key for _, key, _ in COLUMNS),
                "runs",
                "total_throughput_min",
                "total_throughput_max",
            ]
        )
        for lv in levels:
            f = lv.figures or {}
            low, high = lv.bounds or ("", "")
            writer.writerow(
                [
                    lv.concurrency,
                    lv.prompts,
                    lv.completed,
                    lv.failed,
                    *(f.get(key, "") for _, key, _ in COLUMNS),
                    len(lv.totals),
                    low,
                    high,
                ]
            )
    headers, rows = table_rows(levels)
    md = [f"# sm120kit bench: {meta.get('title', '')}", ""]
    smoke = meta.get("smoke")
    if smoke is not None:
        md += [f"**{smoke_line(smoke)}**", ""]
    md += [f"- {k}: `{v}`" for k, v in meta.get("summary", {}).items()]
    md += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", *(f"- {line}" for line in verdict.lines), ""]
    (directory / "summary.md").write_text("\n".join(md))


def smoke_line(smoke: dict) -> str:
    """The smoke's verdict as run.json records it (SmokeReport.as_json, or a skip)."""
    if smoke.get("skipped"):
        return f"smoke skipped ({smoke['skipped']})"
    if smoke.get("summary"):
        return smoke["summary"]
    return "smoke passed" if smoke.get("passed") else "smoke FAILED: " + "; ".join(smoke.get("failures", []))


def write_plot(directory: Path, title: str, levels: list[Level]) -> str | None:
    """plot.png; None when matplotlib is missing (a one-line note instead)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot.png skipped: matplotlib is not installed (pip install 'sm120kit[plot]')"
    ok = [lv for lv in levels if lv.figures]
    if not ok:
        return "plot.png skipped: no level has figures"
    xs = [lv.concurrency for lv in ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (
        ("total_throughput", "total"),
        ("output_throughput", "output"),
        ("max_output_tokens_per_s", "peak output"),
    ):
        left.plot(xs, [(lv.figures or {}).get(key) for lv in ok], marker="o", label=label)
    left.set(xscale="log", xlabel="concurrency", ylabel="tok/s", title="throughput")
    left.set_xticks(xs, [str(x) for x in xs])
    left.legend()
    for key, label in (
        ("median_ttft_ms", "TTFT p50"),
        ("p99_ttft_ms", "TTFT p99"),
        ("median_itl_ms", "ITL p50"),
        ("p99_itl_ms", "ITL p99"),
    ):
        right.plot(xs, [(lv.figures or {}).get(key) for lv in ok], marker="o", label=label)
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency")
    right.set_xticks(xs, [str(x) for x in xs])
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(directory / "plot.png", dpi=110)
    plt.close(fig)
    return None


def load_run(directory: str) -> tuple[dict, list[Level]]:
    path = Path(directory) / RUN_FILE
    if not Path(directory).is_dir():
        raise UserError(
            f"{directory} does not exist" if not Path(directory).exists() else f"{directory} is not a directory",
            "pass two directories that `sm120kit bench` wrote",
        )
    try:
        doc = json.loads(path.read_text())
        levels = [level_from_json(d) for d in doc["levels"]]
    except FileNotFoundError:
        raise UserError(
            f"{directory} is not a results directory (no {RUN_FILE})",
            "pass two directories that `sm120kit bench` wrote",
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{path} cannot be read ({type(exc).__name__}: {exc})", "pass a directory that `sm120kit bench` wrote"
        ) from None
    return doc, levels
