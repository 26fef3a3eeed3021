"""What the commands print: tables fitted to the terminal (or every column on one line with
--wide), prose wrapped to it, and the --json documents. The judgements made here are the
reader's alone: a patch's release ranges merged into one span, `open` for a bug that no
upstream release has fixed, and the account of what an upgrade did to the patches (from the
plan's findings and the patches the ledger says were lost)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `ps` and `doctor` print tables too: they must not pay for the patch engine
    from sm120kit.patching.planning import Lost, Plan
    from sm120kit.patching.revert import Restore
    from sm120kit.patching.spec import Patch
    from sm120kit.patching.transform import Finding
    from sm120kit.tune.install import InstalledTable, Inventory

NOT_A_TERMINAL = 100  # the width for a pipe, a file, a CI log
NARROWEST = 40  # a terminal narrower than this gets 40: wrapping further helps nobody
NARROWEST_COLUMN = 8
OPEN = "open"  # no upstream release fixes the bug: the one word for it in every table
NONE = "-"  # no value: no file, no installed version
_fitted: int | None = None  # the width `try` gives the commands it runs inside its own output (fitted_to)


def output_width(wide: bool = False) -> int | None:
    """The width to fit output to: None (no limit) with --wide; the terminal's width
    ($COLUMNS first) when stdout is one; else 100. Not $COLUMNS for a pipe: readline sets
    it in the environment of any process that loads it, and its children inherit it."""
    if wide:
        return None
    if _fitted is not None:
        return _fitted
    return _terminal_width(sys.stdout) if sys.stdout.isatty() else NOT_A_TERMINAL


def _terminal_width(stream) -> int:
    """$COLUMNS, else the terminal's width on `stream`; never narrower than NARROWEST."""
    columns = os.environ.get("COLUMNS", "")
    if not (columns.isdigit() and int(columns) > 0):
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError):
            columns = NOT_A_TERMINAL
    return max(NARROWEST, int(columns))


def stderr_is_a_terminal() -> bool:
    return sys.stderr.isatty()


def error_width(wide: bool = False) -> int | None:
    """The width to fit errors, `next:` hints and warnings on stderr to: stderr's terminal
    ($COLUMNS first) when stderr is one. Else none: a message to a log or a pipe stays one
    line, for grep and for log collectors (a table on stdout is fitted there, not these)."""
    if wide:
        return None
    if _fitted is not None:
        return _fitted
    return _terminal_width(sys.stderr) if stderr_is_a_terminal() else None


@contextlib.contextmanager
def fitted_to(width: int):
    """output_width and error_width give `width` meanwhile, whatever stdout and stderr are:
    for a command whose output goes inside another's, indented (`try`)."""
    global _fitted
    saved, _fitted = _fitted, width
    try:
        yield
    finally:
        _fitted = saved


