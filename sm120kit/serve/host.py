"""What the supervisor does to, and learns from, the machine it runs on: the server's
processes (spawn, reap, stop), its ports, the GPUs, and the signals that wake the
supervisor. A Protocol, so that tests can stand a fake machine in for this one.

The supervisor sleeps in select() on a pipe that signal handlers (SIGCHLD included) and
the probe threads write to: a death is seen the moment SIGCHLD arrives, and an idle
supervisor costs a wake-up per probe and per log read.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sm120kit.serve import procs

if TYPE_CHECKING:
    from sm120kit.node.nvml_schema import Gpu

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Host(Protocol):
    def listen(self, on_stop: Callable[[int], None]) -> None:
        """From now on a stop signal calls on_stop(signum) and ends a wait."""

    def wait(self, seconds: float) -> None:
        """Until a signal, a wake(), or `seconds`."""

    def wake(self) -> None:
        """End the current wait (from any thread)."""

    def become_subreaper(self) -> bool: ...

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen: ...

    def reap(self) -> dict[int, int]:
        """Every child that finished since the last call: pid -> wait status."""

    def sample(self) -> None:
        """Remember the processes of the run as they are now."""

    def members(self, pgid: int) -> set[int]:
        """The live processes of the run led by pgid, as sampled."""

    def stop(self, pgid: int, timeout: float, hurry: Callable[[], bool], drain: bool) -> procs.StopReport: ...

    def port_in_use(self, host: str, port: int) -> bool: ...

    def read_gpus(self) -> list[Gpu]:
        """Raises nvml.NvmlUnavailable when NVML cannot tell."""


class LocalHost:
    """This machine."""

    def __init__(self) -> None:
        self.tree = procs.Tree()  # every process of the runs, sampled while they run

    def listen(self, on_stop: Callable[[int], None]) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: on_stop(signum))
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def wait(self, seconds: float) -> None:
        if self._selector.select(max(0.0, seconds)):
            try:
                while os.read(self._wake_r, 512):
                    pass
            except BlockingIOError:
                pass

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"p")
        except OSError:
            pass

    def become_subreaper(self) -> bool:
        return procs.become_subreaper()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
        return procs.spawn(argv, env, log_path)

    def reap(self) -> dict[int, int]:
        return procs.reap()

    def sample(self) -> None:
        self.tree.sample()

    def members(self, pgid: int) -> set[int]:
        return procs.members(pgid, self.tree)

    def stop(self, pgid: int, timeout: float, hurry: Callable[[], bool], drain: bool) -> procs.StopReport:
        return procs.stop(pgid, self.tree, timeout, hurry=hurry, drain=drain)

    def port_in_use(self, host: str, port: int) -> bool:
        return procs.port_in_use(host, port)

    def read_gpus(self) -> list[Gpu]:
        from sm120kit.node import nvml  # NVML only where a GPU check asks for it

        return nvml.read_gpus()
