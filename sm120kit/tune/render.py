"""tune-moe's report as text: the shape, the candidates that fit sm_120, where the table goes,
and (after timing) the best config per batch size against sglang's default, fitted to a width;
and the MoE config tables that tune-moe installed, as `status` lists them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from sm120kit import report
from sm120kit.followup import complete

if TYPE_CHECKING:  # `status` lists the installed tables: it need not load the tune-moe command
    from sm120kit.tune.installed import InstalledTable, Inventory
    from sm120kit.tune.timing_result import TimingResult
    from sm120kit.tune.tune_report import TuneReport


def tile(config: dict) -> str:
    """128x64x128 w4 s3 g16: BLOCK_SIZE_M x N x K, warps, stages, GROUP_SIZE_M."""
    c = config
    return (
        f"{c['BLOCK_SIZE_M']}x{c['BLOCK_SIZE_N']}x{c['BLOCK_SIZE_K']} "
        f"w{c.get('num_warps', 4)} s{c.get('num_stages', 3)} g{c.get('GROUP_SIZE_M', 1)}"
    )


def shape_line(r: TuneReport) -> str:
    s = r.shape
    quant = s.dtype or "bf16/fp16"
    if s.block_shape and all(s.block_shape):
        quant += f" block {list(s.block_shape)}"
    if s.per_channel_quant:
        quant += " per-channel"
    return (
        f"E={s.experts} N={s.shard} (hidden {s.hidden}, intermediate {s.intermediate} per GPU), top-{s.top_k}, {quant}"
    )


def text(r: TuneReport, width: int | None) -> str:
    fit = len(r.fitting)
    lines = [
        f"sm120kit tune-moe {r.profile}",
        report.wrap(f"shape: {shape_line(r)}" + (f" ({r.shape.model})" if r.shape.model else ""), width),
        report.wrap(f"sglang {r.sglang}, Triton {r.triton or 'not installed'}; kernel: {r.kernel}", width),
        report.wrap(
            f"candidates: {r.space} in sglang's tuning space; {fit} fit sm_120's 101376 B of shared memory "
            f"(largest {r.largest_fit} B), {r.space - fit} do not (compiled {compiled_by(r)})",
            width,
        ),
    ]
    if r.rejected:
        worst = ", ".join(f"{tile(x['config'])}: {x['shared']} B" for x in r.rejected[:3])
        lines.append(report.wrap(f"too large, e.g. {worst}", width, indent="  "))
    if r.device_name:
        lines.append(report.wrap(f"GPU: {r.device_name}", width))
    if r.loads_now:
        over = len(r.loads_now_over)
        verdict = f"{over} of its configs do not fit sm_120" if over else "every config fits sm_120"
        lines.append(report.wrap(f"sglang loads now: {r.loads_now} ({verdict})", width))
    elif r.destination:
        lines.append(report.wrap("sglang loads now: no tuned file for this shape and GPU: its default configs", width))
    if r.destination:
        lines.append(report.wrap(f"tuned table goes to: {r.destination}", width))
    lines.append(report.wrap(f"batch sizes: {', '.join(map(str, r.batch_sizes))}", width))
    if r.timing is not None:
        lines += ["", timing_table(r.timing, width)]
    lines += [report.wrap(note, width) for note in r.notes]
    return "\n".join(lines)


def compiled_by(r: TuneReport) -> str:
    if r.compiler_python:
        return f"with Triton {r.compiler} of the target's {r.compiler_python}: sm120kit's environment has none"
    return f"here with Triton {r.compiler}"


def timing_table(timing: TimingResult, width: int | None) -> str:
    rows = []
    for row in timing.rows:
        rows.append(
            [
                str(row.batch_size),
                f"{row.default_us:.1f}" if row.default_us else "-",
                f"{row.best_us:.1f}" if row.best_us else "-",
                f"{row.speedup:.2f}x" if row.speedup else "-",
                tile(row.best) if row.best else "-",
            ]
        )
    return report.table(["batch", "default us", "tuned us", "speedup", "best config"], rows, width)


# -- the tables tune-moe installed (status) ---------------------------------------------


def tuned_json(inventory: Inventory) -> dict:
    return {
        "tuned": [t.as_json() for t in inventory.tables],
        "tuned_problems": inventory.problems,
        "tuned_notes": inventory.notes,
    }


def print_tuned(inventory: Inventory, width: int | None = None) -> None:
    """`status`: the MoE config tables tune-moe installed, after the patches (a command
    they name spelled for the running invocation)."""
    for problem in inventory.problems:
        print(report.error_text(f"error: {complete(problem)}", wide=width is None), file=sys.stderr)
    for note in inventory.notes:
        print(report.wrap(complete(note), width))
    if inventory.tables:
        print()
        print(tuned_table(inventory.tables, width))


def _config_name(t: InstalledTable) -> str:
    """The file name without the GPU (its own column) and .json: E=..,N=..[,dtype=..][_down]."""
    device = t.entry.device_name.replace(" ", "_")
    return t.path.name.replace(f",device_name={device}", "").removesuffix(".json")


def tuned_table(tables: list[InstalledTable], width: int | None = None) -> str:
    """One row per table: what it is for (sglang, Triton, when) and its state. Fitted to a
    width, the GPU, the file and what the installed sglang makes of it follow on a line of
    their own; with --wide they are the last columns."""
    headers = ["MOE CONFIG", "KIND", "SGLANG", "TRITON", "TUNED", "STATE"]
    rows = [
        [
            _config_name(t),
            t.entry.kind,
            t.entry.version,
            t.entry.triton_version,
            t.entry.tuned_at[:10] or report.NONE,
            t.state.value + (" (stale)" if t.stale and t.entry.kind == "tuned" else ""),
        ]
        for t in tables
    ]
    if width is None:
        return report.table(
            [*headers, "GPU", "FILE", "NOTE"],
            [[*r, t.entry.device_name, str(t.path), complete(t.note)] for r, t in zip(rows, tables)],
        )
    notes = [f"{t.entry.device_name}: {t.path}: {complete(t.note)}" for t in tables]
    return report.table(headers, rows, width, narrow=(0,), notes=notes)
