"""What a smoke found: one `Check` a question (`CheckName`), and the `SmokeReport` that holds
them, with its summary line, its exit code and its JSON.

Separate because serve, bench and the renderer read a report without running a smoke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from sm120kit.exit_codes import ExitCode


class CheckName(str, Enum):
    ANSWERS = "answers"
    GARBAGE = "garbage"
    UNDER_LOAD = "under-load"
    STREAMED = "streamed"
    LOGPROBS = "logprobs"
    BASELINE = "baseline"

    def __str__(self) -> str:  # a table cell or an f-string shows the word
        return self.value


@dataclass(frozen=True)
class Check:
    name: CheckName
    passed: bool
    detail: str  # one line: the figures
    short: str = ""  # a few words for the summary line
    examples: list[str] = field(default_factory=list)  # what failed, a few
    data: dict = field(default_factory=dict)

    def failure(self) -> str:
        shown = f"; e.g. {'; '.join(self.examples)}" if self.examples else ""
        return f"{self.name}: {self.detail}{shown}"

    def as_json(self) -> dict:
        return {
            "name": self.name.value,
            "passed": self.passed,
            "detail": self.detail,
            "examples": self.examples,
            **self.data,
        }


@dataclass(frozen=True)
class SmokeReport:
    passed: bool
    failures: list[str]  # one line per failed check: its name, what failed, an example
    checks: list[Check]
    url: str
    model: str | None
    sglang: str | None
    seconds: float
    tasks: int
    concurrency: int
    thresholds: dict
    name: str | None = None
    baseline: Path | None = None  # compared with
    recorded: Path | None = None  # written
    note: str | None = None  # e.g. why --record-baseline wrote nothing
    stalled: str | None = None  # why the smoke stopped sending: the server stopped answering, the budget ran out

    def summary(self) -> str:
        if not self.passed:
            failed = [str(c.name) for c in self.checks if not c.passed]
            return (
                f"smoke FAILED: {', '.join(failed)} ({len(failed)} of {len(self.checks)} checks; {self.seconds:.1f} s)"
            )
        return f"smoke passed: {', '.join(c.short or str(c.name) for c in self.checks)} ({self.seconds:.1f} s)"

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if self.passed else ExitCode.FINDINGS

    def as_json(self) -> dict:
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "sglang": self.sglang,
            "seconds": round(self.seconds, 3),
            "tasks": self.tasks,
            "concurrency": self.concurrency,
            "thresholds": self.thresholds,
            "checks": [c.as_json() for c in self.checks],
            "failures": self.failures,
            "baseline": str(self.baseline) if self.baseline else None,
            "recorded_baseline": str(self.recorded) if self.recorded else None,
            "note": self.note,
            "stalled": self.stalled,
            "exit_code": int(self.exit_code),
        }
