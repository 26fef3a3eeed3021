"""Checks as text, fitted to a width (None: one line each, for --wide): a table (doctor's
report) or a list with the fix under each check that is not ok (serve's preflight)."""

from __future__ import annotations

import textwrap

from sm120kit import report
from sm120kit.followup import complete
from sm120kit.node.check import Check, Status

MARK = {Status.OK: "ok  ", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip", Status.INFO: "info"}
NEEDS_FIX = (Status.WARN, Status.FAIL)


def table(checks: list[Check], width: int | None) -> str:
    """One row per check: its mark, its id and the detail, which wraps."""
    return report.table(["", "CHECK", "DETAIL"], [[MARK[c.status], c.id, c.detail] for c in checks], width, narrow=(2,))


def fixes(checks: list[Check], width: int | None) -> list[str]:
    """ "id: fix" for each check that needs one (a command in it spelled for this invocation)."""
    return [fill(complete(c.fix), width, f"  {c.id}: ", " " * 4) for c in checks if c.status in NEEDS_FIX and c.fix]


def listing(checks: list[Check], width: int | None) -> list[str]:
    """Each check on its line, the fix under each that is not ok (what was skipped says why
    in its detail)."""
    lines = []
    for c in checks:
        lines.append(fill(c.detail, width, f"  {MARK[c.status]} {c.id}: ", " " * 7))
        if c.fix and c.status is not Status.OK:
            lines.append(fill(complete(c.fix), width, "       -> ", " " * 10))
    return lines


def fill(text: str, width: int | None, first: str, indent: str) -> str:
    """first + text within width, continued after indent. A detail lists its findings
    joined by "; ": it breaks between them where it can, so that each reads whole."""
    if width is None or len(first) + len(text) <= width:
        return first + text
    parts = text.split("; ")
    lines, line, fresh = [], first, True
    for i, part in enumerate(parts):
        item = part + (";" if i < len(parts) - 1 else "")
        if not fresh:
            if len(line) + 1 + len(item) <= width:
                line += " " + item
                continue
            lines.append(line)
            line = indent
        wrapped = textwrap.wrap(
            item, width, initial_indent=line, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )
        lines += wrapped[:-1]
        line, fresh = wrapped[-1], False
    return "\n".join([*lines, line])
