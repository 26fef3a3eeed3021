"""Run FlashInfer autotune for the flashinfer_cutlass MoE runner on SM120.

Releases 0.5.7-0.5.12.post1 gate autotune on a list of MoE backends in which
"flashinfer_cutlass" is commented out ("will cause some flashinfer compilation errors"),
so an SM120 node serving NVFP4 experts with --moe-runner-backend flashinfer_cutlass runs
untuned tactics. The rewrite widens the gate for compute capability major 12 only, so
every other GPU keeps upstream's behaviour; 0.5.13 enabled the entry for all GPUs.
"""

import libcst as cst
import libcst.matchers as m

from sm120kit.patching.cst_tools import find_functions, marker_line
from sm120kit.patching.spec import (
    AlreadyApplied,
    AnchorMissing,
    FixedUpstream,
    Patch,
    Rewrite,
    Rewritten,
)

GATES = ("_should_run_flashinfer_autotune", "should_run_flashinfer_autotune")
BACKEND = "flashinfer_cutlass"
SM120_CLAUSE = f'not (backend_str == "{BACKEND}" and torch.cuda.get_device_capability()[0] == 12)'

_GATE_TEST = m.Comparison(
    left=m.Name("backend_str"),
    comparisons=[m.ComparisonTarget(operator=m.NotIn(), comparator=m.List())],
)
_PATCHED_TEST = m.BooleanOperation(
    left=_GATE_TEST,
    operator=m.And(),
    right=m.UnaryOperation(operator=m.Not(), expression=m.BooleanOperation(
        left=m.Comparison(left=m.Name("backend_str"), comparisons=[
            m.ComparisonTarget(operator=m.Equal(), comparator=m.SimpleString(f'"{BACKEND}"'))
        ])
    )),
)


def _lists_backend(node: cst.List) -> bool:
    return any(
        isinstance(e.value, cst.SimpleString) and e.value.evaluated_value == BACKEND for e in node.elements
    )


def widen_autotune_gate(module: cst.Module, ctx):
    gates = find_functions(module, GATES)
    if not gates:
        return AnchorMissing(f"no function {' / '.join(GATES)}")
    gate, put = gates[0]
    if any(_lists_backend(node) for node in m.findall(gate, m.List())):
        return FixedUpstream(f'"{BACKEND}" is in the autotune list of {gate.name.value}')
    if m.findall(gate, m.If(test=_PATCHED_TEST)):
        return AlreadyApplied()
    tests = m.findall(gate, m.If(test=_GATE_TEST))
    if len(tests) != 1:
        return AnchorMissing(f"expected one `if backend_str not in [...]` in {gate.name.value}, found {len(tests)}")
    old = tests[0]
    new = old.with_changes(
        test=cst.BooleanOperation(left=old.test, operator=cst.And(), right=cst.parse_expression(SM120_CLAUSE)),
        leading_lines=[*old.leading_lines, marker_line(f"{ctx.marker}: autotune {BACKEND} MoE on SM120")],
    )
    return Rewritten(put(gate.deep_replace(old, new)))


PATCH = Patch(
    id="sglang-moe-autotune-flashinfer-cutlass",
    package="sglang",
    summary="Run FlashInfer autotune for --moe-runner-backend flashinfer_cutlass on SM120",
    why=(
        "The autotune gate leaves flashinfer_cutlass commented out (PR #14357), so SM120 "
        "NVFP4 MoE runs untuned tactics; the seeds measured 880 -> 3,740 tok/s with it on."
    ),
    refs=("sgl-project/sglang#14357", "sgl-project/sglang#12306"),
    fixed_in="0.5.13",
    rewrites=(
        # The gate was a ModelRunner method until 0.5.13, the bug shape until 0.5.12.post1.
        Rewrite("sglang/srt/model_executor/model_runner.py", ">=0.5.9,<0.5.14", widen_autotune_gate),
        # From 0.5.14 the gate moved; these only confirm that the fix is there.
        Rewrite("sglang/srt/model_executor/runner/base_runner.py", ">=0.5.14,<0.5.15", widen_autotune_gate),
        Rewrite("sglang/srt/model_executor/runner/flashinfer_autotune.py", ">=0.5.15,<0.5.24", widen_autotune_gate),
    ),
)
