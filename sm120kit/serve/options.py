"""How `serve` starts a profile (ServeOptions): the command's choices, read by the preflight,
the supervisor and the commands that serve through its Python API (bench, fleet)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    patch_dirs: tuple[str, ...] = ()
    allow_missing: frozenset[str] = frozenset()  # patch ids whose missing anchor may start anyway
    patch_check: bool = True
    gpu_check: bool = True
    kill_stale: bool = False  # stop the stale sglang processes the preflight finds
    echo: bool = True  # the server's log on our output as it is written (--quiet: not)
    debug: bool = False  # a check that crashes raises (its traceback), rather than failing
    metrics_port: int | None = None  # the supervisor's state for Prometheus on 127.0.0.1:PORT/metrics
