"""The CUDA toolkit flashinfer's JIT compiles with, found as flashinfer's
jit/cpp_ext.py get_cuda_path finds it — $CUDA_HOME, $CUDA_PATH, the nvcc on PATH,
/usr/local/cuda — in a given environment (the server's), and its release read from the
toolkit's version.json: no compiler is run."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path


def flashinfer_nvcc(env: Mapping[str, str]) -> tuple[Path, tuple[int, int] | None] | None:
    """(nvcc, its (major, minor) or None where unreadable), or None where there is no nvcc
    (flashinfer then falls back to torch's CUDA version)."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        found = shutil.which("nvcc", path=env.get("PATH", ""))
        home = str(Path(found).resolve().parent.parent) if found else "/usr/local/cuda"
    compiler = Path(home) / "bin" / "nvcc"
    if not compiler.exists():
        return None
    return compiler, release(Path(home))


def release(home: Path) -> tuple[int, int] | None:
    from sm120kit.shallow_json import loads

    try:
        doc = loads((home / "version.json").read_text())
        major, minor = str(doc["cuda"]["version"]).split(".")[:2]
        return int(major), int(minor)
    except (OSError, ValueError, KeyError, TypeError):
        return None
