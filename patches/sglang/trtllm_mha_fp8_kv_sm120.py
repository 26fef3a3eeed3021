"""Give trtllm_mha a model-dtype KV cache on SM12x when `--kv-cache-dtype auto` would pick FP8.

ModelOpt checkpoints (NVFP4 among them) declare `kv_cache_quant_algo: FP8`, and with
`--kv-cache-dtype auto` sglang turns that into an fp8_e4m3 KV cache once the weights are
loaded (mem_cache/kv_cache_dtype.py, configure_kv_cache_dtype). From 0.5.19 trtllm_mha may
prefill on SM12x through FlashInfer's FMHAv2, which has no e4m3 kernel there: the first
prefill (a prefill CUDA-graph capture, or the first request) raises "FP8 (e4m3) is not yet
supported for FMHAv2 on SM120 (Blackwell). Use fp16 or bf16 instead." Upstream refuses an
explicit `--kv-cache-dtype fp8_e4m3` with trtllm_mha prefill on SM120 at argument time,
but `auto` is still `auto` then, so the checkpoint's FP8 gets through.

The rewrite resolves that `auto` to the model dtype instead, with a warning, on capability
major 12 and a trtllm_mha prefill backend only: the same cache `auto` gives a checkpoint
without FP8 KV, the one trtllm_mha's SM12x kernels (FMHAv2 prefill, XQA decode) run, and
the one FlashInfer's error asks for. Changing the attention backend is no longer possible
at this point (the backend, its page size and the CUDA-graph plan are resolved and shared
by every process), while choosing the KV dtype is this function's job. Capability 10 and
every other backend keep upstream's FP8 choice.
"""

from __future__ import annotations

import ast

from sm120kit.patching.ast_tools import Undecided, compared, is_name, is_string, starts_block, walk
from sm120kit.patching.cst_tools import carries, cst, find_functions, has_string, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

RESOLVER = "configure_kv_cache_dtype"
BACKEND = "trtllm_mha"
KEEP_MODEL_DTYPE = f"""\
from sglang.srt.runtime_context import attention_backends
if attention_backends()[0] == "{BACKEND}" and torch.cuda.get_device_capability()[0] == 12:
    logger.warning(
        "The checkpoint declares an FP8 KV cache, but trtllm_mha's FMHAv2 prefill has no "
        "FP8 (e4m3) kernel on SM12x: using a %s KV cache instead. Pass --kv-cache-dtype bf16 "
        "to choose this yourself, or another attention backend (e.g. --attention-backend "
        "flashinfer) to keep the FP8 KV cache.",
        model_dtype,
    )
    kv_cache_dtype = model_dtype
    resolved_kv_cache_dtype = None
"""


def _compares_to_string(node, name: str, value: str) -> bool:
    """`<name> == "<value>"`"""
    return (
        isinstance(node, cst.Comparison)
        and isinstance(node.left, cst.Name)
        and node.left.value == name
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, cst.Equal)
        and isinstance(node.comparisons[0].comparator, cst.SimpleString)
        and node.comparisons[0].comparator.evaluated_value == value
    )


def _is_fp8_algo_test(node) -> bool:
    """`... and kv_cache_quant_algo.upper() == "FP8"`: the checkpoint asks for FP8 KV."""
    return any(
        isinstance(n, cst.Comparison)
        and isinstance(n.left, cst.Call)
        and isinstance(n.left.func, cst.Attribute)
        and isinstance(n.left.func.value, cst.Name)
        and n.left.func.value.value == "kv_cache_quant_algo"
        and n.left.func.attr.value == "upper"
        and isinstance(n.comparisons[0].comparator, cst.SimpleString)
        and n.comparisons[0].comparator.evaluated_value == "FP8"
        for n in iter_nodes(node)
    )


