"""What `sm120kit tune-moe` found and did (`TuneReport`): the shape, the candidates that fit
sm_120, where the table goes and what sglang loads now, the timing once timed, its exit code
and its JSON.

Separate because the renderer and `status` read a report without planning or timing one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.exit_codes import ExitCode
from sm120kit.tune.shape import MoeShape

if TYPE_CHECKING:  # timing is imported when the candidates are timed, not to read a report
    from sm120kit.tune.timing_result import TimingResult


@dataclass
class TuneReport:
    profile: str
    shape: MoeShape
    sglang: str
    triton: str | None  # the target's Triton (its version names sglang's config directory)
    compiler: str  # the Triton that compiled the kernels for sm_120
    kernel: str  # the installed file whose fused_moe_kernel was compiled
    space: int  # configs in the tuner's space for this shape
    fitting: list[dict]  # those that fit sm_120
    largest_fit: int  # bytes of shared memory of the largest fitting config
    rejected: list[dict]  # a few of those that do not fit, with their bytes
    device_name: str | None
    destination: Path | None  # where the tuned table goes
    loads_now: Path | None  # the table sglang loads today for this shape on this GPU (None: its defaults)
    loads_now_over: list[dict] = field(default_factory=list)  # its entries that do not fit sm_120
    batch_sizes: tuple[int, ...] = ()
    timing: TimingResult | None = None  # once timed
    installed: bool = False
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    compiler_python: str | None = None  # the interpreter whose Triton compiled them (None: sm120kit's own)

    @property
    def exit_code(self) -> ExitCode:
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if self.timing is None:
            return ExitCode.FINDINGS if self.loads_now_over else ExitCode.OK
        return ExitCode.OK if self.timing.complete else ExitCode.FINDINGS

    def as_json(self) -> dict:
        return {
            "profile": self.profile,
            "shape": self.shape.to_json(),
            "sglang": self.sglang,
            "triton": self.triton,
            "compiler": self.compiler,
            "compiler_python": self.compiler_python,
            "kernel": self.kernel,
            "space": self.space,
            "fit": len(self.fitting),
            "largest_fit_bytes": self.largest_fit,
            "rejected": self.rejected,
            "device_name": self.device_name,
            "destination": str(self.destination) if self.destination else None,
            "loads_now": str(self.loads_now) if self.loads_now else None,
            "loads_now_over": self.loads_now_over,
            "batch_sizes": list(self.batch_sizes),
            "timing": self.timing.as_json() if self.timing is not None else None,
            "installed": self.installed,
            "notes": self.notes,
            "exit_code": int(self.exit_code),
        }
