"""Compile the SM120 CUTLASS GEMM JIT modules with the GDC barriers turned on.

The "FlashInfer CUTLASS race condition" (issue #2708): the SM120 FP4 GEMM and the SM120
FP8 groupwise GEMM are launched with programmatic dependent launch (enablePDL=true), but
their JIT modules are built without -DCUTLASS_ENABLE_GDC_FOR_SM100, so CUTLASS compiles
griddepcontrol.wait / launch_dependents to nothing and a GEMM may read its input before the
previous kernel has written it: NaN/garbage 128-row tiles under concurrency (GLM-5 NVFP4,
TP8, >= 64 requests; "probability tensor contains inf/nan").

Upstream fixed it in 0.6.7 (PR #2780, the re-landing of the reverted #2716) with the SM100
flag alone: CUTLASS's grid_dependency_control.h enables GDC for the whole SM10x/SM12x
family on that flag, and -DCUTLASS_ENABLE_GDC_FOR_SM90 must NOT be added (it makes the
SM120 kernels call a scheduler method that does not exist: #2716 broke the AOT build).

The rewrite touches only fp4_gemm_cutlass_sm120 and gemm_sm120, whose nvcc targets are
restricted to major 12 (supported_major_versions=[12]; checked, else anchor-missing), so
no other GPU's build changes. flashinfer 0.6.3 writes a module's build.ninja only when it
is missing, so the modules' JIT cache directories must be removed for the flag to take
effect (the engine's job).
"""

from __future__ import annotations

import ast

from sm120kit.patching import ast_tools
from sm120kit.patching.ast_tools import is_string, one_per_line
from sm120kit.patching.cst_tools import (
    append_element,
    builds_only_for_major,
    callee_name,
    carries,
    cst,
    find_functions,
    has_string,
    marker_line,
)
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

FLAG = "-DCUTLASS_ENABLE_GDC_FOR_SM100=1"
# JIT generator -> module name: the SM120-only CUTLASS GEMMs launched with PDL.
FUNCTIONS = {
    "gen_gemm_sm120_module_cutlass_fp4": "fp4_gemm_cutlass_sm120",
    "gen_gemm_sm120_module": "gemm_sm120",
}


def _state(function: cst.FunctionDef, ctx) -> str:
    """ours | upstream | needed"""
    for stmt in function.body.body:
        if has_string(stmt, FLAG):
            return "ours" if carries(stmt, ctx.marker) else "upstream"
    return "needed"


def _with_flag(function: cst.FunctionDef, module_name: str, ctx) -> cst.FunctionDef | None:
    """`return gen_jit_spec("<module>", ..., extra_cuda_cflags=X, ...)`: FLAG joins X's list, or X + [FLAG]."""
    for stmt in function.body.body:
        if not (
            isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Return)
        ):
            continue
        call = stmt.body[0].value
        if not (isinstance(call, cst.Call) and callee_name(call) == "gen_jit_spec" and call.args):
            continue
        name = call.args[0].value
        if not (isinstance(name, cst.SimpleString) and name.evaluated_value == module_name):
            continue
        flags = [a for a in call.args if a.keyword is not None and a.keyword.value == "extra_cuda_cflags"]
        if len(flags) != 1:
            return None
        arg = flags[0]
        flag = cst.SimpleString(f'"{FLAG}"')
        value = arg.value
        if (
            isinstance(value, cst.BinaryOperation)
            and isinstance(value.operator, cst.Add)
            and isinstance(value.right, cst.List)
            and value.right.elements
        ):
            added = value.with_changes(right=append_element(value.right, flag))  # `nvcc_flags + [..., FLAG]`
        else:
            added = cst.BinaryOperation(left=value, operator=cst.Add(), right=cst.List([cst.Element(flag)]))
        new_call = call.with_changes(args=[a if a is not arg else arg.with_changes(value=added) for a in call.args])
        new_stmt = stmt.with_changes(
            body=[stmt.body[0].with_changes(value=new_call)],
            leading_lines=[
                *stmt.leading_lines,
                marker_line(f"{ctx.marker}: PDL barriers on (upstream 0.6.7, PR #2780)"),
            ],
        )
        return function.deep_replace(stmt, new_stmt)
    return None


