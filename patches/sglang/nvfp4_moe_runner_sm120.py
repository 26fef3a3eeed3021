"""Resolve `--moe-runner-backend auto` for NVFP4 (modelopt_fp4) MoE to FlashInfer's CUTLASS
runner on SM120, and make the "use the FlashInfer CUTLASS MoE" switch follow that choice.

From 0.5.13 `ModelOptNvFp4FusedMoEMethod.create_moe_runner` resolves `auto` to MARLIN on
capability 8.x-9.x and to FLASHINFER_TRTLLM on everything else, SM12x included, whose
trtllm-gen NVFP4 MoE kernels are SM100-only. Server args resolve `auto` to
flashinfer_cutlass on SM120 only when `--quantization modelopt_fp4` is given; a checkpoint
whose quantization is read from its config reaches the layer with `auto`. The weights are
then prepared for neither TRT-LLM nor CUTLASS (the switches read the unresolved global
backend), and the first forward fails: 0.5.16-0.5.20 raise "Unsupported moe_runner_backend
for NVFP4 MoE: MoeRunnerBackend.FLASHINFER_TRTLLM", 0.5.21-0.5.23 read the missing TRT-LLM
`g1_scale_c`; 0.5.13-0.5.15 fall through to sgl-kernel's cutlass_moe_fp4 instead.

On capability major 12 with one expert-parallel rank, `auto` becomes FLASHINFER_CUTLASS
(the SM120 CUTLASS NVFP4 grouped GEMM), and `enable_flashinfer_cutlass_moe`, which picks
the weight layout, the input scales and the kernel path, reads the backend
create_moe_runner resolved. With more than one EP rank upstream's choice stays: the token
dispatcher reads the global `auto` and would hand the CUTLASS kernel EP-local expert ids.
Every other GPU keeps upstream's behaviour.
"""

from __future__ import annotations

import ast

from sm120kit.patching import ast_tools
from sm120kit.patching.ast_tools import FUNCTIONS, assigned, blocks, one_per_line, walk
from sm120kit.patching.cst_tools import callee_name, carries, cst, find_functions, insert_after, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

RUNNER = "create_moe_runner"
SWITCH = "enable_flashinfer_cutlass_moe"
RESOLVED = "_moe_runner_backend"  # where create_moe_runner keeps its choice (0.5.13+)

SM120_CUTLASS = """\
if is_cuda() and get_device_capability()[0] == 12 and getattr(layer, "moe_ep_size", None) == 1:
    moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS
"""
RESOLVED_SWITCH = f'return getattr(self, "{RESOLVED}", get_moe_runner_backend()).is_flashinfer_cutlass()\n'

TODO, DONE, FIXED = "todo", "done", "fixed"


def _member(node: cst.CSTNode, name: str) -> bool:
    """Whether `MoeRunnerBackend.<name>` appears under `node`."""
    return any(
        isinstance(n, cst.Attribute)
        and n.attr.value == name
        and isinstance(n.value, cst.Name)
        and n.value.value == "MoeRunnerBackend"
        for n in iter_nodes(node)
    )


def _calls(node: cst.CSTNode, name: str) -> bool:
    return any(isinstance(n, cst.Call) and callee_name(n) == name for n in iter_nodes(node))


def _marked(node: cst.CSTNode, ctx) -> bool:
    return any(carries(n, ctx.marker) for n in iter_nodes(node))


def _auto_branch(runner: cst.FunctionDef) -> cst.If | None:
    """`if moe_runner_backend.is_auto():` in create_moe_runner's body."""
    for stmt in runner.body.body:
        if isinstance(stmt, cst.If) and isinstance(stmt.test, cst.Call) and callee_name(stmt.test) == "is_auto":
            return stmt
    return None


def _is_trtllm_default(stmt: cst.CSTNode) -> bool:
    """`moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM`"""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return False
    assign = stmt.body[0]
    return (
        len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
        and assign.targets[0].target.value == "moe_runner_backend"
        and isinstance(assign.value, cst.Attribute)
        and _member(assign.value, "FLASHINFER_TRTLLM")
    )


def _is_global_switch(stmt: cst.CSTNode) -> bool:
    """`return get_moe_runner_backend().is_flashinfer_cutlass()`"""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Return)):
        return False
    value = stmt.body[0].value
    return (
        isinstance(value, cst.Call)
        and callee_name(value) == "is_flashinfer_cutlass"
        and isinstance(value.func, cst.Attribute)
        and isinstance(value.func.value, cst.Call)
        and callee_name(value.func.value) == "get_moe_runner_backend"
    )


def _reads_resolved(switch: cst.FunctionDef) -> bool:
    return any(
        (isinstance(n, cst.Attribute) and n.attr.value == RESOLVED)
        or (isinstance(n, cst.SimpleString) and n.evaluated_value == RESOLVED)
        for n in iter_nodes(switch)
    )


