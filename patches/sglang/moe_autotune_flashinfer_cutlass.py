"""Run FlashInfer autotune for the flashinfer_cutlass MoE runner on SM120.

Releases 0.5.7-0.5.12.post1 gate autotune on a list of MoE backends in which
"flashinfer_cutlass" is commented out ("will cause some flashinfer compilation errors"),
so an SM120 node serving NVFP4 experts with --moe-runner-backend flashinfer_cutlass runs
untuned tactics. The rewrite widens the gate for compute capability major 12 only, so
every other GPU keeps upstream's behaviour; 0.5.13 enabled the entry for all GPUs.
"""

from __future__ import annotations

import ast

from sm120kit.patching.ast_tools import compared, is_name, is_string, walk
from sm120kit.patching.cst_tools import cst, find_functions, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

GATES = ("_should_run_flashinfer_autotune", "should_run_flashinfer_autotune")
BACKEND = "flashinfer_cutlass"
SM120_CLAUSE = f'not (backend_str == "{BACKEND}" and torch.cuda.get_device_capability()[0] == 12)'


def _is_string(node: cst.CSTNode, value: str) -> bool:
    return isinstance(node, cst.SimpleString) and node.evaluated_value == value


def _is_gate_test(node: cst.CSTNode) -> bool:
    """`backend_str not in [...]`"""
    return (
        isinstance(node, cst.Comparison)
        and isinstance(node.left, cst.Name)
        and node.left.value == "backend_str"
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, cst.NotIn)
        and isinstance(node.comparisons[0].comparator, cst.List)
    )


def _is_patched_test(node: cst.CSTNode) -> bool:
    """`backend_str not in [...] and not (backend_str == "flashinfer_cutlass" and ...)`"""
    if not (isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And)):
        return False
    clause = node.right
    return (
        _is_gate_test(node.left)
        and isinstance(clause, cst.UnaryOperation)
        and isinstance(clause.operator, cst.Not)
        and isinstance(clause.expression, cst.BooleanOperation)
        and isinstance(clause.expression.left, cst.Comparison)
        and _is_string(clause.expression.left.comparisons[0].comparator, BACKEND)
    )


def widen_autotune_gate(module: cst.Module, ctx):
    gates = find_functions(module, GATES)
    if not gates:
        return AnchorMissing(f"no function {' / '.join(GATES)}")
    gate, put = gates[0]
    nodes = list(iter_nodes(gate))
    if any(isinstance(n, cst.List) and any(_is_string(e.value, BACKEND) for e in n.elements) for n in nodes):
        return FixedUpstream(f'"{BACKEND}" is in the autotune list of {gate.name.value}')
    ifs = [n for n in nodes if isinstance(n, cst.If)]
    if any(_is_patched_test(n.test) for n in ifs):
        return AlreadyApplied()
    tests = [n for n in ifs if _is_gate_test(n.test)]
    if len(tests) != 1:
        return AnchorMissing(f"expected one `if backend_str not in [...]` in {gate.name.value}, found {len(tests)}")
    old = tests[0]
    new = old.with_changes(
        test=cst.BooleanOperation(left=old.test, operator=cst.And(), right=cst.parse_expression(SM120_CLAUSE)),
        leading_lines=[*old.leading_lines, marker_line(f"{ctx.marker}: autotune {BACKEND} MoE on SM120")],
    )
    return Rewritten(put(gate.deep_replace(old, new)))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_is_gate_test(node) -> bool:
    left, right = compared(node, ast.NotIn) or (None, None)
    return is_name(left, "backend_str") and isinstance(right, ast.List)


def _quick_is_patched_test(code, node) -> bool:
    """libcst nests `a and b and c` to the left; ast keeps one BoolOp of all the operands."""
    if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) and len(node.values) == 2):
        return False
    left, clause = node.values
    inner = clause.operand if isinstance(clause, ast.UnaryOp) and isinstance(clause.op, ast.Not) else None
    return (
        _quick_is_gate_test(left)
        and isinstance(inner, ast.BoolOp)
        and len(inner.values) == 2
        and isinstance(inner.values[0], ast.Compare)
        and is_string(code, inner.values[0].comparators[0], BACKEND)
    )


def quick_widen_autotune_gate(code, ctx):
    gates = code.functions(GATES)
    if not gates:
        return AnchorMissing(f"no function {' / '.join(GATES)}")
    gate = gates[0]
    nodes = list(walk(gate))
    lists = [n for n in nodes if isinstance(n, ast.List)]
    if any(is_string(code, e.value if isinstance(e, ast.Starred) else e, BACKEND) for n in lists for e in n.elts):
        return FixedUpstream(f'"{BACKEND}" is in the autotune list of {gate.name}')
    ifs = [n for n in nodes if isinstance(n, ast.If)]
    if any(_quick_is_patched_test(code, n.test) for n in ifs):
        return AlreadyApplied()
    tests = [n for n in ifs if _quick_is_gate_test(n.test)]
    if len(tests) != 1:
        return AnchorMissing(f"expected one `if backend_str not in [...]` in {gate.name}, found {len(tests)}")
    return WouldRewrite()


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
        Rewrite(
            "sglang/srt/model_executor/model_runner.py",
            ">=0.5.9,<0.5.14",
            widen_autotune_gate,
            quick=quick_widen_autotune_gate,
        ),
        # From 0.5.14 the gate moved; these only confirm that the fix is there.
        Rewrite(
            "sglang/srt/model_executor/runner/base_runner.py",
            ">=0.5.14,<0.5.15",
            widen_autotune_gate,
            quick=quick_widen_autotune_gate,
        ),
        Rewrite(
            "sglang/srt/model_executor/runner/flashinfer_autotune.py",
            ">=0.5.15,<=0.5.23",
            widen_autotune_gate,
            quick=quick_widen_autotune_gate,
        ),
    ),
)