def enable_gdc(module: cst.Module, ctx):
    states = {}
    for name, module_name in FUNCTIONS.items():
        found = find_functions(module, [name])
        if len(found) != 1:
            return AnchorMissing(f"expected one function {name}, found {len(found)}")
        function, put = found[0]
        states[name] = _state(function, ctx)
        if states[name] == "needed":
            if not builds_only_for_major(function, 12):
                return AnchorMissing(f"{name} is not restricted to supported_major_versions=[12]")
            new = _with_flag(function, module_name, ctx)
            if new is None:
                return AnchorMissing(f'no `return gen_jit_spec("{module_name}", ..., extra_cuda_cflags=...)` in {name}')
            module = put(new)
    if "needed" in states.values():
        return Rewritten(module)
    if "ours" in states.values():
        return AlreadyApplied()
    return FixedUpstream(f"{' and '.join(FUNCTIONS.values())} are built with {FLAG}")


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_spec_flags(code, function, module_name: str) -> bool:
    """Whether _with_flag finds its `return gen_jit_spec("<module>", ..., extra_cuda_cflags=X)`."""
    for stmt in function.body:
        call = stmt.value if isinstance(stmt, ast.Return) else None
        if not (isinstance(call, ast.Call) and ast_tools.callee_name(call) == "gen_jit_spec"):
            continue
        args = ast_tools.arguments(call)
        if not args or not is_string(code, args[0][1], module_name):
            continue
        return [name for name, _ in args].count("extra_cuda_cflags") == 1
    return False


def quick_enable_gdc(code, ctx):
    states = {}
    for name, module_name in FUNCTIONS.items():
        found = code.functions([name])
        if len(found) != 1:
            return AnchorMissing(f"expected one function {name}, found {len(found)}")
        function = found[0]
        scope = code.scope(function)
        one_per_line(function.body)
        flagged = [stmt for stmt in function.body if scope.has_string(stmt, FLAG)]
        states[name] = "needed" if not flagged else "ours" if id(flagged[0]) in scope.marked(ctx.marker) else "upstream"
        if states[name] == "needed":
            if not ast_tools.builds_only_for_major(code, function, 12):
                return AnchorMissing(f"{name} is not restricted to supported_major_versions=[12]")
            if not _quick_spec_flags(code, function, module_name):
                return AnchorMissing(f'no `return gen_jit_spec("{module_name}", ..., extra_cuda_cflags=...)` in {name}')
    if "needed" in states.values():
        return WouldRewrite()
    if "ours" in states.values():
        return AlreadyApplied()
    return FixedUpstream(f"{' and '.join(FUNCTIONS.values())} are built with {FLAG}")


PATCH = Patch(
    id="flashinfer-sm120-gemm-gdc",
    package="flashinfer-python",
    summary="Build the SM120 CUTLASS FP4/FP8 GEMM JIT modules with -DCUTLASS_ENABLE_GDC_FOR_SM100=1",
    why=(
        "Without the GDC define the PDL barriers of the SM120 CUTLASS GEMMs compile to no-ops: "
        "NaN/garbage output tiles under concurrency (issue #2708). Fixed in 0.6.7 by PR #2780, "
        "the SM100-flag-only re-landing of #2716."
    ),
    refs=("flashinfer-ai/flashinfer#2708", "flashinfer-ai/flashinfer#2716", "flashinfer-ai/flashinfer#2780"),
    fixed_in="0.6.7",
    rewrites=(
        # 0.6.3 carries the bug; from 0.6.7 the transform only confirms the upstream flag.
        Rewrite("flashinfer/jit/gemm/core.py", ">=0.6.3,<=0.7.4", enable_gdc, quick=quick_enable_gdc),
    ),
)
