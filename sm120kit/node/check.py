"""A check's answer: its id, a Status, what it found and the fix. A check never raises
for what it finds; a file it cannot read makes it say "unknown", not fail."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"  # worth fixing; nothing refuses for it
    FAIL = "fail"  # doctor says the node cannot serve; serve refuses to start
    SKIP = "skip"  # not checked (--no-gpu-check, --no-patch-check)
    INFO = "info"  # nothing to judge: what was found, or why it could not be looked at


@dataclass(frozen=True)
class Check:
    id: str
    status: Status
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)  # facts for the JSON document and other commands (bench's record)

    def as_json(self) -> dict:
        return {
            "check": self.id,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
            **({"data": self.data} if self.data else {}),
        }
