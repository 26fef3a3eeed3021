"""Run MLA prefill on flashinfer when trtllm_mla is asked for on SM12x; keep its decode.

sglang admits `trtllm_mla` on every Blackwell ("only supported on Blackwell GPUs
(SM100/SM12x)": the check is `is_blackwell`, capability majors 10, 11 and 12), but its
prefill calls `flashinfer.prefill.trtllm_ragged_attention_deepseek`, whose
`TllmGenFmhaRunner` refuses anything but SM100/SM103 (and SM107 in later flashinfer): the
scheduler dies at the first prefill with `Error in function 'TllmGenFmhaRunner' at
.../fmhaRunner.cuh:NN: Unsupported architecture`. Decode works on SM12x (flashinfer
dispatches it to xqa; fp8 KV only before flashinfer 0.6.11), so only prefill moves: to
`flashinfer`, the MLA backend that trtllm_mla itself subclasses and falls back to, which
runs SM12x on its fa2 path.

The rewrite adds one branch, taken on capability major 12 only (the release's own
`is_sm120` probe), after sglang's own trtllm_mla validation; every other GPU keeps
upstream's resolution. 0.5.9-0.5.14 resolve backends in
`ServerArgs._handle_attention_backend_compatibility` (fields set in place); from 0.5.15 the
check is the `_mla_kv_cache_dtype_checks` pass of `arg_groups/overrides.py`, which declares
its decision by returning it.
"""

from __future__ import annotations

import ast

from sm120kit.patching import ast_tools
from sm120kit.patching.ast_tools import Undecided, one_per_line, walk
from sm120kit.patching.cst_tools import callee_name, carries, cst, find_functions, has_string, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

BACKEND = "trtllm_mla"
PREFILL_BACKEND = "flashinfer"
WHY = f"{BACKEND} prefill is SM100/SM103 only, SM12x prefills on {PREFILL_BACKEND}"
WARNING = (
    f"sm120kit: TRT-LLM MLA prefill kernels exist only for SM100/SM103 (TllmGenFmhaRunner: "
    f"Unsupported architecture on SM12x); prefill runs on {PREFILL_BACKEND}, decode stays on {BACKEND}."
)

# ServerArgs method (0.5.9-0.5.14) and resolution pass (0.5.15+) holding the trtllm_mla check.
METHOD = "_handle_attention_backend_compatibility"
PASS = "_mla_kv_cache_dtype_checks"

# The SM12x probe, spelled as the release spells its Blackwell probe in the same check.
SM120_PROBES = {"is_blackwell_supported": "is_sm120_supported()", "is_blackwell": "get_platform().is_sm120"}


def _probe_names(node) -> set[str]:
    """Names of `probe()` calls and `get_platform().probe` reads under `node`."""
    names = set()
    for n in iter_nodes(node):
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Name):
            names.add(n.func.value)
        elif isinstance(n, cst.Attribute) and isinstance(n.value, cst.Call) and callee_name(n.value) == "get_platform":
            names.add(n.attr.value)
    return names


def _gate(body) -> tuple[int, cst.If] | None:
    """sglang's `if <args>.attention_backend == "trtllm_mla" or ...:` validation block."""
    found = [
        (i, stmt)
        for i, stmt in enumerate(body)
        if isinstance(stmt, cst.If)
        and has_string(stmt.test, BACKEND)
        and "attention_backend" in {n.attr.value for n in iter_nodes(stmt.test) if isinstance(n, cst.Attribute)}
    ]
    return found[0] if len(found) == 1 else None


def _gates_by_architecture(body) -> bool:
    """Whether a trtllm_mla check already tells SM100 from SM12x (upstream's fix, PR #28837)."""
    for stmt in body:
        if isinstance(stmt, cst.If) and has_string(stmt.test, BACKEND):
            probes = _probe_names(stmt)
            if probes & {"is_sm100_supported", "is_sm100", "is_sm120_supported", "is_sm120", "device_sm"}:
                return True
    return False


def _module_binds(module, name: str) -> bool:
    """Whether a top-level import of `module` binds `name`."""
    return any(
        isinstance(small, cst.ImportFrom)
        and not isinstance(small.names, cst.ImportStar)
        and any((a.asname.name.value if a.asname else a.name.value) == name for a in small.names)
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
    )


def _branch(args: str, probe: str, effect: str, ctx) -> cst.BaseStatement:
    code = (
        f'if {probe} and ({args}.prefill_attention_backend or {args}.attention_backend) == "{BACKEND}":\n'
        f'    logger.warning("{WARNING}")\n'
        f"    {effect}\n"
    )
    return cst.parse_statement(code).with_changes(leading_lines=[marker_line(f"{ctx.marker}: {WHY}")])


