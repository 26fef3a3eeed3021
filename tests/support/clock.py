"""A clock for serve's and the fleet's state machines that moves only when told."""

from __future__ import annotations

FAKE_EPOCH = 1_800_000_000.0  # a fake clock's wall time at its monotonic 0


class FakeClock:
    """serve's and the fleet's Clock for their state machines, moved only by sleep()."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return FAKE_EPOCH + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
