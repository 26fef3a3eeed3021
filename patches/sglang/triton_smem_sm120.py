"""Keep sglang's Triton kernels within SM120's 101376 bytes of shared memory per block.

RTX PRO 6000 / RTX 50xx (compute capability 12.x) allow 101376 B per block against 232448
on Hopper; configs chosen for "capability > 8" crash there with `OutOfResources: shared
memory, Required: N, Hardware limit: 101376`. Each rewrite adds a branch taken only on
CUDA capability major 12, so every other GPU keeps upstream's choice. Proven by compiling
the real kernels for sm_120 with Triton (tests/test_smem_sm120.py).
"""

from __future__ import annotations

import ast

from sm120kit.patching import ast_tools
from sm120kit.patching.ast_tools import Undecided, compared, is_integer, is_name, one_per_line, starts_block, walk
from sm120kit.patching.cst_tools import carries, compares_to, cst, find_functions, insert_after, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

# context_attention_fwd: BLOCK=128 needs 163840 B at head_dim 256 (bf16) and 131072 B at
# 128 (fp32). Shared memory grows with BLOCK x the padded head row (next_power_of_2(Lk) x
# element size); measured on sm_120, BLOCK x row <= 32768 fits: a row of 256 B keeps 128,
# 512 B takes 64, 1024 B (fp32 at 256) takes 32.
CONTEXT_SM120 = """\
if _is_cuda and CUDA_CAPABILITY[0] == 12:
    BLOCK = max(16, min(BLOCK, 32768 // (triton.next_power_of_2(k.shape[-1]) * k.element_size())))
"""

# get_default_config, fp8 per-tensor: 128x256x128 with 4 stages needs 147456 B; these are
# the low-shared-memory defaults that upstream adopted in 0.5.14.
MOE_SM120 = """\
if not _is_hip and torch.cuda.get_device_capability()[0] == 12:
    config = (
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 64, "num_warps": 4, "num_stages": 2}
        if M > E
        else {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}
    )
"""


def _marked(code: str, ctx, why: str):
    return cst.parse_statement(code).with_changes(leading_lines=[marker_line(f"{ctx.marker}: {why}")])


def _assigns(node, name: str, value: str) -> bool:
    return any(
        isinstance(n, cst.Assign)
        and any(isinstance(t.target, cst.Name) and t.target.value == name for t in n.targets)
        and isinstance(n.value, cst.Integer)
        and n.value.value == value
        for n in iter_nodes(node)
    )


def verify_extend_sm120_branch(module, ctx):
    """0.5.9+ choose SM120 tiles upstream; nothing to write, but say so from the code."""
    found = find_functions(module, ["_get_block_sizes_for_extend_attention"])
    if not found:
        return AnchorMissing("no function _get_block_sizes_for_extend_attention")
    if compares_to(found[0][0], "12"):
        return FixedUpstream("_get_block_sizes_for_extend_attention has a capability-12 branch (PR #14311)")
    return AnchorMissing("_get_block_sizes_for_extend_attention has no capability-12 branch")


def limit_context_attention_block(module, ctx):
    found = find_functions(module, ["context_attention_fwd"])
    if not found:
        return AnchorMissing("no function context_attention_fwd")
    func, put = found[0]
    body = func.body.body
    if any(carries(stmt, ctx.marker) for stmt in body):
        return AlreadyApplied()
    if compares_to(func, "12"):
        return FixedUpstream("context_attention_fwd has a capability-12 branch")
    chosen = [i for i, stmt in enumerate(body) if isinstance(stmt, cst.If) and _assigns(stmt.body, "BLOCK", "128")]
    if len(chosen) != 1:
        return AnchorMissing(f"expected one `if ...: BLOCK = 128` in context_attention_fwd, found {len(chosen)}")
    new = _marked(CONTEXT_SM120, ctx, "a BLOCK whose tiles fit 101376 B on SM120")
    return Rewritten(put(func.with_changes(body=insert_after(func.body, chosen[0], new))))


def _is_none_test(node, name: str) -> bool:
    return (
        isinstance(node, cst.Comparison)
        and isinstance(node.left, cst.Name)
        and node.left.value == name
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, cst.Is)
        and isinstance(node.comparisons[0].comparator, cst.Name)
        and node.comparisons[0].comparator.value == "None"
    )


def limit_fp8_moe_default(module, ctx):
    found = find_functions(module, ["get_default_config"])
    if not found:
        return AnchorMissing("no function get_default_config")
    func, put = found[0]
    nodes = list(iter_nodes(func))
    if any(isinstance(n, cst.Name) and "low_smem" in n.value for n in nodes):
        return FixedUpstream("get_default_config picks low-shared-memory fp8 defaults")
    fp8 = [n for n in nodes if isinstance(n, cst.If) and _is_none_test(n.test, "block_shape")]
    if len(fp8) != 1:
        return AnchorMissing(f"expected one `if block_shape is None:` in get_default_config, found {len(fp8)}")
    branch = fp8[0]
    if any(carries(stmt, ctx.marker) for stmt in branch.body.body):
        return AlreadyApplied()
    new = _marked(MOE_SM120, ctx, "fp8 per-tensor MoE tiles that fit 101376 B on SM120")
    block = insert_after(branch.body, len(branch.body.body) - 1, new)
    return Rewritten(put(func.deep_replace(branch, branch.with_changes(body=block))))


