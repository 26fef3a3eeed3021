"""The kernel table (patches/kernels.toml) as data, and judging slots against it
(sm120kit/catalogue/kernels.py, sm120kit/resolution/slots.py, judge.py)."""

from __future__ import annotations

import pytest

from sm120kit.catalogue.kernels import SLOTS, read_table
from sm120kit.catalogue.survey import load_survey
from sm120kit.errors import UserError
from sm120kit.resolution import judge, slots

TABLE = read_table()
V0517 = {"sglang": "0.5.17", "flashinfer-python": "0.6.15.post1"}


def test_every_survey_id_the_table_names_is_an_entry_of_the_survey():
    known = {f.id for f in load_survey().failures}
    named = {s for k in TABLE.kernels for s in k.survey}
    assert named and named <= known, named - known


def test_every_kernel_is_dispatched_through_a_known_slot_and_says_where_it_was_read():
    keys = set(SLOTS)
    for kernel in TABLE.kernels:
        for assignment in kernel.dispatched_by:
            assert assignment.partition("=")[0] in keys, (kernel.id, assignment)
        assert all(row.evidence for row in kernel.support)


def test_the_table_holds_clean_choices_too():
    """A way out needs kernels that run: the table is not only a list of failures."""
    runs = [k for k in TABLE.kernels if any(r.sm120 for r in k.support)]
    assert len(runs) >= 10


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[kernel]]\nid = 'x'\n", "kernel.0.title"),
        ("kernel = 3\n", "kernel"),
        ("[[kernel]\n", "not valid TOML"),
        (
            "[[kernel]]\nid='a'\ntitle='t'\ndispatched_by=['attention.phase=x']\n"
            "[[kernel.support]]\npackage='sglang'\nreleases='>=0.5'\nsm120=true\nsm121=true\nevidence='e'\n",
            "'attention.phase' is not a slot",
        ),
        (
            "[[kernel]]\nid='a'\ntitle='t'\ndispatched_by=['moe.runner=x']\n"
            "[[kernel.support]]\npackage='sglang'\nreleases='banana'\nsm120=true\nsm121=true\nevidence='e'\n",
            "not a PEP 440 range",
        ),
    ],
)
def test_a_damaged_table_names_the_file_and_the_key(tmp_path, text, says):
    path = tmp_path / "kernels.toml"
    path.write_text(text)
    with pytest.raises(UserError) as caught:
        read_table(path)
    assert str(path) in caught.value.message and says in caught.value.message


def test_a_kernel_listed_twice_is_refused(tmp_path):
    entry = (
        "[[kernel]]\nid='a'\ntitle='t'\ndispatched_by=['moe.runner=x']\n"
        "[[kernel.support]]\npackage='sglang'\nreleases='>=0.5'\nsm120=true\nsm121=true\nevidence='e'\n"
    )
    path = tmp_path / "kernels.toml"
    path.write_text(entry * 2)
    with pytest.raises(UserError, match="kernel a: listed twice"):
        read_table(path)


def test_the_dsa_slots_exist_only_under_the_dsa_attention_backend():
    record = {"attention_backend": "flashinfer", "nsa_decode_backend": "trtllm", "nsa_prefill_backend": "flashmla_kv"}
    assert "dsa.decode" not in slots.fill(record)
    record["attention_backend"] = "nsa"  # 0.5.9-0.5.12 spell it nsa, and the fields nsa_*
    assert slots.fill(record)["dsa.decode"] == "trtllm"
    record = {"attention_backend": "dsa", "decode_attention_backend": "flashinfer", "dsa_decode_backend": "trtllm"}
    filled = slots.fill(record)
    assert "dsa.decode" not in filled and filled["attention.prefill"] == "dsa"


@pytest.mark.parametrize(
    ("config", "quantization"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "fp8"),
        ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "modelopt_fp4"),
        ({"hf_quant_config": {"quantization": {"quant_algo": "NVFP4"}}}, "modelopt_fp4"),
        ({"architectures": ["X"]}, None),
        (None, None),
    ],
)
def test_the_quantization_sglang_leaves_unset_is_the_checkpoints(config, quantization):
    assert slots.fill({}, config).get("quantization") == quantization


def test_the_flags_as_a_record():
    record = slots.from_flags(["--attention-backend", "fa3", "--disable-cuda-graph", "--tp=8"])
    assert record == {"attention_backend": "fa3", "disable_cuda_graph": True, "tp": "8"}
    assert slots.fill(record)["cuda_graph"] == "off"


