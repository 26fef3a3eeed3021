"""sglang-dsa-page-table-guard on the real code of every release 0.5.9-0.5.23: the patched
method, extracted from the patched file, is driven with minimal objects for both cases,
and we check which KV indices reach the fp8 dequantisation."""

from __future__ import annotations

import ast
import builtins
import textwrap
import types

import pytest
from support import patch_cases

PATCH = patch_cases.shipped_patch("sglang-dsa-page-table-guard")
TABLE, ONE_SHOT = "dsa-page-table", "one-shot-indices"


class _Tensor:
    """Enough of a tensor for the slicing after the dequantisation."""

    def __getitem__(self, _):
        return self

    def squeeze(self, _):
        return self

    def contiguous(self):
        return self


class _Scope(dict):
    """Globals of the extracted method: builtins, the stand-ins we name, and a harmless
    placeholder for annotations and module-level names the path does not use."""

    def __missing__(self, name):
        return getattr(builtins, name) if hasattr(builtins, name) else type(name, (), {})


def reader(source: bytes):
    tree = ast.parse(source)
    node = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and n.name in ("_get_mla_kv_buffer_from_fp8_for_nsa", "_get_mla_kv_buffer_from_fp8_for_dsa")
    )
    code = textwrap.dedent(ast.get_source_segment(source.decode(), node))

    def call(metadata) -> str:
        seen = []
        backend = types.SimpleNamespace(forward_metadata=metadata)
        pool = types.SimpleNamespace(get_key_buffer=lambda layer_id: "fp8-kv")
        batch = types.SimpleNamespace(
            attn_backend=backend, token_to_kv_pool=pool, fetch_mha_one_shot_kv_indices=lambda: ONE_SHOT
        )

        def dequantize(kv_cache, kv_indices):
            seen.append(kv_indices)
            return _Tensor()

        scope = _Scope(
            get_attn_backend=lambda: backend,
            resolve_attn_backend=lambda forward_batch: backend,
            get_token_to_kv_pool=lambda: pool,
            dequantize_k_cache_paged=dequantize,
            dequantize_k_cache_paged_dsa=dequantize,
            _use_aiter_gfx95=False,
        )
        exec(code, scope)
        attn = types.SimpleNamespace(attn_mha=types.SimpleNamespace(layer_id=3), kv_lora_rank=512)
        scope[node.name](attn, batch)
        [indices] = seen
        return indices

    return call


# What the backends' metadata objects look like: DSA/NSA metadata declares the table
# (None unless built); FlashInfer-MLA's PrefillMetadata has no such field at all.
DSA_WITH_TABLE = types.SimpleNamespace(page_table_1_flattened=TABLE)
FLASHINFER_PREFILL = types.SimpleNamespace(prefill_wrapper=None)


@pytest.mark.parametrize("version", patch_cases.cases(patch_cases.releases(PATCH)))
def test_table_present_is_used_and_missing_table_falls_back(version):
    before, after = patch_cases.applied(PATCH, version)
    old, new = reader(before), reader(after)
    assert old(DSA_WITH_TABLE) == new(DSA_WITH_TABLE) == TABLE
    with pytest.raises(AttributeError, match="page_table_1_flattened"):
        old(FLASHINFER_PREFILL)  # the upstream crash
    assert new(FLASHINFER_PREFILL) == ONE_SHOT
    assert new(types.SimpleNamespace(page_table_1_flattened=None)) == ONE_SHOT


@pytest.mark.parametrize("version", ["0.5.9", "0.5.13", "0.5.23"])
def test_second_pass_is_a_no_op(version):
    _, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)


def test_an_upstream_fallback_is_fixed_upstream():
    """Were upstream to add the same fallback, the patch steps aside."""
    before = patch_cases.release_file(PATCH, "0.5.23")
    edited = before.replace(
        b"kv_indices = backend.forward_metadata.page_table_1_flattened",
        b"kv_indices = getattr(backend.forward_metadata, 'page_table_1_flattened', None) "
        b"or forward_batch.fetch_mha_one_shot_kv_indices()",
    )
    assert edited != before
    patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)


def test_unknown_shape_is_anchor_missing():
    before = patch_cases.release_file(PATCH, "0.5.23").replace(
        b"kv_indices = backend.forward_metadata.page_table_1_flattened", b"kv_indices = backend.page_table()"
    )
    patch_cases.assert_anchor_missing(PATCH, "0.5.23", before)