def wrap(text: str, width: int | None, indent: str = "", hanging: str = "  ") -> str:
    """Prose fitted to `width`: each line broken at spaces (never inside a word, a path or a
    URL), its continuation lines indented by `hanging` past the line's own indentation.
    Without a width, only the indent is added."""
    out = []
    for line in text.splitlines() or [""]:
        lead = indent + line[: len(line) - len(line.lstrip())]
        if width is None or len(lead) + len(line.lstrip()) <= width:
            out.append((lead + line.lstrip()).rstrip())
            continue
        out += textwrap.wrap(
            line.lstrip(),
            width,
            initial_indent=lead,
            subsequent_indent=lead + hanging,
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(out)


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    width: int | None = None,
    narrow: Sequence[int] = (),
    notes: Sequence[str] | None = None,
    whole: Sequence[int] = (),
) -> str:
    """Columns padded to their widest cell, two spaces apart (no header line when every
    header is empty). Fitted to `width` (None: as wide as the cells): the `narrow` columns
    (indices) give up width, the widest first, down to their header's (8 at least), and
    their cells wrap within them; first only as far as each cell still breaks at a space,
    a "/", a "-", a "–" or a ",", then further. The `whole` columns hold ids (a patch id,
    a failure id: what users copy into a command): never broken inside one, a narrow one
    gives up width only down to its longest id. A row's note follows it on lines of its
    own, indented and wrapped: the long text (a file, a detail, a summary) that no column
    could hold."""
    cells = [[str(c) for c in r] for r in rows]
    count = len(headers)
    whole = {i % count for i in whole}
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if width is not None:
        floors = {i % count: max(len(headers[i % count]), NARROWEST_COLUMN) for i in narrow}
        for i in floors.keys() & whole:
            floors[i] = max([floors[i], *(len(word) for r in cells for word in r[i].split())])
        clean = {i: max([floor, *(_longest_piece(r[i]) for r in cells)]) for i, floor in floors.items()}
        excess = sum(widths) + 2 * (count - 1) - width
        for limits in (clean, floors):  # clean breaks first; then any, rather than a line too wide
            while excess > 0:
                shrinkable = [i for i, floor in limits.items() if widths[i] > floor]
                if not shrinkable:
                    break  # the fixed columns alone are wider: better too wide than unreadable
                widest = max(shrinkable, key=widths.__getitem__)
                widths[widest] -= 1
                excess -= 1
    lines = _table_row(headers, widths) if any(headers) else []
    for i, row in enumerate(cells):
        lines += _table_row(row, widths, whole)
        if notes and notes[i]:
            lines.append(wrap(notes[i], width, indent="  "))
    return "\n".join(lines)


def _table_row(row: Sequence[str], widths: list[int], whole: set[int] = frozenset()) -> list[str]:
    parts = [_cell_lines(cell, w, i in whole) for i, (cell, w) in enumerate(zip(row, widths))]
    height = max(len(p) for p in parts)
    return [
        "  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip() for k in range(height)
    ]


_BREAKS = ("/", "-–,")  # where a cell without spaces breaks: after a "/" (a path), else after these


def _longest_piece(cell: str) -> int:
    """The widest piece a cell breaks into at its clean break points (spaces, _BREAKS)."""
    if " " in cell.strip():
        return max((len(word) for word in cell.split()), default=0)
    return max(len(piece) for piece in re.split(r"(?<=[/\-–,])", cell))


def _cell_lines(cell: str, width: int, whole: bool = False) -> list[str]:
    """A cell broken to `width`: at spaces, else (a path) after a "/", else after a "-",
    "–" or ",", else anywhere; ids (`whole`) only at spaces."""
    if len(cell) <= width:
        return [cell]
    if whole:
        return textwrap.wrap(cell, width, break_long_words=False, break_on_hyphens=False)
    if " " in cell.strip():
        return textwrap.wrap(cell, width, break_on_hyphens=False)
    lines = []
    while len(cell) > width:
        cut = next((c for marks in _BREAKS if (c := max(cell.rfind(m, 0, width) for m in marks) + 1)), width)
        lines.append(cell[:cut])
        cell = cell[cut:]
    return [*lines, cell]


