"""What several of serve's test files share: `sm120kit serve` end to end against the sglang
stand-in (tests/fixtures/sglang_standin.py, a TEST FIXTURE: the real server needs GPUs), the
failure lines a server dies with, and the environments the preflight reads.

The supervisor runs as its own process, as an operator runs it; real signals, real sockets,
real process trees. The profile renders for a real sglang release (0.5.23 unpacked from its
wheel); the stand-in python runs `-m sglang.launch_server` as the stand-in and everything
else as the interpreter of that environment.

A test module takes the fixtures by importing them (`from serve_fixtures import
serve_fixture as serve_fixture`, and env_python's, which serve takes): a conftest.py here
would be imported as `conftest` and hide tests/conftest.py from every `from conftest import`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from standin import Served, make_env_python

from sm120kit.node.registry import CheckInputs
from sm120kit.node.snapshot import Snapshot
from sm120kit.profiles.model import Profile

VERSION = "0.5.23"


TRITON_SMEM = (
    "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 147456, Hardware limit: 101376. "
    "Reducing block sizes or `num_stages` may help."
)


DEATHS = {
    "triton-shared-memory": TRITON_SMEM,
    "dsa-page-table": "AttributeError: 'PrefillMetadata' object has no attribute 'page_table_1_flattened'",
    "cuda-out-of-memory": (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 3 has a total capacity of 95.59 GiB"
    ),
    "nccl": "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "flashinfer-no-arch": "RuntimeError: No supported CUDA architectures found for major versions [10].",
    "illegal-instruction": "RuntimeError: CUDA error: an illegal instruction was encountered",
}


@pytest.fixture(scope="module", name="env_python")
def env_python_fixture(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("standin-env"), VERSION)


@pytest.fixture(name="serve")
def serve_fixture(tmp_path, env_python):
    made: list[Served] = []

    def make(faults: dict | None = None, sets=(), extra=(), env=None) -> Served:
        served = Served(tmp_path, env_python, faults or {}, list(sets), list(extra), env or {})
        made.append(served)
        return served

    yield make
    for served in made:
        served.cleanup()


def ps(s: Served) -> tuple[int, dict, str]:
    out = subprocess.run([sys.executable, "-m", "sm120kit", "ps", "--json"], capture_output=True, text=True, env=s.env)
    return out.returncode, json.loads(out.stdout), out.stderr


def profile(**parts) -> Profile:
    return Profile.model_validate(parts)


def inputs(profile=None, env=None, gpus=None, **choices) -> CheckInputs:
    """What a check looks at: this environment, and NVML answering with these GPUs."""
    doc = {"gpus": [g.model_dump() for g in gpus or []]}
    return CheckInputs(Snapshot(Path("/"), env or {}, lambda: doc), profile, **choices)


SECRET = "sk-live-0123456789abcdef"


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/env/lib/python3.11/site-packages/sglang/srt/utils/common.py", line 25, in <module>\n'
    "    import numpy as np\n"
    "ModuleNotFoundError: No module named 'numpy'\n"
)


def said(text: str) -> str:
    """Text as a reader takes it: the lines a terminal's width wrapped joined again."""
    return " ".join(text.split())


def make_venv(root: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new, empty virtual environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    [site] = root.glob("lib/python*/site-packages")
    return root / "bin" / "python", site