GLM_FP8 = {"architectures": ["GlmMoeDsaForCausalLM"]}


def test_glm_dsa_fp8_on_0_5_17_runs_flashinfer_sparse_mla():
    record = {"attention_backend": "dsa", "dsa_decode_backend": "flashinfer_sparse_mla", "kv_cache_dtype": "fp8_e4m3"}
    record["dsa_prefill_backend"] = "flashinfer_sparse_mla"
    found = judge.judge(TABLE, slots.fill(record, GLM_FP8), record, V0517, "12.0")
    by_id = {j.kernel.id: j.verdict for j in found}
    assert by_id["dsa-flashinfer-sparse-mla-glm-fp8"] is judge.KernelVerdict.RUNS
    assert judge.KernelVerdict.NO_BUILD not in by_id.values(), by_id


def test_trtllm_dsa_decode_has_no_sm12x_build_and_a_way_out_is_offered():
    record = {"attention_backend": "dsa", "dsa_decode_backend": "trtllm", "kv_cache_dtype": "bf16"}
    found = judge.judge(TABLE, slots.fill(record, GLM_FP8), record, V0517, "12.0")
    refused = [j for j in found if j.verdict is judge.KernelVerdict.NO_BUILD]
    assert "dsa-trtllm-sparse-mla" in {j.kernel.id for j in refused}
    message = next(j for j in refused if j.kernel.id == "dsa-trtllm-sparse-mla").message("sglang 0.5.17", "basis")
    assert "sglang 0.5.17 resolves dsa.decode to trtllm" in message and "no SM12x build" in message
    assert "flashinfer_sparse_mla" in judge.alternatives(TABLE, "dsa.decode", V0517, "12.0", "trtllm")


def test_off_sm12x_nothing_is_judged_and_an_allowed_kernel_is_said_as_allowed():
    record = {"attention_backend": "fa3"}
    assert judge.judge(TABLE, slots.fill(record), record, V0517, "9.0") == []
    found = judge.judge(TABLE, slots.fill(record), record, V0517, "12.0", frozenset({"fa3-attention"}))
    assert {j.verdict for j in found if j.kernel.id == "fa3-attention"} == {judge.KernelVerdict.ALLOWED}


def test_past_what_the_table_read_its_verdict_counts_unverified():
    """A release newer than the table read (sglang 0.5.24 the day it ships) is judged as the
    newest read: an SM90-only kernel is still refused, and the message says it is unverified."""
    record = {"attention_backend": "fa3"}
    found = judge.judge(TABLE, slots.fill(record), record, {"sglang": "0.5.24"}, "12.0")
    (fa3,) = [j for j in found if j.kernel.id == "fa3-attention"]
    assert fa3.verdict is judge.KernelVerdict.NO_BUILD
    assert f"sglang read through {TABLE.read_through['sglang']}: unverified" in fa3.message("sglang 0.5.24", "b")


def test_a_release_no_row_covers_is_unknown_not_refused():
    record = {"attention_backend": "fa3"}
    found = judge.judge(TABLE, slots.fill(record), record, {"sglang": "0.4.0"}, "12.0")
    assert {j.verdict for j in found} == {judge.KernelVerdict.UNKNOWN}


def test_the_docs_page_is_the_table():
    import render_kernels

    assert render_kernels.PAGE.read_text() == render_kernels.render(), "run python scripts/render_kernels.py"


def test_an_env_condition_and_its_negation():
    """mhc-prenorm-deepgemm runs unless the server's environment turns the pre-norm off."""
    record = {"attention_backend": "dsa"}
    glm5next = {"architectures": ["Glm5NextForConditionalGeneration"]}
    filled = slots.fill(record, glm5next)
    on = judge.judge(TABLE, filled, record, {"sglang": "0.5.20"}, "12.0")
    off = judge.judge(TABLE, filled, record, {"sglang": "0.5.20"}, "12.0", env={"SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0"})
    assert "mhc-prenorm-deepgemm" in {j.kernel.id for j in on}
    assert "mhc-prenorm-deepgemm" not in {j.kernel.id for j in off}


def test_a_kernel_an_applied_patch_reroutes_is_covered():
    record = {"attention_backend": "trtllm_mla"}
    found = judge.judge(TABLE, slots.fill(record), record, V0517, "12.0", covered=lambda patch: True)
    verdicts = {j.kernel.id: j.verdict for j in found}
    assert verdicts["trtllm-mla-prefill"] is judge.KernelVerdict.COVERED