def emit_json(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_warnings(warnings: Iterable[str], wide: bool = False) -> None:
    """Warnings, one `warning:` message each on stderr, wrapped to its width (error_width)."""
    width = error_width(wide)
    for warning in warnings:
        print(wrap(f"warning: {warning}", width), file=sys.stderr)


def error_text(message: str, wide: bool = False) -> str:
    """A message for stderr (`sm120kit: error: ...` and its `  next:` line) wrapped to its
    width, continuation lines indented."""
    return wrap(message, error_width(wide))


def _first_line(text: str, debug: bool) -> str:
    return text if debug else text.splitlines()[0] if text else ""


# -- release ranges --------------------------------------------------------------------


def release_span(ranges: Iterable[str]) -> str:
    """The releases that any of the PEP 440 ranges covers, as one span where they meet or
    overlap: ">=0.5.9,<0.5.16" and ">=0.5.16,<=0.5.23" read "0.5.9–0.5.23". Ranges that do
    not meet are listed with ", "; one that is not a plain interval (`!=`, `~=`, `*`) as is."""
    intervals, odd = [], []
    for text in dict.fromkeys(ranges):
        interval = _interval(text)
        (intervals.append(interval) if interval else odd.append(text))
    merged: list[list] = []
    for low, high in sorted(intervals, key=lambda iv: (iv[0] is not None, iv[0] and (iv[0][0], not iv[0][1]))):
        if merged and _meets(merged[-1][1], low):
            merged[-1][1] = _higher(merged[-1][1], high)
        else:
            merged.append([low, high])
    return ", ".join([*(_interval_text(low, high) for low, high in merged), *odd]) or "any release"


def _interval(text: str):
    """(lowest, highest) of a range, each (release, inclusive) or None for no bound; None
    for a range that is not one interval."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    low = high = None
    for spec in SpecifierSet(text):
        if "*" in spec.version or spec.operator not in (">=", ">", "<=", "<", "=="):
            return None
        bound = (Version(spec.version), spec.operator in (">=", "<=", "=="))
        if spec.operator in (">=", ">", "==") and (low is None or (bound[0], not bound[1]) > (low[0], not low[1])):
            low = bound
        if spec.operator in ("<=", "<", "==") and (high is None or bound < high):
            high = bound
    return low, high


def _meets(high, low) -> bool:
    """Whether an interval ending at `high` touches or overlaps one starting at `low`."""
    if high is None or low is None:
        return True
    return low[0] < high[0] or (low[0] == high[0] and (low[1] or high[1]))


def _higher(a, b):
    return None if a is None or b is None else max(a, b)


def _interval_text(low, high) -> str:
    if low and high and low[1] and high[1]:
        return str(low[0]) if low[0] == high[0] else f"{low[0]}–{high[0]}"
    lower = f"{'>=' if low[1] else '>'}{low[0]}" if low else ""
    upper = f"{'<=' if high[1] else '<'}{high[0]}" if high else ""
    return ",".join(x for x in (lower, upper) if x) or "any release"


def fixed_in_text(patch: Patch) -> str:
    """When upstream fixed the patch's bug: one release, or each part's (`open`: not yet)."""
    from packaging.version import Version

    fixes = {patch.fixed_in_for(r) for r in patch.rewrites} or {patch.fixed_in}
    releases = sorted((f for f in fixes if f), key=Version)
    return ", ".join(releases + ([OPEN] if None in fixes else []))


# -- patches ---------------------------------------------------------------------------


def patch_listing(patches: list[Patch], shipped: str, width: int | None = None) -> tuple[str, list[dict]]:
    docs, rows, summaries, details = [], [], [], []
    for p in patches:
        origin = "shipped" if p.source.startswith(shipped) else p.source
        releases = release_span(r.versions for r in p.rewrites)
        docs.append(
            {
                "id": p.id,
                "package": p.package,
                "summary": p.summary,
                "why": p.why,
                "revision": p.revision,
                "fixed_in": p.fixed_in,
                "releases": releases,
                "proven_window": p.window,
                "refs": list(p.refs),
                "upstream": list(p.upstream),
                "rewrites": [
                    {"path": r.path, "versions": r.versions, "fixed_in": p.fixed_in_for(r)} for r in p.rewrites
                ],
                "source": origin,
            }
        )
        rows.append([p.id, p.package, releases, fixed_in_text(p)])
        summaries.append(p.summary)
        detail = [f"{p.id} (r{p.revision}, {origin}, proven {p.window})", wrap(p.why, width, indent="  ", hanging="")]
        if p.upstream:
            detail.append(wrap(f"upstream: {' '.join(p.upstream)}", width, indent="  "))
        files = table(
            ["RELEASES", "FIXED IN", "FILE"],
            [[release_span([r.versions]), p.fixed_in_for(r) or OPEN, r.path] for r in p.rewrites],
            width and width - 2,
            narrow=(2,),
        )
        details.append("\n".join([*detail, textwrap.indent(files, "  ")]))
    headers = ["PATCH", "PACKAGE", "RELEASES", "FIXED IN"]
    if width is None:
        text = table([*headers, "SUMMARY"], [[*r, s] for r, s in zip(rows, summaries)])
    else:
        text = table(headers, rows, width, narrow=(1, 2, 3), notes=summaries, whole=(0,))
    return "\n\n".join([text, *details]), docs


# -- patch / status --------------------------------------------------------------------


def lost_messages(plan: Plan) -> list[str]:
    """The plain account of what an upgrade, a downgrade or a reinstall did to our patches:
    one line per file that lost a patch, naming the file (a patch of several files may be
    re-applied to one and not needed any more in another)."""
    messages: list[str] = []
    for lost in plan.lost:
        message = f"{_lost_head(lost)}; {_lost_tail(lost, *_now(lost, plan.findings))}"
        if message not in messages:
            messages.append(message)
    return messages


def _lost_head(lost: Lost) -> str:
    if lost.old_version == lost.new_version:
        return f"{lost.package} {lost.new_version}: patch {lost.patch_id} was lost ({lost.path} was reinstalled)"
    from packaging.version import Version

    change = "downgrade" if Version(lost.new_version) < Version(lost.old_version) else "upgrade"
    return (
        f"{lost.package} {lost.old_version} -> {lost.new_version}: "
        f"patch {lost.patch_id} was lost from {lost.path} in the {change}"
    )


def _now(lost: Lost, findings: list[Finding]) -> tuple[Finding | None, bool]:
    """(the patch's finding now, whether it is about the lost file's code): the finding on
    that file, or on the file its code moved to (the same name elsewhere, or the patch's
    only file); else the patch's last finding, which says nothing of that file."""
    mine = [f for f in findings if f.patch.id == lost.patch_id]
    name = lost.path.rsplit("/", 1)[-1]
    same = [f for f in mine if f.path == lost.path] or [f for f in mine if (f.path or "").endswith("/" + name)]
    if same or len(mine) == 1:
        return (same or mine)[0], True
    return (mine[-1] if mine else None), False


def _lost_tail(lost: Lost, now: Finding | None, its_code: bool) -> str:
    from sm120kit.patching.spec import Outcome

    if now is None:
        return "it is not in the patch set any more"
    tail = _lost_outcome(lost, now)
    if its_code and now.path and now.path != lost.path:  # the upgrade moved the code
        tail = f"its code is now in {now.path}: {tail}"
    return f"{tail} ({now.unproven})" if now.unproven and now.outcome is not Outcome.FIXED_UPSTREAM else tail


def _lost_outcome(lost: Lost, now: Finding) -> str:
    from sm120kit.patching.spec import Outcome

    return {
        Outcome.APPLIED: "re-applied",
        Outcome.WOULD_APPLY: "run `sm120kit patch` to re-apply it",
        Outcome.ALREADY_APPLIED: "it is back in place",
        Outcome.FIXED_UPSTREAM: f"not needed any more (fixed upstream in {now.fixed_in})",
        Outcome.NOT_APPLICABLE: f"it does not apply to {lost.new_version}",
    }.get(now.outcome, f"it could not be re-applied: {now.outcome.value}")


def print_cache_notes(result, width: int | None = None) -> None:
    for path in result.jit_cache_removed:
        print(wrap(f"removed the JIT cache {path}: its kernels were built from the old sources", width))
    print_warnings(result.warnings, wide=width is None)


def print_plan(plan: Plan, debug: bool, width: int | None = None) -> None:
    print(wrap(f"target: {plan.target.description}", width))
    for problem in plan.blockers:
        print(error_text(f"error: {problem}", wide=width is None), file=sys.stderr)
    for message in lost_messages(plan):
        print(wrap(message, width))
    print_cache_notes(plan, width)
    print(findings_table(plan.findings, debug, width))
    for patch in {f.patch.id: f.patch for f in plan.findings if f.patch.upstream}.values():
        print(wrap(f"upstream of {patch.id}: {patch.upstream[0]}", width))  # all of them: `sm120kit patches`
    for hint in dict.fromkeys(f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint):
        print(wrap(f"next: {hint}", width))
    if unproven := unproven_summary(plan):
        print(wrap(unproven, width))


def _detail(f: Finding, debug: bool) -> str:
    """The detail's first line, led by the unproven note where the outcome depends on it."""
    detail = _first_line(f.detail, debug)
    if f.unproven and not detail.startswith(f.unproven) and f.outcome.value not in ("fixed-upstream", "not-applicable"):
        return f"{f.unproven}" + (f"; {detail}" if detail else "")
    return detail


def _fixed_in(f: Finding) -> str:
    """A file's row: when upstream fixed that part. A row of the whole patch (not installed,
    outside its releases): when upstream fixed it, part by part, as `sm120kit patches` says."""
    return f.fixed_in or (fixed_in_text(f.patch) if f.path is None else OPEN)


def findings_table(findings: list[Finding], debug: bool, width: int | None = None) -> str:
    """One row per (patch, file). Fitted to a width, the file and the detail go on a line
    of their own under the row; with --wide (no width) they are its last two columns."""
    headers = ["PATCH", "PACKAGE", "VERSION", "OUTCOME", "FIXED IN"]
    rows = [[f.patch.id, f.patch.package, f.version or NONE, f.outcome.value, _fixed_in(f)] for f in findings]
    if width is None:
        return table(
            [*headers, "FILE", "DETAIL"], [[*r, f.path or NONE, _detail(f, debug)] for r, f in zip(rows, findings)]
        )
    notes = [": ".join(x for x in (f.path, _detail(f, debug)) if x) for f in findings]
    return table(headers, rows, width, narrow=(1, 2, 3, 4), notes=notes, whole=(0,))


def summary(findings: list[Finding]) -> str:
    counts: dict[str, int] = {}
    for f in findings:
        label = f.outcome.value + (" (allowed)" if f.allowed else "")
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in counts.items()) or "no patches"


