"""JIT-compile for compute_120f (the SM12x family target) on an SM 12.0 GPU.

flashinfer 0.6.3 (pinned by sglang 0.5.9) gives every GPU of major >= 9 the "a" suffix,
so an RTX PRO 6000 / RTX 5090 builds its JIT kernels for compute_120a. PR #2725 reports
every TMA warp-specialised grouped-GEMM tactic of the CUTLASS MoE failing there (NVFP4
Qwen3.5-397B: 14.6 tok/s with compute_120a on CUDA 12.8, 39.0 with compute_120f on CUDA
13.0); upstream moved SM 12.0 to compute_120f in 0.6.7 (PR #2725; "CUDA >= 12.9" by #2839).

The rewrite adds one statement after the suffix rule in CompilationContext.__init__: for
exactly (12, "0a") and a CUDA toolkit >= 12.9 the minor becomes "0f". Every other
capability keeps 0.6.3's answer, a toolkit below 12.9 (no family targets) or one that
cannot be queried keeps compute_120a, an explicit FLASHINFER_CUDA_ARCH_LIST is untouched,
and SM 12.1 stays 121a (as in every release from 0.6.8). The result equals what 0.7.x
computes for every capability (where 0.7.x does not refuse the toolkit).

The arch string is part of flashinfer's JIT workspace (~/.cache/flashinfer/<ver>/120f/),
so the change starts a fresh cache by itself.
"""

from __future__ import annotations

import ast

from sm120kit.patching.ast_tools import blocks, walk
from sm120kit.patching.cst_tools import cst, find_functions, has_string, insert_after, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

CLASS = "CompilationContext"
SUFFIX_RULE = "major >= 9"  # the test of upstream's `if major >= 9: minor = str(minor) + "a"`
ADDED_TEST = 'major == 12 and minor == "0a"'
ADDED = f"""\
if {ADDED_TEST}:
    try:
        from flashinfer.jit.cpp_ext import is_cuda_version_at_least

        if is_cuda_version_at_least("12.9"):
            minor = "0f"
    except Exception:
        pass
"""


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node).strip()


def _method(module: cst.Module, name: str):
    """`CompilationContext.<name>` and its put(), or (None, None)."""
    classes = [s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == CLASS]
    for function, put in find_functions(module, [name]):
        if any(f is function for c in classes if isinstance(c.body, cst.IndentedBlock) for f in c.body.body):
            return function, put
    return None, None


def use_family_target(module: cst.Module, ctx):
    normalize, _ = _method(module, "_normalize_cuda_arch")
    if normalize is not None:
        if has_string(normalize, "0f"):
            # Only on CUDA >= 12.9: below it 0.6.7-0.7.0 refuse and 0.7.1+ build compute_120a again
            # (known failure flashinfer-compute-120a); `sm120kit doctor` shows the node's nvcc.
            return FixedUpstream(
                f"{CLASS}._normalize_cuda_arch maps SM 12.0 to compute_120f with CUDA >= 12.9 "
                "(`sm120kit doctor` shows the nvcc flashinfer compiles with)"
            )
        return AnchorMissing(f"{CLASS}._normalize_cuda_arch exists but has no 120f rule")
    init, put = _method(module, "__init__")
    if init is None:
        return AnchorMissing(f"no {CLASS}.__init__")
    ifs = [n for n in iter_nodes(init) if isinstance(n, cst.If)]
    if any(_code(n.test) == ADDED_TEST for n in ifs):
        return AlreadyApplied()
    rules = [n for n in ifs if _code(n.test) == SUFFIX_RULE]
    if len(rules) != 1:
        return AnchorMissing(f"expected one `if {SUFFIX_RULE}:` in {CLASS}.__init__, found {len(rules)}")
    rule = rules[0]
    if not has_string(rule, "a"):
        return AnchorMissing(f"`if {SUFFIX_RULE}:` in {CLASS}.__init__ does not add the 'a' suffix")
    blocks = [n for n in iter_nodes(init) if isinstance(n, cst.IndentedBlock) and any(s is rule for s in n.body)]
    if len(blocks) != 1:
        return AnchorMissing(f"cannot place the SM 12.0 rule after `if {SUFFIX_RULE}:`")
    block = blocks[0]
    added = cst.parse_statement(ADDED).with_changes(
        leading_lines=[marker_line(f"{ctx.marker}: SM 12.0 -> compute_120f on CUDA >= 12.9 (upstream 0.6.7)")]
    )
    at = next(i for i, s in enumerate(block.body) if s is rule)
    return Rewritten(put(init.deep_replace(block, insert_after(block, at, added))))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_method(code, name: str):
    """`CompilationContext.<name>`, or None."""
    classes = [c for c in code.classes() if c.name == CLASS]
    for function in code.functions([name]):
        if any(f is function for c in classes for f in c.body):
            return function
    return None


def quick_use_family_target(code, ctx):
    normalize = _quick_method(code, "_normalize_cuda_arch")
    if normalize is not None:
        if code.scope(normalize).has_string(normalize, "0f"):
            return FixedUpstream(
                f"{CLASS}._normalize_cuda_arch maps SM 12.0 to compute_120f with CUDA >= 12.9 "
                "(`sm120kit doctor` shows the nvcc flashinfer compiles with)"
            )
        return AnchorMissing(f"{CLASS}._normalize_cuda_arch exists but has no 120f rule")
    init = _quick_method(code, "__init__")
    if init is None:
        return AnchorMissing(f"no {CLASS}.__init__")
    ifs = [n for n in walk(init) if isinstance(n, ast.If)]
    if any(code.test_is(n, ADDED_TEST) for n in ifs):
        return AlreadyApplied()
    rules = [n for n in ifs if code.test_is(n, SUFFIX_RULE)]
    if len(rules) != 1:
        return AnchorMissing(f"expected one `if {SUFFIX_RULE}:` in {CLASS}.__init__, found {len(rules)}")
    rule = rules[0]
    if not code.scope(init).has_string(rule, "a"):
        return AnchorMissing(f"`if {SUFFIX_RULE}:` in {CLASS}.__init__ does not add the 'a' suffix")
    if sum(any(s is rule for s in block) for block in blocks(code, init)) != 1:
        return AnchorMissing(f"cannot place the SM 12.0 rule after `if {SUFFIX_RULE}:`")
    return WouldRewrite()


PATCH = Patch(
    id="flashinfer-sm120-arch-suffix",
    package="flashinfer-python",
    summary="JIT-compile for compute_120f instead of compute_120a on SM 12.0 (CUDA >= 12.9)",
    why=(
        "flashinfer before 0.6.7 targets compute_120a on SM120, where PR #2725 reports every TMA "
        "warp-specialised grouped-GEMM tactic of the CUTLASS MoE failing (14.6 vs 39.0 tok/s with "
        "compute_120f); 0.6.7 normalises SM 12.0 to compute_120f on CUDA >= 12.9 (PR #2725, #2839)."
    ),
    refs=("flashinfer-ai/flashinfer#2725", "flashinfer-ai/flashinfer#2839", "flashinfer-ai/flashinfer#2927"),
    fixed_in="0.6.7",
    rewrites=(
        # 0.6.3 carries the bug; from 0.6.7 the transform only confirms the upstream rule.
        Rewrite(
            "flashinfer/compilation_context.py", ">=0.6.3,<=0.7.4", use_family_target, quick=quick_use_family_target
        ),
    ),
)
