"""tune-moe's report as text: the shape, the candidates that fit sm_120, where the table goes,
and (after timing) the best config per batch size against sglang's default, fitted to a width."""

from __future__ import annotations

from sm120kit import report
from sm120kit.tune.command import TuneReport


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
        lines += ["", timing_table(r, width)]
    lines += [report.wrap(note, width) for note in r.notes]
    return "\n".join(lines)


def compiled_by(r: TuneReport) -> str:
    if r.compiler_python:
        return f"with Triton {r.compiler} of the target's {r.compiler_python}: sm120kit's environment has none"
    return f"here with Triton {r.compiler}"


def timing_table(r: TuneReport, width: int | None) -> str:
    rows = []
    for row in r.timing.rows:
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
