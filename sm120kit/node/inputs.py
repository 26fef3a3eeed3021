"""What the node's checks look at (CheckInputs), apart from the checks and their registry so
that each check can name it without importing the registry that imports the check; and
what those checks read of serve's processes (Processes), which node does not import."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sm120kit.node.snapshot import Snapshot

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile


class SeenProcess(Protocol):
    """A process serve's scan found (sm120kit.serve.procs.Proc), as the stale check reads it.
    Read-only members: a frozen dataclass satisfies them."""

    @property
    def pid(self) -> int: ...

    @property
    def marker(self) -> str | None: ...  # the run it belongs to (SM120KIT_SERVE_ID), if readable

    @property
    def orphan(self) -> bool: ...  # its launcher is gone

    @property
    def supervisor(self) -> int | None: ...  # the live sm120kit it runs under

    def line(self) -> str: ...


class StopOutcome(Protocol):
    """What a stop left running (sm120kit.serve.procs.StopReport)."""

    @property
    def left(self) -> Sequence[SeenProcess]: ...


@runtime_checkable
class Processes(Protocol):
    """What the ports and stale-process checks read of the node's processes: the module
    sm120kit.serve.procs, which serve and doctor pass as it is (mypy checks a module against a
    Protocol as it checks a class), or a test's stand-in. Each member is spelled as the checks
    call it."""

    def port_in_use(self, host: str, port: int) -> bool: ...

    def port_holder(self, port: int) -> str: ...

    def scan(self, marker: str | None = None, sglang: bool = False) -> Sequence[SeenProcess]: ...

    def ancestors(self, pid: int) -> AbstractSet[int]: ...

    # The checks stop processes by pid: no process group, no supervisor's tree.
    def stop(self, pgid: None, tree: None, timeout: float, *, pids: Collection[int]) -> StopOutcome: ...


@dataclass(frozen=True)
class NcclRequest:
    """`doctor --nccl`: the interpreter that runs the worker, the GPU pair (NVML indices; None:
    the farthest-linked pair) and each run's bound."""

    python: str
    gpus: tuple[int, int] | None
    timeout_s: float
    worker: Path  # tests give the stand-in fixture


@dataclass(frozen=True)
class CheckInputs:
    """What the checks look at: the node, the profile (if any) and the command's choices."""

    node: Snapshot
    profile: Profile | None = None
    patch_dirs: tuple[str, ...] = ()
    patch_ids: tuple[str, ...] | None = None  # must be in place; None: survey every known patch
    allow_missing: frozenset[str] = frozenset()
    allowed_failures: frozenset[str] = frozenset()  # --allow-known-failure ids
    capability: str | None = None  # --capability: the node a launch is judged for
    kill_stale: bool = False
    # What the stale-process and ports checks read, supplied by the command that runs them
    # (serve, doctor), so that the node never imports serve: the process scan, stop and port
    # probes (sm120kit.serve.procs), and the run records (sm120kit.serve.rundir.runs).
    processes: Processes | None = None
    runs: Callable[[], list[dict]] | None = None
    debug: bool = False  # --debug: a check that crashes raises, with its traceback
    running: frozenset[str] = frozenset()  # the ids run together (set by run())
    nccl: NcclRequest | None = None  # doctor --nccl; None: not asked
    # (python, module) of each program serve starts as `python -m MODULE`: what the imports check reads
    entry_points: tuple[tuple[str, str], ...] = ()
    # the supervisor's metrics port (serve --metrics-port, or server.metrics_port) and how it was told
    metrics_port: int | None = None
    metrics_from: str = "server.metrics_port"

    @property
    def server_env(self) -> dict[str, str]:
        """The server's environment: ours, with the profile's on top."""
        return {**self.node.env, **(self.profile.env if self.profile else {})}