def _nvfp4_methods(module: cst.Module):
    """(create_moe_runner, put), (enable_flashinfer_cutlass_moe, put) of the one class that
    has both (ModelOptNvFp4FusedMoEMethod; the FP8 MoE method has a create_moe_runner too)."""
    classes = [
        {s.name.value: s for s in c.body.body if isinstance(s, cst.FunctionDef)}
        for c in module.body
        if isinstance(c, cst.ClassDef) and isinstance(c.body, cst.IndentedBlock)
    ]
    owners = [m for m in classes if RUNNER in m and SWITCH in m]
    if len(owners) != 1:
        return None
    pick = {name: owners[0][name] for name in (RUNNER, SWITCH)}
    return tuple(
        next((f, put) for f, put in find_functions(module, [name]) if f is pick[name]) for name in (RUNNER, SWITCH)
    )


def _resolution(module: cst.Module, runner: cst.FunctionDef, ctx):
    """(state, site) of the auto resolution: site is (block, index) of the TRT-LLM default."""
    branch = _auto_branch(runner)
    if branch is None:
        # A fix may move the choice into a helper that create_moe_runner calls.
        called = {callee_name(n) for n in iter_nodes(runner) if isinstance(n, cst.Call)} - {None}
        helpers = [f for f, _ in find_functions(module, called)]
        if any(_calls(f, "is_auto") and _member(f, "FLASHINFER_CUTLASS") for f in helpers):
            return FIXED, None
        return None, f"{RUNNER} has no `if ....is_auto():` resolution"
    if _marked(branch, ctx):
        return DONE, None
    if _member(branch, "FLASHINFER_CUTLASS"):
        return FIXED, None
    sites = [
        (node, i)
        for node in iter_nodes(branch)
        if isinstance(node, cst.IndentedBlock)
        for i, stmt in enumerate(node.body)
        if _is_trtllm_default(stmt)
    ]
    if len(sites) != 1:
        return (
            None,
            f"expected one `moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM` under is_auto(), found {len(sites)}",
        )
    return TODO, sites[0]


def _switch(switch: cst.FunctionDef, ctx):
    """(state, index) of the return statement that reads the global backend."""
    body = switch.body.body
    if any(carries(stmt, ctx.marker) for stmt in body):
        return DONE, None
    if _reads_resolved(switch):
        return FIXED, None
    returns = [i for i, stmt in enumerate(body) if _is_global_switch(stmt)]
    if len(returns) != 1:
        return None, f"expected `return get_moe_runner_backend().is_flashinfer_cutlass()` in {SWITCH}"
    return TODO, returns[0]


def resolve_nvfp4_auto_on_sm120(module, ctx):
    found = _nvfp4_methods(module)
    if found is None:
        return AnchorMissing(f"no one class with both {RUNNER} and {SWITCH} (ModelOptNvFp4FusedMoEMethod)")
    (runner, put_runner), (switch, _) = found
    runner_state, site = _resolution(module, runner, ctx)
    switch_state, index = _switch(switch, ctx)
    for state, detail in ((runner_state, site), (switch_state, index)):
        if state is None:  # the detail is what was not found
            return AnchorMissing(detail)
    if TODO not in (runner_state, switch_state):
        if DONE in (runner_state, switch_state):
            return AlreadyApplied()
        return FixedUpstream(f"{RUNNER} resolves auto to FLASHINFER_CUTLASS and {SWITCH} reads the resolved backend")
    if runner_state == TODO:
        block, i = site
        branch = cst.parse_statement(SM120_CUTLASS).with_changes(
            leading_lines=[marker_line(f"{ctx.marker}: trtllm-gen NVFP4 MoE is SM100-only; SM12x runs the CUTLASS one")]
        )
        module = put_runner(runner.deep_replace(block, insert_after(block, i, branch)))
    if switch_state == TODO:
        (_, _), (switch, put_switch) = _nvfp4_methods(module)
        old = switch.body.body[index]
        new = cst.parse_statement(RESOLVED_SWITCH).with_changes(
            leading_lines=[*old.leading_lines, marker_line(f"{ctx.marker}: follow the backend {RUNNER} resolved")]
        )
        body = switch.body.with_changes(body=[*switch.body.body[:index], new, *switch.body.body[index + 1 :]])
        module = put_switch(switch.with_changes(body=body))
    return Rewritten(module)


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_member(node, name: str) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == name
        and isinstance(n.value, ast.Name)
        and n.value.id == "MoeRunnerBackend"
        for n in walk(node)
    )


def _quick_calls(node, name: str) -> bool:
    return any(isinstance(n, ast.Call) and ast_tools.callee_name(n) == name for n in walk(node))