def unproven_summary(plan: Plan) -> str:
    """One line per release past a patch's proven window, naming the patches run by shape."""
    by_note: dict[str, list[str]] = {}
    for f in plan.unproven:
        ids = by_note.setdefault(f.unproven, [])
        if f.patch.id not in ids:
            ids.append(f.patch.id)
    return "\n".join(f"{note}: {', '.join(ids)} (run by the shape of the code)" for note, ids in by_note.items())


def plan_json(command: str, plan: Plan, code: int, extra: dict | None = None) -> dict:
    return {
        "command": command,
        "target": plan.target.as_json(),
        "results": [f.as_json() for f in plan.findings],
        "lost": [vars(x) for x in plan.lost],
        "messages": lost_messages(plan),
        "unproven": [f.as_json() for f in plan.unproven],
        "damaged": plan.damaged,
        "unrestorable": plan.unrestorable,
        "interrupted": [str(p) for p in plan.interrupted],
        "warnings": plan.warnings,
        "jit_cache_removed": [str(p) for p in plan.jit_cache_removed],
        **(extra or {}),
        "exit_code": code,
    }


def restore_table(rows: list[Restore], width: int | None = None) -> str:
    """One row per file `unpatch` restores. Fitted to a width, the row names the patches and
    the file and the detail follow on a line of their own; with --wide, one line, file first."""
    if width is None:
        return table(
            ["FILE", "PACKAGE", "VERSION", "PATCHES", "OUTCOME", "DETAIL"],
            [[r.path, r.package, r.version, ",".join(r.patch_ids), r.outcome.value, r.detail] for r in rows],
        )
    return table(
        ["PATCHES", "PACKAGE", "VERSION", "OUTCOME"],
        [[", ".join(r.patch_ids), r.package, r.version, r.outcome.value] for r in rows],
        width,
        narrow=(0, 1, 2, 3),
        notes=[": ".join(x for x in (r.path, r.detail) if x) for r in rows],
        whole=(0,),
    )


