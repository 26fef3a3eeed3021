"""What serve's tests share: the release the stand-in's environment has, the failure lines a
server dies with (in the real programs' wording), `sm120kit ps` of a served run, a profile
from its parts, and a fresh virtual environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sm120kit.profiles.model import Profile
from support.standin import Served

VERSION = "0.5.23"  # the sglang release the stand-in's environment has (its real files)


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


SECRET = "sk-live-0123456789abcdef"


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/env/lib/python3.11/site-packages/sglang/srt/utils/common.py", line 25, in <module>\n'
    "    import numpy as np\n"
    "ModuleNotFoundError: No module named 'numpy'\n"
)


# A known failure of a user's own (--patch-dir DIR: DIR/known-failures.toml), and its symptom.
MY_FAILURE = """
[[failure]]
id = "boom-sm120"
title = "a failure of my own"
package = "sglang"
affected = ">=0.5.20"
checked = "0.5.23"
upstream = ["https://github.com/sgl-project/sglang/issues/1"]
symptom = 'boom at line \\d+'
example = "RuntimeError: boom at line 12"
evidence = "nowhere"
answer = "compiled"
advice = "avoid it"
"""


def ps(s: Served) -> tuple[int, dict, str]:
    out = subprocess.run([sys.executable, "-m", "sm120kit", "ps", "--json"], capture_output=True, text=True, env=s.env)
    return out.returncode, json.loads(out.stdout), out.stderr


def profile(**parts) -> Profile:
    return Profile.model_validate(parts)


def said(text: str) -> str:
    """Text as a reader takes it: the lines a terminal's width wrapped joined again."""
    return " ".join(text.split())


def make_venv(root: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new, empty virtual environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    [site] = root.glob("lib/python*/site-packages")
    return root / "bin" / "python", site
