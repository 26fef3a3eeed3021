"""The search's report: the best variant per concurrency and overall (named only where it
beats the next by more than the spread), its gain over as-written, how to adopt it, and
the files a search directory holds for it (summary.md, results.csv, plot.png); and a
search directory read back for `bench compare RUN_DIR`."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

from sm120kit.bench.analysis import Level
from sm120kit.bench.search_result import Pick, SearchResult
from sm120kit.bench.search_state import SEARCH_FILE, VARIANT_FILE, Outcome, VariantResult, read_json
from sm120kit.bench.variants import BASELINE, Plan, Planned, profile_snippet
from sm120kit.errors import UserError


def _beats(a: Level, b: Level) -> bool:
    """a beats b by more than the spread: a's lowest run above b's highest."""
    return a.measured_bounds[0] > b.measured_bounds[1]


def picks(results: list[VariantResult], repeated: bool) -> tuple[list[Pick], list[str]]:
    """The best variant at each concurrency and overall (each at its best level), named
    only when it beats the next by more than the spread (its lowest run above the next
    one's highest); its gain over as-written, "within noise" where their runs overlap."""
    done = [r for r in results if r.status is Outcome.DONE]
    # a level that lost requests did not do the same work: it is not ranked
    swept = {
        r.name: {lv.concurrency: lv for lv in r.levels if lv.total and not lv.failed and not lv.garbled} for r in done
    }
    swept = {name: lv for name, lv in swept.items() if lv}
    unranked = [
        f"not ranked: {r.name} at concurrency {lv.concurrency}: {lv.failed} of {lv.prompts} requests failed"
        for r in done
        for lv in r.levels
        if lv.total and lv.failed
    ]
    found: list[Pick] = []
    if not swept:
        return [], [*unranked, "no variant was swept: nothing to compare"]
    lines: list[str] = []
    concurrencies = sorted({c for levels in swept.values() for c in levels})
    for c in [*concurrencies, None]:
        if c is None:
            at = {n: max(levels.values(), key=lambda lv: lv.measured_total) for n, levels in swept.items()}
        else:
            at = {n: levels[c] for n, levels in swept.items() if c in levels}
        ranked = sorted(at.items(), key=lambda kv: kv[1].measured_total, reverse=True)
        leader, top = ranked[0]
        where = f"concurrency {c}" if c is not None else "overall (each variant at its best level)"
        level_note = f" at concurrency {top.concurrency}" if c is None else ""
        text = f"{where}: {leader} {top.total:,.1f} tok/s{level_note}"
        best: str | None = leader
        if len(ranked) > 1:
            second, nxt = ranked[1]
            gain = top.measured_total / nxt.measured_total - 1
            if _beats(top, nxt):
                text += f", {gain:+.1%} over the next, {second}" + (
                    f" ({nxt.total:,.1f})" if second == BASELINE else ""
                )
            else:
                best = None
                text += (
                    f"; {second} {nxt.total:,.1f} ({gain:+.1%}) is within noise of it (their runs overlap: "
                    f"{_span(top)} vs {_span(nxt)}): no best variant here"
                )
        base = at.get(BASELINE)
        if best is not None and leader != BASELINE and base is not None and ranked[1][0] != BASELINE:
            gain = top.measured_total / base.measured_total - 1
            noise = "" if _beats(top, base) else ", within noise"
            text += f"; {gain:+.1%} over {BASELINE} ({base.total:,.1f}{noise})"
        elif best == BASELINE:
            text += f" ({BASELINE} is the best: nothing to adopt)" if c is None else ""
        found.append(Pick(c, best, leader, text))
        lines.append(text)
    lines += unranked
    if BASELINE not in swept:
        lines.append(f"{BASELINE} has no figures: no gain over the profile as written can be given")
    if not repeated:
        lines.append("one run per level: no spread measured, so any lead counts; --repeat 3 measures the noise")
    return found, lines


def _span(level: Level) -> str:
    low, high = level.measured_bounds
    return f"{low:,.1f} .. {high:,.1f}"


def adoption(plan: Plan, overall: Pick | None, base_sets: list[str]) -> dict | None:
    """The --set line and a profile snippet for the overall winner (none for as-written)."""
    if overall is None or overall.best in (None, BASELINE):
        return None
    planned = next(p for p in plan.variants if p.name == overall.best)
    sets = [*base_sets, *planned.variant.sets]
    words = " ".join([*map(shlex.quote, plan.serve_args), *(f"--set {shlex.quote(w)}" for w in sets)])
    return {
        "variant": planned.name,
        "set": sets,
        "command": f"sm120kit serve {plan.profile} {words}",
        "snippet": profile_snippet(plan.profile, tuple(sets)),
    }


def verdict_lines(report: SearchResult) -> list[str]:
    """Everything summary.md and the text output say below the table."""
    repeated = report.settings.get("repeat", 1) > 1
    found, lines = picks(report.results, repeated)
    report.picks = found
    overall = next((p for p in found if p.concurrency is None), None)
    report.adopt = adoption(report.plan, overall, report.settings.get("base_set", []))
    for r in report.results:
        if r.status is Outcome.EXCLUDED:
            by = "the smoke" if (r.smoke or {}).get("passed") is False else "its sweep's outputs"
            lines.append(f"excluded by {by}: {r.name}: {r.why}" + "".join(f"\n    {d}" for d in r.diagnosis))
        elif r.status is Outcome.FAILED:
            lines.append(f"failed: {r.name}: {r.why}" + "".join(f"\n    {d}" for d in r.diagnosis))
        elif r.status is Outcome.CRASHED:
            lines.append(f"crashed: {r.name}: {r.why}" + "".join(f"\n    diagnosis: {d}" for d in r.diagnosis))
        elif r.status is Outcome.REFUSED:
            lines.append(f"refused: {r.name}: {r.why} (the node's state: a rerun with the same --out tries it again)")
        elif r.status is Outcome.SKIPPED:
            lines.append(f"skipped: {r.name}: {r.why}")
        elif r.status is Outcome.INTERRUPTED:
            lines.append(f"interrupted: {r.name} (runs again on a rerun with the same --out)")
        if (
            r.stop
            and r.stop.get("exit_code") not in (None, 0)
            and not r.unclean
            and r.status
            not in (
                Outcome.CRASHED,
                Outcome.REFUSED,
            )
        ):
            lines.append(f"{r.name}: sm120kit serve ended with exit code {r.stop['exit_code']}")
    lines += [f"{r.name} alone: {r.scaling}" for r in report.results if r.status is Outcome.DONE and r.scaling]
    resumed = [r.name for r in report.results if r.resumed]
    if resumed:
        lines.append(f"already done in the directory, not run again: {', '.join(resumed)}")
    if report.stopped_early:
        lines.append(f"STOPPED EARLY: {report.stopped_early}")
    not_run = [p.name for p in report.plan.runnable if p.name not in {r.name for r in report.results}]
    if not_run:
        lines.append(f"not run: {', '.join(not_run)} (a rerun with the same --out runs them)")
    return lines


def table(report: SearchResult) -> tuple[list[str], list[list[str]]]:
    """Variants x concurrency: the median total tok/s (with --repeat, its spread)."""
    concurrencies = report.settings.get("levels") or sorted({lv.concurrency for r in report.results for lv in r.levels})
    headers = ["variant", "status", *(f"c{c}" for c in concurrencies)]
    rows = []
    for r in report.results:
        by_c = {lv.concurrency: lv for lv in r.levels}
        cells = []
        for c in concurrencies:
            lv = by_c.get(c)
            if lv is None or not lv.total:
                cells.append("-")
            elif lv.spread is not None:
                cells.append(f"{lv.total:,.1f} ±{lv.spread / 2:.1%}")
            else:
                cells.append(f"{lv.total:,.1f}")
        rows.append([r.name, str(r.status), *cells])
    return headers, rows


def write_report(report: SearchResult) -> None:
    report.lines = verdict_lines(report)
    d = report.directory
    with open(d / "results.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "variant",
                "status",
                "concurrency",
                "runs",
                "total_throughput",
                "total_throughput_min",
                "total_throughput_max",
                "spread",
                "output_throughput",
                "median_ttft_ms",
                "median_itl_ms",
                "completed",
                "failed",
            ]
        )
        for r in report.results:
            for lv in r.levels:
                f = lv.figures or {}
                low, high = lv.bounds or ("", "")
                writer.writerow(
                    [
                        r.name,
                        str(r.status),
                        lv.concurrency,
                        len(lv.totals),
                        f.get("total_throughput", ""),
                        low,
                        high,
                        "" if lv.spread is None else round(lv.spread, 4),
                        f.get("output_throughput", ""),
                        f.get("median_ttft_ms", ""),
                        f.get("median_itl_ms", ""),
                        lv.completed,
                        lv.failed,
                    ]
                )
    headers, rows = table(report)
    s = report.settings
    md = [
        f"# sm120kit bench search: {report.plan.profile}",
        "",
        f"- variants from: `{report.plan.source}`",
        f"- concurrency: {', '.join(map(str, s['levels']))}; {s['repeat']} run(s) per level"
        + ("; a cell is the median of the runs ± half their spread (lowest .. highest run)" if s["repeat"] > 1 else ""),
        f"- input {s['input_len']} / output {s['output_len']} tokens; smoke: {'on' if s['smoke'] else 'off'}",
        *(f"- note: {n}" for n in report.plan.notes),
        "",
        "total tok/s:",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *(f"- {line}" for line in report.lines),
    ]
    if report.adopt:
        md += [
            "",
            f"## Adopt {report.adopt['variant']}",
            "",
            "```",
            report.adopt["command"],
            "```",
            "",
            "or as a profile (e.g. profiles/" + f"{report.plan.profile}-tuned.toml):",
            "",
            "```toml",
            report.adopt["snippet"],
            "```",
        ]
    (d / "summary.md").write_text("\n".join(md) + "\n")
    report.plot_note = write_plot(d, report)


