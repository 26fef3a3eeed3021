"""Compile the SM120 CUTLASS fused-MoE JIT module with the GDC barriers turned on.

The same bug class as the GEMM race (issue #2708), in the MoE: the SM120 TMA
warp-specialised grouped GEMMs are run with programmatic dependent launch (the
`enable_pdl` of the MoE runner), but gen_cutlass_fused_moe_sm120_module builds them
without -DCUTLASS_ENABLE_GDC_FOR_SM100, so griddepcontrol.wait compiles to nothing: random
cudaErrorIllegalInstruction / corrupt experts on SM12x under load. Upstream added the flag
to every CUTLASS fused-MoE module in 0.6.8 (PR #2913).

The rewrite adds the flag to the SM120 module alone (its nvcc targets are restricted to
major 12; checked, else anchor-missing). The SM100/SM103/SM90 and trtllm-gen modules, which
Hopper and datacenter-Blackwell GPUs build, are left as upstream shipped them. Like the GEMM
patch it adds only the SM100 define (the SM90 one breaks SM120 builds, PR #2780).
flashinfer 0.6.3-0.6.8 write a module's build.ninja only when it is missing, so the
fused_moe_120 JIT cache directory must be removed for the flag to take effect.
"""

from __future__ import annotations

import ast

from sm120kit.patching import ast_tools
from sm120kit.patching.ast_tools import one_per_line
from sm120kit.patching.cst_tools import (
    append_element,
    builds_only_for_major,
    carries,
    cst,
    find_functions,
    has_string,
    marker_line,
)
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

FLAG = "-DCUTLASS_ENABLE_GDC_FOR_SM100=1"
FUNCTION = "gen_cutlass_fused_moe_sm120_module"
FLAGS_NAME = "nvcc_flags"


def _flags_assignment(function: cst.FunctionDef):
    """The first top-level `nvcc_flags = [...]` of the function, or None."""
    for stmt in function.body.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
            assign = stmt.body[0]
            targets = [t.target for t in assign.targets]
            if len(targets) == 1 and isinstance(targets[0], cst.Name) and targets[0].value == FLAGS_NAME:
                return stmt if isinstance(assign.value, cst.List) and assign.value.elements else None
    return None


def enable_gdc(module: cst.Module, ctx):
    found = find_functions(module, [FUNCTION])
    if len(found) != 1:
        return AnchorMissing(f"expected one function {FUNCTION}, found {len(found)}")
    function, put = found[0]
    for stmt in function.body.body:
        if has_string(stmt, FLAG):
            if carries(stmt, ctx.marker):
                return AlreadyApplied()
            return FixedUpstream(f"{FUNCTION} builds fused_moe_120 with {FLAG}")
    if not builds_only_for_major(function, 12):
        return AnchorMissing(f"{FUNCTION} is not restricted to supported_major_versions=[12]")
    stmt = _flags_assignment(function)
    if stmt is None:
        return AnchorMissing(f"no `{FLAGS_NAME} = [...]` list at the top level of {FUNCTION}")
    assign = stmt.body[0]
    new_stmt = stmt.with_changes(
        body=[assign.with_changes(value=append_element(assign.value, cst.SimpleString(f'"{FLAG}"')))],
        leading_lines=[*stmt.leading_lines, marker_line(f"{ctx.marker}: PDL barriers on (upstream 0.6.8, PR #2913)")],
    )
    return Rewritten(put(function.deep_replace(stmt, new_stmt)))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_flags_listed(function) -> bool:
    """Whether the first top-level `nvcc_flags = ...` of the function is a non-empty list."""
    for stmt in function.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name) and target.id == FLAGS_NAME:
                return isinstance(stmt.value, ast.List) and bool(stmt.value.elts)
    return False


def quick_enable_gdc(code, ctx):
    found = code.functions([FUNCTION])
    if len(found) != 1:
        return AnchorMissing(f"expected one function {FUNCTION}, found {len(found)}")
    function = found[0]
    scope = code.scope(function)
    one_per_line(function.body)
    for stmt in function.body:
        if scope.has_string(stmt, FLAG):
            if id(stmt) in scope.marked(ctx.marker):
                return AlreadyApplied()
            return FixedUpstream(f"{FUNCTION} builds fused_moe_120 with {FLAG}")
    if not ast_tools.builds_only_for_major(code, function, 12):
        return AnchorMissing(f"{FUNCTION} is not restricted to supported_major_versions=[12]")
    if not _quick_flags_listed(function):
        return AnchorMissing(f"no `{FLAGS_NAME} = [...]` list at the top level of {FUNCTION}")
    return WouldRewrite()


PATCH = Patch(
    id="flashinfer-sm120-fused-moe-gdc",
    package="flashinfer-python",
    summary="Build the SM120 CUTLASS fused-MoE JIT module with -DCUTLASS_ENABLE_GDC_FOR_SM100=1",
    why=(
        "Without the GDC define the PDL barriers of the SM120 CUTLASS grouped GEMMs compile to "
        "no-ops: random illegal-instruction crashes / corrupt MoE output on SM12x under load. "
        "Fixed in 0.6.8 by PR #2913 (same bug class as #2708)."
    ),
    refs=("flashinfer-ai/flashinfer#2913", "flashinfer-ai/flashinfer#2708"),
    fixed_in="0.6.8",
    rewrites=(
        # 0.6.3 and 0.6.7.postN carry the bug; from 0.6.8 the transform only confirms the flag.
        Rewrite("flashinfer/jit/fused_moe.py", ">=0.6.3,<=0.7.4", enable_gdc, quick=quick_enable_gdc),
    ),
)
