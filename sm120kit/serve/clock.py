"""Time as the supervisor sees it: the clock it reads (a Protocol, so that tests can stand
a fake clock in for the system's) and how spans of time are written for people."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds for deadlines and spans: never jumps."""

    def time(self) -> float:
        """Seconds since the epoch, for the record."""

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


def duration(seconds: float) -> str:
    """A span to the second: "45s", "3m05s"."""
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def age(seconds: float) -> str:
    """A span at a glance: "45s", "12m", "3h05m"."""
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