# -- tuned MoE configs (tune-moe) -------------------------------------------------------


def tuned_json(inventory: Inventory) -> dict:
    return {
        "tuned": [t.as_json() for t in inventory.tables],
        "tuned_problems": inventory.problems,
        "tuned_notes": inventory.notes,
    }


def print_tuned(inventory: Inventory, width: int | None = None) -> None:
    """`status`: the MoE config tables tune-moe installed, after the patches."""
    for problem in inventory.problems:
        print(error_text(f"error: {problem}", wide=width is None), file=sys.stderr)
    for note in inventory.notes:
        print(wrap(note, width))
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
            t.entry.tuned_at[:10] or NONE,
            t.state.value + (" (stale)" if t.stale and t.entry.kind == "tuned" else ""),
        ]
        for t in tables
    ]
    if width is None:
        return table(
            [*headers, "GPU", "FILE", "NOTE"],
            [[*r, t.entry.device_name, str(t.path), t.note] for r, t in zip(rows, tables)],
        )
    notes = [f"{t.entry.device_name}: {t.path}: {t.note}" for t in tables]
    return table(headers, rows, width, narrow=(0,), notes=notes)


# -- serve -----------------------------------------------------------------------------


def _ago(then: float | None) -> str:
    """How long ago, at a glance ("45s ago", "12m ago"); from 2 hours on, the date and time."""
    from sm120kit.serve.clock import age

    if not then:
        return "-"
    seconds = time.time() - then
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(then)) if seconds >= 7200 else f"{age(seconds)} ago"