def _quick_is_trtllm_default(stmt) -> bool:
    value = assigned(stmt, "moe_runner_backend")
    return isinstance(value, ast.Attribute) and _quick_member(value, "FLASHINFER_TRTLLM")


def _quick_is_global_switch(stmt) -> bool:
    value = stmt.value if isinstance(stmt, ast.Return) else None
    return (
        isinstance(value, ast.Call)
        and ast_tools.callee_name(value) == "is_flashinfer_cutlass"
        and isinstance(value.func, ast.Attribute)
        and isinstance(value.func.value, ast.Call)
        and ast_tools.callee_name(value.func.value) == "get_moe_runner_backend"
    )


def _quick_resolution(code, runner, ctx) -> tuple[str | None, str | None]:
    """(state, the anchor-missing reason)"""
    branches = [
        stmt
        for stmt in runner.body
        if isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Call)
        and ast_tools.callee_name(stmt.test) == "is_auto"
    ]
    if not branches:
        called = {ast_tools.callee_name(n) for n in walk(runner) if isinstance(n, ast.Call)} - {None}
        helpers = code.functions(called)
        if any(_quick_calls(f, "is_auto") and _quick_member(f, "FLASHINFER_CUTLASS") for f in helpers):
            return FIXED, None
        return None, f"{RUNNER} has no `if ....is_auto():` resolution"
    branch = branches[0]
    marked = code.scope(runner).marked(ctx.marker)
    if any(id(n) in marked for n in walk(branch)):
        return DONE, None
    if _quick_member(branch, "FLASHINFER_CUTLASS"):
        return FIXED, None
    sites = 0
    for block in blocks(code, branch):
        one_per_line(block)
        sites += sum(map(_quick_is_trtllm_default, block))
    if sites != 1:
        return (
            None,
            f"expected one `moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM` under is_auto(), found {sites}",
        )
    return TODO, None


def _quick_switch(code, switch, ctx) -> tuple[str | None, str | None]:
    scope = code.scope(switch)
    one_per_line(switch.body)
    if any(id(stmt) in scope.marked(ctx.marker) for stmt in switch.body):
        return DONE, None
    if any(isinstance(n, ast.Attribute) and n.attr == RESOLVED for n in walk(switch)) or scope.has_string(
        switch, RESOLVED
    ):
        return FIXED, None
    if sum(map(_quick_is_global_switch, switch.body)) != 1:
        return None, f"expected `return get_moe_runner_backend().is_flashinfer_cutlass()` in {SWITCH}"
    return TODO, None


def quick_resolve_nvfp4_auto_on_sm120(code, ctx):
    methods = [{f.name: f for f in c.body if isinstance(f, FUNCTIONS)} for c in code.classes()]
    owners = [m for m in methods if RUNNER in m and SWITCH in m]
    if len(owners) != 1:
        return AnchorMissing(f"no one class with both {RUNNER} and {SWITCH} (ModelOptNvFp4FusedMoEMethod)")
    runner_state, runner_missing = _quick_resolution(code, owners[0][RUNNER], ctx)
    switch_state, switch_missing = _quick_switch(code, owners[0][SWITCH], ctx)
    for state, missing in ((runner_state, runner_missing), (switch_state, switch_missing)):
        if state is None:
            return AnchorMissing(str(missing))
    if TODO not in (runner_state, switch_state):
        if DONE in (runner_state, switch_state):
            return AlreadyApplied()
        return FixedUpstream(f"{RUNNER} resolves auto to FLASHINFER_CUTLASS and {SWITCH} reads the resolved backend")
    return WouldRewrite()


PATCH = Patch(
    id="sglang-nvfp4-moe-runner-sm120",
    package="sglang",
    summary="NVFP4 MoE on --moe-runner-backend auto runs FlashInfer CUTLASS on SM120, not SM100-only TRT-LLM",
    why=(
        "ModelOptNvFp4FusedMoEMethod.create_moe_runner resolves auto to FLASHINFER_TRTLLM on every "
        "capability >= 10 and enable_flashinfer_cutlass_moe reads the unresolved backend: on SM120, "
        "unless --quantization modelopt_fp4 is passed (server args resolve auto only then), the first "
        "forward raises NotImplementedError (0.5.16-0.5.20) or AttributeError g1_scale_c (0.5.21+). "
        "Open upstream PR #39807."
    ),
    refs=("sgl-project/sglang#39807",),
    rewrites=(
        # 0.5.11-0.5.12.post1 resolve auto too but keep no resolved backend and never read it.
        Rewrite(
            "sglang/srt/layers/quantization/modelopt_quant.py",
            ">=0.5.13,<=0.5.23",
            resolve_nvfp4_auto_on_sm120,
            quick=quick_resolve_nvfp4_auto_on_sm120,
        ),
    ),
)
