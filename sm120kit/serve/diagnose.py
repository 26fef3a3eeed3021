"""Match a server log's tail against known SM120 failure signatures (signatures.toml).
A line is matched without its escape sequences (a coloured line matches as a plain one), and
what a diagnosis quotes of it is shown as a terminal would read it (textcheck.printable):
nothing in a log recolours the terminal or sets its title."""

from __future__ import annotations

import os
import re
import sys
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO

from sm120kit.textcheck import printable, without_escapes

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SIGNATURES = Path(__file__).with_name("signatures.toml")
MAX_TAIL_LINES = 100_000  # `diagnose --tail N`: a crash is in the last few hundred lines
TAIL_BYTES = 16 << 20  # at most this much of a log's end is read: a 1 GB log is not read whole
BLOCK = 1 << 20


@dataclass(frozen=True)
class Signature:
    id: str
    pattern: re.Pattern
    title: str
    advice: str
    lookup: dict
    example: str  # a line a log would hold, which the pattern matches: what an operator is shown of it
    restart: bool = True  # false: a restart cannot mend it (the environment is incomplete)


@dataclass(frozen=True)
class Diagnosis:
    id: str
    title: str
    advice: str
    line: str  # the log line that matched
    restart: bool = True  # false: the supervisor stops rather than restart (machine.after_end)

    def as_json(self) -> dict:
        return {"id": self.id, "title": self.title, "advice": self.advice, "line": self.line, "restart": self.restart}


@cache
def signatures(path: Path = SIGNATURES, patch_dirs: tuple[str, ...] = ()) -> tuple[Signature, ...]:
    """The generic signatures (signatures.toml: a port taken, out of memory, NCCL), then the
    symptom of every failure of the known-failures survey (the user's of `patch_dirs` and
    $SM120KIT_PATCH_PATH, then the shipped one) that one of them does not name."""
    doc = tomllib.loads(path.read_text())
    found = [
        Signature(
            s["id"],
            re.compile(s["pattern"]),
            s["title"],
            s["advice"],
            s.get("lookup", {}),
            s["example"],
            s.get("restart", True),
        )
        for s in doc["signature"]
    ]
    return (*found, *_survey_signatures({s.id for s in found}, patch_dirs))


def _survey_signatures(taken: set[str], patch_dirs: tuple[str, ...]) -> list[Signature]:
    from sm120kit.catalogue.survey import load_survey

    return [
        Signature(
            f.id,
            f.pattern,
            f"{f.title} ({f.package} {f.affected}, {f.status})",
            # (only a user's own entry can come without advice: the shipped survey's all have it)
            (f.advice or "an entry of your own known-failures survey")
            + (f"; or avoid it: {f.avoid}" if f.avoid else "")
            + f.tracked(first=True),
            {},
            f.shown_symptom or "",
        )
        for f in load_survey(list(patch_dirs) or None, validate_patches=False).failures
        if f.pattern is not None and f.id not in taken
    ]


def read_tail(source: BinaryIO, lines: int, max_bytes: int = TAIL_BYTES) -> str:
    """The last `lines` lines of a log, or its last max_bytes where they are longer: read
    backwards from the end of a file, or streamed through a bounded window from a pipe."""
    data = _tail_of_file(source, lines, max_bytes) if source.seekable() else _tail_of_stream(source, max_bytes)
    return data.decode("utf-8", errors="replace")


def _tail_of_file(fh: BinaryIO, lines: int, max_bytes: int) -> bytes:
    pos = fh.seek(0, os.SEEK_END)
    chunks: list[bytes] = []
    size = newlines = 0
    while pos > 0 and size < max_bytes and newlines <= lines:  # one newline more: the first line whole
        step = min(BLOCK, pos, max_bytes - size)
        pos -= step
        fh.seek(pos)
        chunk = fh.read(step)
        chunks.append(chunk)
        size += len(chunk)
        newlines += chunk.count(b"\n")
    return b"".join(reversed(chunks))


def _tail_of_stream(stream: BinaryIO, max_bytes: int) -> bytes:
    window: deque[bytes] = deque()
    size = 0
    while chunk := stream.read(BLOCK):
        window.append(chunk)
        size += len(chunk)
        while size - len(window[0]) >= max_bytes:
            size -= len(window.popleft())
    return b"".join(window)[-max_bytes:]


def diagnose(log: str, tail_lines: int = 400, patch_dirs: tuple[str, ...] = ()) -> list[Diagnosis]:
    """Each known signature found in the last `tail_lines` lines, once, first match first;
    a line is one signature's (the first that matches it). patch_dirs: --patch-dir, whose
    known-failures.toml are read before the shipped survey."""
    found: dict[str, Diagnosis] = {}
    for raw in log.splitlines()[-tail_lines:]:
        line = without_escapes(raw)
        for sig in signatures(SIGNATURES, patch_dirs):
            if not (match := sig.pattern.search(line)):
                continue
            if sig.id in found:
                break
            # what it quotes, its named groups too, reaches a terminal: no control character
            words = {k: v if v is None else printable(v) for k, v in match.groupdict().items()}
            if sig.lookup:
                value = words.get(sig.lookup["group"], "")
                words["kernel"] = sig.lookup.get("values", {}).get(value, sig.lookup.get("default", ""))
            title, advice = sig.title.format(**words), sig.advice.format(**words)
            found[sig.id] = Diagnosis(sig.id, title, advice, printable(line.strip()), sig.restart)
            break
    return list(found.values())
