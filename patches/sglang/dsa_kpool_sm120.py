"""Keep SM12x off the TRT-LLM kernel when a k-pool DSA model picks flashmla_sparse.

Models with `index_kpool > 1` (GLM-5.3-Flash, Glm5NextForConditionalGeneration: 4) append
tail tokens to the top-k indices, and `_resolve_kpool_tail_backend` moves a flashmla_sparse
call to a backend that reads them: fa3 on SM90, trtllm on every capability >= 10. trtllm's
TllmGen FMHA kernels are built for SM100/SM103 only, so on an RTX PRO 6000 / RTX 50xx
(capability 12) the first forward dies inside flashinfer with `TllmGenFmhaRunner ...
Unsupported architecture`. The rewrite keeps capability 12 on upstream's fallback for
other GPUs (the impl it was given), so sglang's own check right after it refuses with its
NotImplementedError that names the backends which can serve the tail. Every other GPU keeps
upstream's choice. Models without k-pool (GLM-5, GLM-5.1: index_kpool 1) never reach it.
"""

from __future__ import annotations

import ast

from sm120kit.patching.ast_tools import compared, is_integer, is_string, one_per_line, walk
from sm120kit.patching.cst_tools import carries, cst, find_functions, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

RESOLVER = "_resolve_kpool_tail_backend"
SM12_FALLBACK = """\
if self.device_sm_major == 12:
    return dsa_impl
"""


def _major_at_least_10(test) -> bool:
    """`self.device_sm_major >= 10`"""
    return (
        isinstance(test, cst.Comparison)
        and isinstance(test.left, cst.Attribute)
        and test.left.attr.value == "device_sm_major"
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].operator, cst.GreaterThanEqual)
        and isinstance(test.comparisons[0].comparator, cst.Integer)
        and test.comparisons[0].comparator.value == "10"
    )


def _returns_trtllm(branch) -> bool:
    """`if ...: return "trtllm"`"""
    return any(
        isinstance(n, cst.Return) and isinstance(n.value, cst.SimpleString) and n.value.evaluated_value == "trtllm"
        for n in iter_nodes(branch.body)
    )


def _tests_major_12(func) -> bool:
    """Any comparison with 12 (`== 12`, `!= 12`, `< 12`)."""
    return any(
        isinstance(n, cst.Comparison)
        and any(isinstance(t.comparator, cst.Integer) and t.comparator.value == "12" for t in n.comparisons)
        for n in iter_nodes(func)
    )


def _reads_major(test) -> bool:
    return any(isinstance(n, cst.Attribute) and n.attr.value == "device_sm_major" for n in iter_nodes(test))


def keep_sm12_off_trtllm(module, ctx):
    found = find_functions(module, [RESOLVER])
    if not found:
        return AnchorMissing(f"no method {RESOLVER}")
    func, put = found[0]
    body = list(func.body.body)
    if any(carries(stmt, ctx.marker) for stmt in body):
        return AlreadyApplied()
    if _tests_major_12(func):
        return FixedUpstream(f"{RESOLVER} has a capability-12 test")
    to_trtllm = [i for i, stmt in enumerate(body) if isinstance(stmt, cst.If) and _returns_trtllm(stmt)]
    blackwell = [i for i in to_trtllm if _major_at_least_10(body[i].test)]
    if not blackwell and to_trtllm and all(_reads_major(body[i].test) for i in to_trtllm):
        return FixedUpstream(f"{RESOLVER} no longer sends every capability >= 10 to trtllm")
    if len(blackwell) != 1:
        return AnchorMissing(f'expected one `if self.device_sm_major >= 10: return "trtllm"` in {RESOLVER}')
    i = blackwell[0]
    new = cst.parse_statement(SM12_FALLBACK).with_changes(
        leading_lines=[*body[i].leading_lines, marker_line(f"{ctx.marker}: TllmGen FMHA has no SM12x kernels")]
    )
    block = func.body.with_changes(body=[*body[:i], new, body[i].with_changes(leading_lines=[]), *body[i + 1 :]])
    return Rewritten(put(func.with_changes(body=block)))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_major_at_least_10(code, test) -> bool:
    left, right = compared(test, ast.GtE) or (None, None)
    return isinstance(left, ast.Attribute) and left.attr == "device_sm_major" and is_integer(code, right, "10")


def _quick_returns_trtllm(code, branch) -> bool:
    return any(
        isinstance(n, ast.Return) and is_string(code, n.value, "trtllm") for stmt in branch.body for n in walk(stmt)
    )


def quick_keep_sm12_off_trtllm(code, ctx):
    found = code.functions([RESOLVER])
    if not found:
        return AnchorMissing(f"no method {RESOLVER}")
    func = found[0]
    marked = code.scope(func).marked(ctx.marker)
    one_per_line(func.body)
    if any(id(stmt) in marked for stmt in func.body):
        return AlreadyApplied()
    if any(isinstance(n, ast.Compare) and any(is_integer(code, c, "12") for c in n.comparators) for n in walk(func)):
        return FixedUpstream(f"{RESOLVER} has a capability-12 test")
    to_trtllm = [stmt for stmt in func.body if isinstance(stmt, ast.If) and _quick_returns_trtllm(code, stmt)]
    blackwell = [stmt for stmt in to_trtllm if _quick_major_at_least_10(code, stmt.test)]
    reads_major = [
        any(isinstance(n, ast.Attribute) and n.attr == "device_sm_major" for n in walk(s.test)) for s in to_trtllm
    ]
    if not blackwell and to_trtllm and all(reads_major):
        return FixedUpstream(f"{RESOLVER} no longer sends every capability >= 10 to trtllm")
    if len(blackwell) != 1:
        return AnchorMissing(f'expected one `if self.device_sm_major >= 10: return "trtllm"` in {RESOLVER}')
    return WouldRewrite()


PATCH = Patch(
    id="sglang-dsa-kpool-sm120",
    package="sglang",
    summary="k-pool DSA tail on SM12x: sglang's own NotImplementedError, not a TllmGen crash",
    why=(
        "_resolve_kpool_tail_backend sends a flashmla_sparse call with index_kpool > 1 "
        "(GLM-5.3-Flash) to trtllm on every capability >= 10; TllmGen FMHA has no SM120 "
        "kernels (Unsupported architecture). No backend in these releases serves the k-pool "
        "tail on SM12x: trtllm is not built for it, fa3 is SM90-only and TileLang's kernel "
        "asks for 169984 B of shared memory (#37105; the limit is 101376)."
    ),
    refs=("sgl-project/sglang#37105", "sgl-project/sglang#36507"),
    rewrites=(
        Rewrite(
            "sglang/srt/layers/attention/dsa/dsa_backend_kpool.py",
            ">=0.5.20,<=0.5.23",
            keep_sm12_off_trtllm,
            quick=quick_keep_sm12_off_trtllm,
        ),
    ),
)
