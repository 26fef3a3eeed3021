"""Human tables and --json documents for the commands (no logic of their own)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `ps` and `doctor` print tables too: they must not pay for the patch engine
    from sm120kit.patching.engine import Finding, Lost, Plan, Restore
    from sm120kit.patching.spec import Patch


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [list(headers), *rows])


def emit_json(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _first_line(text: str, debug: bool) -> str:
    return text if debug else text.splitlines()[0] if text else ""


# -- patches ---------------------------------------------------------------------------


def patch_listing(patches: list[Patch], shipped: str) -> tuple[str, list[dict]]:
    docs, rows, details = [], [], []
    for p in patches:
        origin = "shipped" if p.source.startswith(shipped) else p.source
        docs.append(
            {
                "id": p.id,
                "package": p.package,
                "summary": p.summary,
                "why": p.why,
                "revision": p.revision,
                "fixed_in": p.fixed_in,
                "proven_window": p.window,
                "refs": list(p.refs),
                "rewrites": [{"path": r.path, "versions": r.versions} for r in p.rewrites],
                "source": origin,
            }
        )
        rows.append([p.id, p.package, " | ".join(r.versions for r in p.rewrites), p.fixed_in or "open", p.summary])
        detail = f"{p.id} (r{p.revision}, {origin}, proven {p.window})\n  {p.why}"
        if p.refs:
            detail += f"\n  upstream: {', '.join(p.refs)}"
        details.append(detail + "".join(f"\n  {r.versions:<22} {r.path}" for r in p.rewrites))
    text = table(["PATCH", "PACKAGE", "RELEASES", "FIXED IN", "SUMMARY"], rows)
    return "\n\n".join([text, *details]), docs


# -- patch / status --------------------------------------------------------------------


def lost_messages(plan: Plan) -> list[str]:
    """The plain account of what an upgrade (or a reinstall) did to our patches."""
    by_patch = {f.patch.id: f for f in plan.findings}
    by_file = {(f.patch.id, f.path): f for f in plan.findings}
    messages: list[str] = []
    for lost in plan.lost:
        now = by_file.get((lost.patch_id, lost.path)) or by_patch.get(lost.patch_id)
        message = f"{_lost_head(lost)}; {_lost_tail(lost, now)}"
        if message not in messages:  # a patch of several files is one story
            messages.append(message)
    return messages


def _lost_head(lost: Lost) -> str:
    if lost.old_version != lost.new_version:
        return f"{lost.package} {lost.old_version} -> {lost.new_version}: patch {lost.patch_id} was lost in the upgrade"
    return f"{lost.package} {lost.new_version}: patch {lost.patch_id} was lost (the file was reinstalled)"


def _lost_tail(lost: Lost, now: Finding | None) -> str:
    from sm120kit.patching.spec import Outcome

    if now is None:
        return "it is not in the patch set any more"
    tail = _lost_outcome(lost, now)
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


def print_cache_notes(result) -> None:
    for path in result.jit_cache_removed:
        print(f"removed the JIT cache {path}: its kernels were built from the old sources")
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)


def print_plan(plan: Plan, debug: bool) -> None:
    print(f"target: {plan.target.description}")
    for problem in plan.blockers:
        print(f"error: {problem}", file=sys.stderr)
    for message in lost_messages(plan):
        print(message)
    print_cache_notes(plan)
    print(findings_table(plan.findings, debug))
    for hint in dict.fromkeys(f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint):
        print(f"next: {hint}")
    if unproven := unproven_summary(plan):
        print(unproven)


def _detail(f: Finding, debug: bool) -> str:
    """The detail's first line, led by the unproven note where the outcome depends on it."""
    detail = _first_line(f.detail, debug)
    if f.unproven and not detail.startswith(f.unproven) and f.outcome.value not in ("fixed-upstream", "not-applicable"):
        return f"{f.unproven}" + (f"; {detail}" if detail else "")
    return detail


def findings_table(findings: list[Finding], debug: bool) -> str:
    rows = [
        [
            f.patch.id,
            f.patch.package,
            f.version or "-",
            f.outcome.value,
            f.fixed_in or "-",
            f.path or "-",
            _detail(f, debug),
        ]
        for f in findings
    ]
    return table(["PATCH", "PACKAGE", "VERSION", "OUTCOME", "UPSTREAM FIX", "FILE", "DETAIL"], rows)


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
        "interrupted": [str(p) for p in plan.interrupted],
        "warnings": plan.warnings,
        "jit_cache_removed": [str(p) for p in plan.jit_cache_removed],
        **(extra or {}),
        "exit_code": code,
    }


def restore_table(rows: list[Restore]) -> str:
    return table(
        ["FILE", "PACKAGE", "VERSION", "PATCHES", "OUTCOME", "DETAIL"],
        [[r.path, r.package, r.version, ",".join(r.patch_ids), r.outcome, r.detail] for r in rows],
    )


# -- serve -----------------------------------------------------------------------------


def _ago(then: float | None) -> str:
    if not then:
        return "-"
    seconds = max(0, int(time.time() - then))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(then))


def ps_row(run: dict) -> list[str]:
    """One line of `sm120kit ps` from a run's state.json."""
    health = run.get("last_health") or {}
    last = (
        f"{'ok' if health.get('ok') else 'FAILED'} {health.get('detail', '')} ({_ago(health.get('at'))})"
        if health
        else "-"
    )
    pid = run.get("supervisor_pid", "-")
    supervisor = (
        str(pid) if run.get("running") else "-" if run.get("status") in ("stopped", "gave-up") else f"{pid} (gone)"
    )
    return [
        run.get("profile", "?"),
        run.get("status", "?"),
        supervisor,
        str(run.get("server_pid") or "-"),
        _ago(run.get("since")),
        str(run.get("restarts", 0)),
        last,
        f"{run.get('host', '?')}:{run.get('port', '?')}",
    ]