# -- the same verdicts without libcst (sm120kit/patching/ast_tools.py) ----------------------


def quick_verify_extend_sm120_branch(code, ctx):
    found = code.functions(["_get_block_sizes_for_extend_attention"])
    if not found:
        return AnchorMissing("no function _get_block_sizes_for_extend_attention")
    if ast_tools.compares_to(code, found[0], "12"):
        return FixedUpstream("_get_block_sizes_for_extend_attention has a capability-12 branch (PR #14311)")
    return AnchorMissing("_get_block_sizes_for_extend_attention has no capability-12 branch")


def _quick_assigns(code, stmts, name: str, value: str) -> bool:
    return any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        and is_integer(code, n.value, value)
        for stmt in stmts
        for n in walk(stmt)
    )


def quick_limit_context_attention_block(code, ctx):
    found = code.functions(["context_attention_fwd"])
    if not found:
        return AnchorMissing("no function context_attention_fwd")
    func = found[0]
    marked = code.scope(func).marked(ctx.marker)
    one_per_line(func.body)
    if any(id(stmt) in marked for stmt in func.body):
        return AlreadyApplied()
    if ast_tools.compares_to(code, func, "12"):
        return FixedUpstream("context_attention_fwd has a capability-12 branch")
    chosen = [s for s in func.body if isinstance(s, ast.If) and _quick_assigns(code, s.body, "BLOCK", "128")]
    if len(chosen) != 1:
        return AnchorMissing(f"expected one `if ...: BLOCK = 128` in context_attention_fwd, found {len(chosen)}")
    return WouldRewrite()


def _quick_is_none_test(node, name: str) -> bool:
    left, right = compared(node, ast.Is) or (None, None)
    return is_name(left, name) and isinstance(right, ast.Constant) and right.value is None


def quick_limit_fp8_moe_default(code, ctx):
    found = code.functions(["get_default_config"])
    if not found:
        return AnchorMissing("no function get_default_config")
    func = found[0]
    scope = code.scope(func)
    if scope.has_name(func, "low_smem", part=True):
        return FixedUpstream("get_default_config picks low-shared-memory fp8 defaults")
    fp8 = [n for n in walk(func) if isinstance(n, ast.If) and _quick_is_none_test(n.test, "block_shape")]
    if len(fp8) != 1:
        return AnchorMissing(f"expected one `if block_shape is None:` in get_default_config, found {len(fp8)}")
    branch = fp8[0]
    if not starts_block(code, branch.body):
        raise Undecided("`if block_shape is None:` has its body on its line")
    one_per_line(branch.body)
    if any(id(stmt) in scope.marked(ctx.marker) for stmt in branch.body):
        return AlreadyApplied()
    return WouldRewrite()


_TRITON_OPS = "sglang/srt/layers/attention/triton_ops"
_KERNEL_OPS = "sglang/kernels/ops/attention"
_MOE_CONFIG = "fused_moe_triton_config.py"

PATCH = Patch(
    id="sglang-triton-smem-sm120",
    package="sglang",
    summary="Triton kernel configs that fit SM120's 101376 B of shared memory per block",
    why=(
        "Hopper-sized Triton tiles raise OutOfResources on RTX PRO 6000 / RTX 50xx: "
        "context_attention_fwd BLOCK=128 (163840 B at head_dim 256), the fp8 per-tensor "
        "fused-MoE default (147456 B), and extend attention on MLA before 0.5.9 (106496 B)."
    ),
    refs=("sgl-project/sglang#14311", "sgl-project/sglang#8513", "sgl-project/sglang#28019"),
    rewrites=(
        Rewrite(
            f"{_TRITON_OPS}/extend_attention.py",
            ">=0.5.9,<0.5.16",
            verify_extend_sm120_branch,
            fixed_in="0.5.9",
            quick=quick_verify_extend_sm120_branch,
        ),
        Rewrite(
            f"{_KERNEL_OPS}/extend_attention.py",
            ">=0.5.16,<=0.5.23",
            verify_extend_sm120_branch,
            fixed_in="0.5.9",
            quick=quick_verify_extend_sm120_branch,
        ),
        Rewrite(
            f"{_TRITON_OPS}/prefill_attention.py",
            ">=0.5.9,<0.5.16",
            limit_context_attention_block,
            quick=quick_limit_context_attention_block,
        ),
        Rewrite(
            f"{_KERNEL_OPS}/prefill_attention.py",
            ">=0.5.16,<=0.5.23",
            limit_context_attention_block,
            quick=quick_limit_context_attention_block,
        ),
        Rewrite(
            f"sglang/srt/layers/moe/fused_moe_triton/{_MOE_CONFIG}",
            ">=0.5.9,<0.5.11",
            limit_fp8_moe_default,
            fixed_in="0.5.14",
            quick=quick_limit_fp8_moe_default,
        ),
        Rewrite(
            f"sglang/srt/layers/moe/moe_runner/triton_utils/{_MOE_CONFIG}",
            ">=0.5.11,<=0.5.23",
            limit_fp8_moe_default,
            fixed_in="0.5.14",
            quick=quick_limit_fp8_moe_default,
        ),
    ),
)
