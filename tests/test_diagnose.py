"""Known SM120 failure signatures, matched on log lines in the real programs' own wording
(Triton's OutOfResources text from the installed Triton, flashinfer's and sglang's
messages as their sources write them)."""

from __future__ import annotations

import pytest

from sm120kit.serve.diagnose import diagnose, signatures


def triton_message(required: int) -> str:
    errors = pytest.importorskip("triton.runtime.errors")
    return f"triton.runtime.errors.OutOfResources: {errors.OutOfResources(required, 101376, 'shared memory')}"


LOG_NOISE = "[2026-11-29 10:00:01 TP3] Load weight end. type=GlmMoeDsaForCausalLM, dtype=torch.bfloat16\n"


@pytest.mark.parametrize(
    "required, kernel",
    [(106496, "extend attention"), (147456, "fused-MoE fp8"), (163840, "head_dim 256"), (99999999, "no figure")],
)
def test_triton_shared_memory_names_the_kernel(required, kernel):
    [d] = diagnose(LOG_NOISE + triton_message(required) + "\n")
    assert d.id == "triton-shared-memory" and str(required) in d.title and kernel in d.title
    assert "sm120kit patch --verify" in d.advice


@pytest.mark.parametrize(
    "line, sig",
    [
        ("AttributeError: 'PrefillMetadata' object has no attribute 'page_table_1_flattened'", "dsa-page-table"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 95.59 GiB", "cuda-out-of-memory"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", "nccl"),
        ("RuntimeError: No supported CUDA architectures found for major versions [10].", "flashinfer-no-arch"),
        ("RuntimeError: CUDA error: an illegal instruction was encountered", "illegal-instruction"),
        ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): Address already in use", "address-in-use"),
    ],
)
def test_each_signature(line, sig):
    [d] = diagnose(LOG_NOISE + line + "\n" + LOG_NOISE)
    assert d.id == sig and d.line == line.strip()


def test_only_the_tail_counts_and_each_signature_once():
    old = "RuntimeError: CUDA error: an illegal instruction was encountered\n"
    log = old + LOG_NOISE * 500 + triton_message(147456) + "\n" + triton_message(147456) + "\n"
    assert [d.id for d in diagnose(log, tail_lines=400)] == ["triton-shared-memory"]
    assert {d.id for d in diagnose(log, tail_lines=1000)} == {"illegal-instruction", "triton-shared-memory"}
    assert diagnose(LOG_NOISE * 3) == []


def test_signatures_are_data():
    ids = [s.id for s in signatures()]
    assert len(ids) == len(set(ids)) >= 7


def test_cli(cli, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG_NOISE + "RuntimeError: No supported CUDA architectures found for major versions [10].\n")
    code, out, _ = cli("diagnose", log)
    assert code == 1 and "flashinfer-no-arch" in out and "majors [10]" in out
    log.write_text(LOG_NOISE)
    assert cli("diagnose", log)[0] == 0
    code, _, err = cli("diagnose", tmp_path / "missing.log")
    assert code == 2 and "cannot read the log" in err