def keep_model_dtype_kv(module, ctx):
    found = [(f, put) for f, put in find_functions(module, [RESOLVER]) if f.params.kwonly_params]
    if not found:
        return AnchorMissing(f"no keyword-only function {RESOLVER}")
    func, put = found[0]
    if any(carries(n, ctx.marker) for n in iter_nodes(func)):
        return AlreadyApplied()
    if has_string(func, BACKEND):
        return FixedUpstream(f"{RESOLVER} already weighs the {BACKEND} backend")
    autos = [
        n
        for n in iter_nodes(func)
        if isinstance(n, cst.If) and _compares_to_string(n.test, "server_args_kv_cache_dtype", "auto")
    ]
    branches = [n for a in autos for n in iter_nodes(a.body) if isinstance(n, cst.If) and _is_fp8_algo_test(n.test)]
    if len(branches) != 1:
        return AnchorMissing(
            f"expected one kv_cache_quant_algo FP8 branch under `auto` in {RESOLVER}, found {len(branches)}"
        )
    branch = branches[0]
    body = list(branch.body.body)
    assigned = {
        t.target.value
        for stmt in body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, cst.Assign)
        for t in small.targets
        if isinstance(t.target, cst.Name)
    }
    if not {"kv_cache_dtype", "resolved_kv_cache_dtype"} <= assigned:
        return AnchorMissing("the FP8 branch no longer sets kv_cache_dtype and resolved_kv_cache_dtype")
    first, second = cst.parse_module(KEEP_MODEL_DTYPE).body
    first = first.with_changes(
        leading_lines=[marker_line(f"{ctx.marker}: no FP8 FMHAv2 prefill on SM12x -> model-dtype KV for trtllm_mha")]
    )
    new_branch = branch.with_changes(body=branch.body.with_changes(body=[*body, first, second]))
    return Rewritten(put(func.deep_replace(branch, new_branch)))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_compares_to_string(code, node, name: str, value: str) -> bool:
    left, right = compared(node, ast.Eq) or (None, None)
    return is_name(left, name) and is_string(code, right, value)


def _quick_is_fp8_algo_test(code, node) -> bool:
    return any(
        isinstance(n, ast.Compare)
        and isinstance(n.left, ast.Call)
        and isinstance(n.left.func, ast.Attribute)
        and isinstance(n.left.func.value, ast.Name)
        and n.left.func.value.id == "kv_cache_quant_algo"
        and n.left.func.attr == "upper"
        and is_string(code, n.comparators[0], "FP8")
        for n in walk(node)
    )


def quick_keep_model_dtype_kv(code, ctx):
    found = [f for f in code.functions([RESOLVER]) if f.args.kwonlyargs]
    if not found:
        return AnchorMissing(f"no keyword-only function {RESOLVER}")
    func = found[0]
    scope = code.scope(func)
    if scope.marked(ctx.marker):  # any statement of it, itself included
        return AlreadyApplied()
    if scope.has_string(func, BACKEND):
        return FixedUpstream(f"{RESOLVER} already weighs the {BACKEND} backend")
    autos = [
        n
        for n in walk(func)
        if isinstance(n, ast.If) and _quick_compares_to_string(code, n.test, "server_args_kv_cache_dtype", "auto")
    ]
    branches = [
        n
        for a in autos
        for stmt in a.body
        for n in walk(stmt)
        if isinstance(n, ast.If) and _quick_is_fp8_algo_test(code, n.test)
    ]
    if len(branches) != 1:
        return AnchorMissing(
            f"expected one kv_cache_quant_algo FP8 branch under `auto` in {RESOLVER}, found {len(branches)}"
        )
    branch = branches[0]
    if not starts_block(code, branch.body):
        raise Undecided("the FP8 branch has its body on its line")
    assigned = {
        t.id for stmt in branch.body if isinstance(stmt, ast.Assign) for t in stmt.targets if isinstance(t, ast.Name)
    }
    if not {"kv_cache_dtype", "resolved_kv_cache_dtype"} <= assigned:
        return AnchorMissing("the FP8 branch no longer sets kv_cache_dtype and resolved_kv_cache_dtype")
    return WouldRewrite()


PATCH = Patch(
    id="sglang-trtllm-mha-fp8-kv-sm120",
    package="sglang",
    summary="trtllm_mha on SM12x: `--kv-cache-dtype auto` keeps a model-dtype KV cache for FP8-KV checkpoints",
    why=(
        "ModelOpt checkpoints declare kv_cache_quant_algo FP8, so `auto` becomes fp8_e4m3 after loading; "
        "trtllm_mha prefills on SM12x through FMHAv2, which has no e4m3 kernel there, and the first "
        "prefill raises. Upstream refuses only an explicit fp8_e4m3 at argument time."
    ),
    refs=("sgl-project/sglang#39807", "sgl-project/sglang#31959"),
    # 0.5.9-0.5.18 refuse trtllm_mha prefill off SM100 at argument time; 0.5.19 opened SM120.
    rewrites=(
        Rewrite(
            "sglang/srt/mem_cache/kv_cache_dtype.py",
            ">=0.5.19,<=0.5.23",
            keep_model_dtype_kv,
            quick=quick_keep_model_dtype_kv,
        ),
    ),
)
