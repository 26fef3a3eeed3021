"""One snapshot of the node, as every check reads it: the files under a root (/proc and
/sys; a copy taken on another node for `doctor --root`), the environment, the NVML
document (read once, on first use, or replayed from a file) and the Python environment.
Tests point root at a fixture tree and NVML at a recorded document."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.node.nvml_schema import Gpu, NvmlDocument

if TYPE_CHECKING:
    from sm120kit.target import Target


@dataclass
class Snapshot:
    root: Path
    env: dict[str, str]  # the environment sm120kit runs in (a server gets the profile's on top)
    read_nvml: Callable[[], dict] = field(repr=False)  # the live reader, or a recorded document's
    target: Target | None = None  # the Python environment

    @functools.cached_property
    def nvml_document(self) -> dict:
        """NVML's answers as a plain document (what `doctor --json` records)."""
        return self.read_nvml()

    @functools.cached_property
    def nvml(self) -> NvmlDocument:
        return NvmlDocument.model_validate(self.nvml_document)

    @property
    def gpus(self) -> list[Gpu]:
        return self.nvml.gpus

    def text(self, path: str) -> str | None:
        try:
            return (self.root / path.lstrip("/")).read_text(errors="replace")
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return (self.root / path.lstrip("/")).exists()

    def entries(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.root / path.lstrip("/")))
        except OSError:
            return []


def live(
    target: Target | None = None, pairs: bool = True, root: Path | None = None, nvml_document: dict | None = None
) -> Snapshot:
    """This node: / (or root, a copy of another node's /proc and /sys), this process's
    environment, and the driver's NVML (read when first asked; without pairs, no P2P or
    topology matrix) or nvml_document, answers recorded by `doctor --json`."""
    from sm120kit.node import nvml

    read = (lambda: nvml_document) if nvml_document is not None else (lambda: nvml.read(pairs=pairs))
    return Snapshot(root or Path("/"), dict(os.environ), read, target)
