"""Match a server log's tail against known SM120 failure signatures (signatures.toml)."""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
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


@dataclass(frozen=True)
class Diagnosis:
    id: str
    title: str
    advice: str
    line: str  # the log line that matched

    def as_json(self) -> dict:
        return {"id": self.id, "title": self.title, "advice": self.advice, "line": self.line}


@cache
def signatures(path: Path = SIGNATURES) -> tuple[Signature, ...]:
    doc = tomllib.loads(path.read_text())
    return tuple(
        Signature(s["id"], re.compile(s["pattern"]), s["title"], s["advice"], s.get("lookup", {}))
        for s in doc["signature"]
    )


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


def diagnose(log: str, tail_lines: int = 400) -> list[Diagnosis]:
    """Each known signature found in the last `tail_lines` lines, once, first match first."""
    found: dict[str, Diagnosis] = {}
    for line in log.splitlines()[-tail_lines:]:
        for sig in signatures():
            if sig.id in found or not (match := sig.pattern.search(line)):
                continue
            words = match.groupdict()
            if sig.lookup:
                value = words.get(sig.lookup["group"], "")
                words["kernel"] = sig.lookup.get("values", {}).get(value, sig.lookup.get("default", ""))
            found[sig.id] = Diagnosis(sig.id, sig.title.format(**words), sig.advice.format(**words), line.strip())
    return list(found.values())
