"""Which Triton compiles sglang's fused-MoE kernel for sm_120: sm120kit's own environment's, or
else the target interpreter's (--python), or a UserError naming the extra that installs one.

Separate from the command: a question about two environments, answered before any compile.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.errors import UserError

if TYPE_CHECKING:
    from sm120kit.target import Target


@dataclass(frozen=True)
class Compiler:
    """The Triton that compiles sglang's kernel for sm_120: this interpreter's, or else the
    one of the target's interpreter (--python)."""

    version: str
    python: Path | None = None  # None: this interpreter


TUNE_EXTRA = "pip install 'sm120kit[tune]'"


def find_compiler(target: Target, python: str | None) -> Compiler:
    """This environment's Triton; without one, the target's (when --python names an
    interpreter that has it); else a UserError naming the extra that installs it."""
    from sm120kit.tune import lookup

    try:
        import triton
    except ImportError:
        why = "no Triton"
    except Exception as exc:  # an installed Triton that fails to import (a broken install)
        why = f"a Triton that does not import ({type(exc).__name__}: {exc})"
    else:
        return Compiler(triton.__version__)
    there = lookup.installed_triton_version(target) if python else None
    if there and python:
        return Compiler(there, Path(python))
    here = f"sm120kit's environment ({sys.executable}) has {why}"
    if python:
        raise UserError(
            f"{here}, and neither has {target.description}: tune-moe compiles sglang's fused-MoE kernel "
            "for sm_120 with Triton",
            f"{TUNE_EXTRA} (Triton for sm120kit's environment), or install triton in {python}'s environment",
        )
    raise UserError(
        f"{here}: tune-moe compiles sglang's fused-MoE kernel for sm_120 with Triton",
        f"{TUNE_EXTRA}, or pass --python with the environment that serves sglang (its Triton compiles then)",
    )