def ps_row(run: dict) -> list[str]:
    """One line of `sm120kit ps` from a run's state.json."""
    from sm120kit.serve.status import TERMINAL

    health = run.get("last_health") or {}
    last = (
        f"{'ok' if health.get('ok') else 'FAILED'} {health.get('detail', '')} ({_ago(health.get('at'))})"
        if health
        else "-"
    )
    pid = run.get("supervisor_pid")
    if pid is None or (run.get("status") in TERMINAL and not run.get("running")):
        supervisor = "-"
    else:
        supervisor = str(pid) if run.get("running") else f"{pid} (gone)"
    restarts, host, port = run.get("restarts"), run.get("host"), run.get("port")
    status = str(run.get("status") or "-")
    if status == "starting" and run.get("phase") == "smoke":  # it generates; health.smoke decides "ready"
        status = "starting (smoke)"
    return [  # "-" for what the record does not hold (a damaged one holds little): never an invented value
        str(run.get("profile") or "-"),
        status,
        supervisor,
        str(run.get("server_pid") or "-"),
        _ago(run.get("since")),
        "-" if restarts is None else str(restarts),
        last,
        "-" if port is None else f"{host or '-'}:{port}",
    ]


def ps_table(runs: list[dict], width: int | None = None) -> str:
    """`sm120kit ps`: one row per run. Fitted to a width, the pids and the last health probe
    go on a line of their own under the row; with --wide, one line per run."""
    headers = ["PROFILE", "STATUS", "SUPERVISOR", "SERVER", "SINCE", "RESTARTS", "LAST HEALTH", "PORT"]
    rows = [dict(zip(headers, ps_row(run))) for run in runs]
    if width is None:
        return table(headers, [list(row.values()) for row in rows])
    columns = ["PROFILE", "STATUS", "SINCE", "RESTARTS", "PORT"]
    return table(
        columns,
        [[row[c] for c in columns] for row in rows],
        width,
        narrow=(0, 1, 2),
        notes=[f"supervisor {r['SUPERVISOR']}, server {r['SERVER']}, last health {r['LAST HEALTH']}" for r in rows],
    )
