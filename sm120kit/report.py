"""The terminal layer every command prints through: tables fitted to the terminal (or every
column on one line with --wide), prose wrapped to it, warnings and errors on stderr, and the
--json documents. A leaf: it knows no command; each renders its own results with these (the
patch commands in sm120kit.patching.render, `ps` in sm120kit.serve.render, ...)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import textwrap
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TextIO

from sm120kit.followup import complete

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


def _terminal_width(stream: TextIO) -> int:
    """$COLUMNS, else the terminal's width on `stream`; never narrower than NARROWEST."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return max(NARROWEST, int(columns))
    try:
        found = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        found = NOT_A_TERMINAL
    return max(NARROWEST, found)


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
def fitted_to(width: int) -> Iterator[None]:
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
    header is empty). Fitted to `width` (None: as wide as the cells): the `narrow` and the
    `whole` columns give up width, the widest first, each step only as far as it breaks
    nothing worse than the step before: down to their longest word (a cell wraps at its
    spaces); then the narrow columns down to their longest piece (a word breaks after a
    "/", "-", "–" or ","); then the whole columns so; then the narrow ones down to their
    header (8 at least), a word broken anywhere rather than a line too wide. The `whole`
    columns hold ids (a patch id, a failure id: what users copy into a command), never
    broken inside a piece. A row's note follows it on lines of its own, indented and
    wrapped: the long text (a file, a detail, a summary) that no column could hold."""
    cells = [[str(c) for c in r] for r in rows]
    count = len(headers)
    whole_columns = {i % count for i in whole}
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if width is not None:
        excess = sum(widths) + 2 * (count - 1) - width
        for limits in _shrink_steps(headers, cells, {i % count for i in narrow} - whole_columns, whole_columns):
            while excess > 0:
                shrinkable = [i for i, floor in limits.items() if widths[i] > floor]
                if not shrinkable:
                    break  # on to the next step; after the last, better too wide than unreadable
                widest = max(shrinkable, key=widths.__getitem__)
                widths[widest] -= 1
                excess -= 1
    lines = _table_row(headers, widths) if any(headers) else []
    for i, row in enumerate(cells):
        lines += _table_row(row, widths, whole_columns)
        if notes and notes[i]:
            lines.append(wrap(notes[i], width, indent="  "))
    return "\n".join(lines)


def _shrink_steps(
    headers: Sequence[str], cells: list[list[str]], narrow: set[int], whole: set[int]
) -> list[dict[int, int]]:
    """The width each column may give up to, step by step (column -> its width at least):
    breaking at spaces, then inside the narrow columns' words at their break points, then
    inside the ids at theirs, then the narrow columns anywhere."""
    floor = {i: max(len(headers[i]), NARROWEST_COLUMN) for i in narrow | whole}

    def at_least(i: int, measure) -> int:
        return max([floor[i], *(measure(r[i]) for r in cells)])

    words = {i: at_least(i, _longest_word) for i in floor}
    pieces = {i: at_least(i, _longest_piece) for i in floor}
    return [
        words,
        {**words, **{i: pieces[i] for i in narrow}},
        pieces,
        {**pieces, **{i: floor[i] for i in narrow}},
    ]


def _table_row(row: Sequence[str], widths: list[int], whole: Collection[int] = frozenset()) -> list[str]:
    parts = [_cell_lines(cell, w, i in whole) for i, (cell, w) in enumerate(zip(row, widths))]
    height = max(len(p) for p in parts)
    return [
        "  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip() for k in range(height)
    ]


_BREAKS = ("/", "-–,")  # where a word breaks: after a "/" (a path), else after one of these


def _longest_word(cell: str) -> int:
    return max((len(word) for word in cell.split()), default=0)


def _longest_piece(cell: str) -> int:
    """The widest piece a cell breaks into at its clean break points (spaces, _BREAKS)."""
    return max((len(piece) for word in cell.split() for piece in re.split(r"(?<=[/\-–,])", word)), default=0)


def _cell_lines(cell: str, width: int, whole: bool = False) -> list[str]:
    """A cell broken to `width`: at spaces; a word wider than that after a "/", else after a
    "-", "–" or ",", else (not an id: `whole`) anywhere."""
    if len(cell) <= width:
        return [cell]
    lines: list[str] = []
    line = ""
    for word in cell.split():
        if line and len(line) + 1 + len(word) <= width:
            line += " " + word
            continue
        if line:
            lines.append(line)
        while len(word) > width:
            cut = next((c for marks in _BREAKS if (c := max(word.rfind(m, 0, width) for m in marks) + 1)), 0)
            if not cut and whole:
                break  # an id's piece wider than its column stays whole
            lines.append(word[: cut or width])
            word = word[cut or width :]
        line = word
    return [*lines, line]


def emit_json(doc: dict, follow_ups: bool = True) -> None:
    """The --json document, every command it names (`sm120kit ...`, in a fix, a hint, a
    detail) spelled for the running invocation as the human output spells it (followup).
    follow_ups=False: the document is a file itself (a rendered unit, compose file or
    manifest), written as it would be written to disk."""
    json.dump(_completed(doc) if follow_ups else doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _completed(value: object) -> object:
    if isinstance(value, str):
        return complete(value)
    if isinstance(value, dict):
        return {k: _completed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_completed(v) for v in value]
    return value


def print_warnings(warnings: Iterable[str], wide: bool = False) -> None:
    """Warnings, one `warning:` message each on stderr, wrapped to its width (error_width);
    a command one names spelled for the running invocation (followup)."""
    width = error_width(wide)
    for warning in warnings:
        print(wrap(f"warning: {complete(warning)}", width), file=sys.stderr)


def error_text(message: str, wide: bool = False) -> str:
    """A message for stderr (`sm120kit: error: ...` and its `  next:` line) wrapped to its
    width, continuation lines indented."""
    return wrap(message, error_width(wide))