def write_plot(directory: Path, report: SearchResult) -> str | None:
    """plot.png: total tok/s against concurrency, one curve per swept variant (error bars:
    the spread with --repeat); None when matplotlib is missing (a one-line note instead)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot.png skipped: matplotlib is not installed (pip install 'sm120kit[plot]')"
    curves = [(r.name, [lv for lv in r.levels if lv.total]) for r in report.results if r.status is Outcome.DONE]
    curves = [(n, lv) for n, lv in curves if lv]
    if not curves:
        return "plot.png skipped: no variant has figures"
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, levels in curves:
        xs = [lv.concurrency for lv in levels]
        ys = [lv.measured_total for lv in levels]
        lows = [lv.measured_total - lv.measured_bounds[0] for lv in levels]
        highs = [lv.measured_bounds[1] - lv.measured_total for lv in levels]
        ax.errorbar(xs, ys, yerr=[lows, highs], marker="o", capsize=3, label=name)
    xs = sorted({lv.concurrency for _, levels in curves for lv in levels})
    ax.set(xscale="log", xlabel="concurrency", ylabel="total tok/s", title=f"{report.plan.profile}: variants")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(directory / "plot.png", dpi=110)
    plt.close(fig)
    return None


def load_search(directory: str) -> SearchResult:
    """A search directory, as `bench compare RUN_DIR` reads it."""
    from sm120kit.bench.variants import Variant, VariantStatus

    d = Path(directory)
    if not d.is_dir():
        raise UserError(
            f"{directory} does not exist" if not d.exists() else f"{directory} is not a directory",
            "pass a directory that `sm120kit bench --vary/--variants` wrote",
        )
    doc = read_json(d / SEARCH_FILE, "the search's own record is damaged: rerun it into another --out")
    if doc is None:
        hint = (
            "a plain sweep's directory: compare two of them with `sm120kit bench compare BEFORE AFTER`"
            if (d / "run.json").exists()
            else "pass a directory that `sm120kit bench --vary/--variants` wrote"
        )
        raise UserError(f"{directory} is not a search directory (no {SEARCH_FILE})", hint)
    try:
        settings, plan_doc = doc["settings"], doc["plan"]
        planned = [
            Planned(
                Variant(
                    v["name"], tuple(v.get("set", [])), v.get("description", ""), tuple(v.get("requires", {}).items())
                ),
                VariantStatus(v["status"]),
                v.get("why", ""),
            )
            for v in plan_doc["variants"]
        ]
        plan = Plan(
            plan_doc["profile"],
            plan_doc["source"],
            planned,
            plan_doc.get("notes", []),
            tuple(plan_doc.get("serve_args", [])),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{d / SEARCH_FILE} is damaged ({type(exc).__name__}: {exc})", "rerun the search into another --out"
        ) from None
    results = []
    for p in planned:
        vdoc = read_json(d / p.name / VARIANT_FILE) if (d / p.name).is_dir() else None
        if vdoc is not None:
            try:
                results.append(VariantResult.from_json(vdoc))
                continue
            except (KeyError, TypeError, ValueError):
                pass
        if not p.runnable:
            results.append(VariantResult.skipped(p))
    report = SearchResult(d, plan, settings, results, read_back=True)
    report.lines = verdict_lines(report)
    return report
