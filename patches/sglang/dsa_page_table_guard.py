"""Fall back to the one-shot KV indices when the attention backend has no DSA page table.

GLM-5 on SM120 runs with a non-DSA attention backend (e.g. --attention-backend flashinfer).
With an fp8 KV cache and a cached prefix (a radix hit, or the second chunk of a long
prompt) the MHA one-shot path reads `forward_metadata.page_table_1_flattened`, which only
the NSA/DSA backend's metadata has: AttributeError, and the scheduler dies. That is why
the field reports ran --disable-radix-cache.

The fallback `forward_batch.fetch_mha_one_shot_kv_indices()` is what the same caller uses
for the non-fp8 path, and it returns exactly what the DSA backend would have built: the
concatenation of req_to_token[req, :seq_len] over the batch (MHA one-shot only runs for
non-speculative extend, where the indexer's lengths equal seq_lens). On the DSA backend
the table is present and is used as before.
"""

from __future__ import annotations

import ast

from sm120kit.patching.ast_tools import assigned, one_per_line
from sm120kit.patching.cst_tools import carries, cst, find_functions, iter_nodes, marker_line
from sm120kit.patching.spec import AlreadyApplied, AnchorMissing, FixedUpstream, Patch, Rewrite, Rewritten, WouldRewrite

READERS = ("_get_mla_kv_buffer_from_fp8_for_nsa", "_get_mla_kv_buffer_from_fp8_for_dsa")
FIELD = "page_table_1_flattened"
GUARDED = f"""\
kv_indices = getattr(getattr(backend, "forward_metadata", None), "{FIELD}", None)
if kv_indices is None:
    kv_indices = forward_batch.fetch_mha_one_shot_kv_indices()
"""


def _reads_table(stmt) -> bool:
    """`kv_indices = backend.forward_metadata.page_table_1_flattened`"""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return False
    assign = stmt.body[0]
    value = assign.value
    return (
        len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
        and assign.targets[0].target.value == "kv_indices"
        and isinstance(value, cst.Attribute)
        and value.attr.value == FIELD
    )


def guard_page_table(module, ctx):
    found = find_functions(module, READERS)
    if not found:
        return AnchorMissing(f"no method {' / '.join(READERS)}")
    func, put = found[0]
    body = list(func.body.body)
    if any(carries(stmt, ctx.marker) for stmt in body):
        return AlreadyApplied()
    if any(isinstance(n, cst.Name) and n.value == "fetch_mha_one_shot_kv_indices" for n in iter_nodes(func)) or any(
        isinstance(n, cst.Attribute) and n.attr.value == "fetch_mha_one_shot_kv_indices" for n in iter_nodes(func)
    ):
        return FixedUpstream(f"{func.name.value} already falls back to fetch_mha_one_shot_kv_indices")
    reads = [i for i, stmt in enumerate(body) if _reads_table(stmt)]
    if len(reads) != 1:
        return AnchorMissing(f"expected one `kv_indices = ....{FIELD}` in {func.name.value}, found {len(reads)}")
    i = reads[0]
    first, second = cst.parse_module(GUARDED).body
    first = first.with_changes(
        leading_lines=[*body[i].leading_lines, marker_line(f"{ctx.marker}: no DSA page table -> one-shot KV indices")]
    )
    block = func.body.with_changes(body=[*body[:i], first, second, *body[i + 1 :]])
    return Rewritten(put(func.with_changes(body=block)))


# -- the same verdict without libcst (sm120kit/patching/ast_tools.py) -----------------------


def _quick_reads_table(stmt) -> bool:
    value = assigned(stmt, "kv_indices")
    return isinstance(value, ast.Attribute) and value.attr == FIELD


def quick_guard_page_table(code, ctx):
    found = code.functions(READERS)
    if not found:
        return AnchorMissing(f"no method {' / '.join(READERS)}")
    func = found[0]
    scope = code.scope(func)
    one_per_line(func.body)
    if any(id(stmt) in scope.marked(ctx.marker) for stmt in func.body):
        return AlreadyApplied()
    if scope.has_name(func, "fetch_mha_one_shot_kv_indices"):
        return FixedUpstream(f"{func.name} already falls back to fetch_mha_one_shot_kv_indices")
    reads = [stmt for stmt in func.body if _quick_reads_table(stmt)]
    if len(reads) != 1:
        return AnchorMissing(f"expected one `kv_indices = ....{FIELD}` in {func.name}, found {len(reads)}")
    return WouldRewrite()


_FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"

PATCH = Patch(
    id="sglang-dsa-page-table-guard",
    package="sglang",
    summary="No AttributeError on a cached prefix when GLM-5 runs fp8 KV on a non-DSA attention backend",
    why=(
        "The fp8 MHA one-shot path reads forward_metadata.page_table_1_flattened, which only "
        "NSA/DSA metadata has; with --attention-backend flashinfer the scheduler dies on the "
        "first radix hit or chunked-prefill continuation (hence --disable-radix-cache). "
        "0.5.22 fixed the wrapped-backend case only."
    ),
    refs=("sgl-project/sglang#29562", "sgl-project/sglang#29580"),
    rewrites=(Rewrite(_FORWARD_MHA, ">=0.5.9,<=0.5.23", guard_page_table, quick=quick_guard_page_table),),
)
