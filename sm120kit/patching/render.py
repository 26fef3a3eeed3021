"""What the patch commands print (`patches`, `status`, `patch`, `unpatch`) and their --json
documents. The judgements made here are the reader's alone: a patch's release ranges merged
into one span, `open` for a bug that no upstream release has fixed, and the account of what
an upgrade did to the patches (from the plan's findings and the patches the ledger says were
lost)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sm120kit.followup import complete
from sm120kit.patching.ledger import Ledger
from sm120kit.patching.spec import Outcome
from sm120kit.report import NONE, OPEN, error_text, print_warnings, table, wrap

if TYPE_CHECKING:  # `sm120kit patches` lists the patches: it need not load the planner
    from sm120kit.patching.planning import Lost, Plan, Relearned
    from sm120kit.patching.revert import Restore, Unpatched
    from sm120kit.patching.spec import Patch
    from sm120kit.patching.transform import Finding


Bound = tuple[Version, bool]  # a release range's end: (the release, inclusive)


def _first_line(text: str, debug: bool) -> str:
    return text if debug else text.splitlines()[0] if text else ""


# -- release ranges --------------------------------------------------------------------


def release_span(ranges: Iterable[str]) -> str:
    """The releases that any of the PEP 440 ranges covers, as one span where they meet or
    overlap: ">=0.5.9,<0.5.16" and ">=0.5.16,<=0.5.23" read "0.5.9–0.5.23". Ranges that do
    not meet are listed with ", "; one that is not a plain interval (`!=`, `~=`, `*`) as is."""
    intervals: list[tuple[Bound | None, Bound | None]] = []
    odd: list[str] = []
    for text in dict.fromkeys(ranges):
        interval = _interval(text)
        (intervals.append(interval) if interval else odd.append(text))
    merged: list[list[Bound | None]] = []
    for low, high in sorted(intervals, key=lambda iv: (iv[0] is not None, iv[0] and (iv[0][0], not iv[0][1]))):
        if merged and _meets(merged[-1][1], low):
            merged[-1][1] = _higher(merged[-1][1], high)
        else:
            merged.append([low, high])
    return ", ".join([*(_interval_text(low, high) for low, high in merged), *odd]) or "any release"


def _interval(text: str) -> tuple[Bound | None, Bound | None] | None:
    """(lowest, highest) of a range, each (release, inclusive) or None for no bound; None
    for a range that is not one interval."""
    low: Bound | None = None
    high: Bound | None = None
    for spec in SpecifierSet(text):
        if "*" in spec.version or spec.operator not in (">=", ">", "<=", "<", "=="):
            return None
        bound = (Version(spec.version), spec.operator in (">=", "<=", "=="))
        if spec.operator in (">=", ">", "==") and (low is None or (bound[0], not bound[1]) > (low[0], not low[1])):
            low = bound
        if spec.operator in ("<=", "<", "==") and (high is None or bound < high):
            high = bound
    return low, high


def _meets(high: Bound | None, low: Bound | None) -> bool:
    """Whether an interval ending at `high` touches or overlaps one starting at `low`."""
    if high is None or low is None:
        return True
    return low[0] < high[0] or (low[0] == high[0] and (low[1] or high[1]))


def _higher(a: Bound | None, b: Bound | None) -> Bound | None:
    return None if a is None or b is None else max(a, b)


def _interval_text(low: Bound | None, high: Bound | None) -> str:
    if low and high and low[1] and high[1]:
        return str(low[0]) if low[0] == high[0] else f"{low[0]}–{high[0]}"
    lower = f"{'>=' if low[1] else '>'}{low[0]}" if low else ""
    upper = f"{'<=' if high[1] else '<'}{high[0]}" if high else ""
    return ",".join(x for x in (lower, upper) if x) or "any release"


def fixed_in_text(patch: Patch) -> str:
    """When upstream fixed the patch's bug: one release, or each part's (`open`: not yet)."""
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
        message = complete(f"{_lost_head(lost)}; {_lost_tail(lost, *_now(lost, plan.findings))}")
        if message not in messages:
            messages.append(message)
    return messages


def state_messages(plan: Plan) -> list[str]:
    """What `patch` changes in the ledger alone, one line each: the stale entries of a
    package that is not installed any more, and the entries rebuilt from the backups."""
    messages = []
    for stale in plan.stale:
        files = f"{len(stale.paths)} file{'' if len(stale.paths) == 1 else 's'}"
        head = (
            f"{stale.package} is not installed any more, but {stale.ledger} records {files} sm120kit patched in "
            f"{stale.package} {stale.version}: stale entries, with nothing to restore"
        )
        messages.append(f"{head}; {'forgotten' if stale.forgotten else '`sm120kit patch` forgets them'}")
    by_package: dict[tuple[Path, str, str], list[Relearned]] = {}
    for relearned in plan.relearned:
        entry = relearned.entry
        by_package.setdefault((relearned.site, entry.package, entry.version), []).append(relearned)
    for (site, package, version), found in by_package.items():
        files = "1 file" if len(found) == 1 else f"{len(found)} files"
        head = (
            f"{Ledger(site).path} lost the entries of {files} sm120kit patched in {package} {version} "
            f"({', '.join(r.entry.path for r in found)}), but its backups of their vendor bytes match the wheel's "
            "RECORD, and each file holds what the patches in place write on them"
        )
        done = all(r.recorded for r in found)
        messages.append(f"{head}; {'recorded again' if done else '`sm120kit patch` records them again'}")
    return [complete(m) for m in messages]


def _lost_head(lost: Lost) -> str:
    if lost.old_version == lost.new_version:
        return f"{lost.package} {lost.new_version}: patch {lost.patch_id} was lost ({lost.path} was reinstalled)"
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
    if now is None:
        return "it is not in the patch set any more"
    tail = _lost_outcome(lost, now)
    if its_code and now.path and now.path != lost.path:  # the upgrade moved the code
        tail = f"its code is now in {now.path}: {tail}"
    return f"{tail} ({now.unproven})" if now.unproven and now.outcome is not Outcome.FIXED_UPSTREAM else tail


def _lost_outcome(lost: Lost, now: Finding) -> str:
    return {
        Outcome.APPLIED: "re-applied",
        Outcome.WOULD_APPLY: "run `sm120kit patch` to re-apply it",
        Outcome.ALREADY_APPLIED: "it is back in place",
        Outcome.FIXED_UPSTREAM: f"not needed any more (fixed upstream in {now.fixed_in})",
        Outcome.NOT_APPLICABLE: f"it does not apply to {lost.new_version}",
    }.get(now.outcome, f"it could not be re-applied: {now.outcome.value}")


def print_cache_notes(result: Plan | Unpatched, width: int | None = None) -> None:
    for path in result.jit_cache_removed:
        print(wrap(f"removed the JIT cache {path}: its kernels were built from the old sources", width))
    print_warnings(result.warnings, wide=width is None)


def print_plan(plan: Plan, debug: bool, width: int | None = None) -> None:
    print(wrap(f"target: {plan.target.description}", width))
    for problem in plan.blockers:
        print(error_text(f"error: {complete(problem)}", wide=width is None), file=sys.stderr)
    for message in lost_messages(plan) + state_messages(plan):
        print(wrap(message, width))
    print_cache_notes(plan, width)
    print(findings_table(plan.findings, debug, width))
    for patch in {f.patch.id: f.patch for f in plan.findings if f.patch.upstream}.values():
        print(wrap(f"upstream of {patch.id}: {patch.upstream[0]}", width))  # all of them: `sm120kit patches`
    for hint in dict.fromkeys(f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint):
        print(wrap(f"next: {complete(hint)}", width))
    if unproven := unproven_summary(plan):
        print(wrap(unproven, width))


def _detail(f: Finding, debug: bool) -> str:
    """The detail's first line, led by the unproven note where the outcome depends on it
    (a command it names spelled for the running invocation)."""
    detail = complete(_first_line(f.detail, debug))
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
        "messages": lost_messages(plan) + state_messages(plan),
        "stale": [{**vars(s), "ledger": str(s.ledger)} for s in plan.stale],
        "relearned": [{"key": r.key, "path": r.entry.path, "recorded": r.recorded} for r in plan.relearned],
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
    """One row per file `unpatch` restores, headed as `status` heads its own (PATCH: the
    patches of that file). Fitted to a width, the row names the patches and the file and
    the detail follow on a line of their own; with --wide, one line, file first. The file
    is said once: a detail never repeats it."""
    if width is None:
        return table(
            ["FILE", "PACKAGE", "VERSION", "PATCH", "OUTCOME", "DETAIL"],
            [[r.path, r.package, r.version, ", ".join(r.patch_ids), r.outcome.value, r.detail] for r in rows],
        )
    return table(
        ["PATCH", "PACKAGE", "VERSION", "OUTCOME"],
        [[", ".join(r.patch_ids), r.package, r.version, r.outcome.value] for r in rows],
        width,
        narrow=(0, 1, 2, 3),
        notes=[": ".join(x for x in (r.path, r.detail) if x) for r in rows],
        whole=(0,),
    )
