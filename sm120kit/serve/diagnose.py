"""Match a server log's tail against known SM120 failure signatures (signatures.toml)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SIGNATURES = Path(__file__).with_name("signatures.toml")


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


@lru_cache(maxsize=None)
def signatures(path: Path = SIGNATURES) -> tuple[Signature, ...]:
    doc = tomllib.loads(path.read_text())
    return tuple(
        Signature(s["id"], re.compile(s["pattern"]), s["title"], s["advice"], s.get("lookup", {}))
        for s in doc["signature"]
    )


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