def route_sm120_prefill(module, ctx):
    found = find_functions(module, (METHOD, PASS))
    if len(found) != 1:
        return AnchorMissing(f"expected one function {METHOD} / {PASS}, found {len(found)}")
    func, put = found[0]
    body = list(func.body.body)
    if any(carries(stmt, ctx.marker) for stmt in body):
        return AlreadyApplied()
    if _gates_by_architecture(body):
        return FixedUpstream(f"{func.name.value} already tells SM100 from SM12x for {BACKEND}")
    gate = _gate(body)
    if gate is None:
        return AnchorMissing(f'expected one `if ...attention_backend == "{BACKEND}"` check in {func.name.value}')
    index, block = gate
    probes = [SM120_PROBES[name] for name in SM120_PROBES if name in _probe_names(block)]
    if len(probes) != 1:
        return AnchorMissing(f"the {BACKEND} check in {func.name.value} calls no known Blackwell probe")
    probe = probes[0]
    if probe == "is_sm120_supported()" and not _module_binds(module, "is_sm120_supported"):
        return AnchorMissing("is_sm120_supported is not imported by the module")
    args = func.params.params[0].name.value
    if func.name.value == METHOD:
        # Fields are set in place; the branch follows the validation (and the page-size snap).
        branch = _branch(args, probe, f'{args}.prefill_attention_backend = "{PREFILL_BACKEND}"', ctx)
        new_body = [*body[: index + 1], branch, *body[index + 1 :]]
    else:
        # A pass declares what it returns; every check above still runs before the return.
        last = body[-1]
        if not (
            isinstance(last, cst.SimpleStatementLine)
            and isinstance(last.body[0], cst.Return)
            and isinstance(last.body[0].value, cst.Dict)
            and not last.body[0].value.elements
        ):
            return AnchorMissing(f"{PASS} does not end with `return {{}}`")
        branch = _branch(args, probe, f'return {{"prefill_attention_backend": "{PREFILL_BACKEND}"}}', ctx)
        new_body = [*body[:-1], branch, last]
    return Rewritten(put(func.with_changes(body=func.body.with_changes(body=new_body))))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_probe_names(node) -> set[str]:
    names = set()
    for n in walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            names.add(n.func.id)
        elif (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Call)
            and ast_tools.callee_name(n.value) == "get_platform"
        ):
            names.add(n.attr)
    return names


def _quick_module_binds(code, name: str) -> bool:
    return any(
        isinstance(stmt, ast.ImportFrom) and any((a.asname or a.name) == name for a in stmt.names if a.name != "*")
        for stmt in code.tree.body
    )


def quick_route_sm120_prefill(code, ctx):
    found = code.functions((METHOD, PASS))
    if len(found) != 1:
        return AnchorMissing(f"expected one function {METHOD} / {PASS}, found {len(found)}")
    func = found[0]
    scope = code.scope(func)
    body = func.body
    one_per_line(body)
    if any(id(stmt) in scope.marked(ctx.marker) for stmt in body):
        return AlreadyApplied()
    checks = [stmt for stmt in body if isinstance(stmt, ast.If) and scope.has_string(stmt.test, BACKEND)]
    known = {"is_sm100_supported", "is_sm100", "is_sm120_supported", "is_sm120", "device_sm"}
    if any(_quick_probe_names(stmt) & known for stmt in checks):
        return FixedUpstream(f"{func.name} already tells SM100 from SM12x for {BACKEND}")
    gates = [s for s in checks if "attention_backend" in {n.attr for n in walk(s.test) if isinstance(n, ast.Attribute)}]
    if len(gates) != 1:
        return AnchorMissing(f'expected one `if ...attention_backend == "{BACKEND}"` check in {func.name}')
    probes = [SM120_PROBES[name] for name in SM120_PROBES if name in _quick_probe_names(gates[0])]
    if len(probes) != 1:
        return AnchorMissing(f"the {BACKEND} check in {func.name} calls no known Blackwell probe")
    if probes[0] == "is_sm120_supported()" and not _quick_module_binds(code, "is_sm120_supported"):
        return AnchorMissing("is_sm120_supported is not imported by the module")
    if not func.args.args:
        raise Undecided(f"{func.name} takes no argument: the transform fails on it")
    last = body[-1]
    if func.name == PASS and not (
        isinstance(last, ast.Return) and isinstance(last.value, ast.Dict) and not last.value.keys
    ):
        return AnchorMissing(f"{PASS} does not end with `return {{}}`")
    return WouldRewrite()


PATCH = Patch(
    id="sglang-trtllm-mla-prefill-sm120",
    package="sglang",
    summary="trtllm_mla on SM12x: MLA prefill on flashinfer (TRT-LLM prefill is SM100/SM103 only), decode kept",
    why=(
        "sglang admits trtllm_mla on every Blackwell, but its ragged prefill kernel "
        "(flashinfer TllmGenFmhaRunner) exists only for SM100/SM103: 'Unsupported architecture' "
        "at the first prefill on RTX PRO 6000 / RTX 50xx / GB10. Decode works there (xqa). "
        "Open PR #28837 refuses trtllm_mla prefill off SM100; this routes it to flashinfer instead."
    ),
    refs=("sgl-project/sglang#24633", "flashinfer-ai/flashinfer#3263", "sgl-project/sglang#28837"),
    rewrites=(
        Rewrite("sglang/srt/server_args.py", ">=0.5.9,<0.5.15", route_sm120_prefill, quick=quick_route_sm120_prefill),
        Rewrite(
            "sglang/srt/arg_groups/overrides.py",
            ">=0.5.15,<=0.5.23",
            route_sm120_prefill,
            quick=quick_route_sm120_prefill,
        ),
    ),
)
