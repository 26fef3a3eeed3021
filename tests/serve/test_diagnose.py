"""Known SM120 failure signatures (sm120kit.serve.diagnose), matched on log lines in the real
programs' own wording, and a server's death diagnosed as serve meets it."""

from __future__ import annotations

import pytest
from support.serve import DEATHS, TRACEBACK, TRITON_SMEM

from sm120kit.serve.diagnose import diagnose, signatures


@pytest.mark.parametrize("signature", sorted(DEATHS))
def test_death_while_loading_is_diagnosed(serve, signature):
    s = serve({"die_loading": DEATHS[signature]}, sets=["health.max_restarts=0"])
    code, out = s.run()
    assert code == 1, out
    [died] = s.events("died")
    assert not died["ready"] and died["exit_code"] is None  # sglang SIGKILLs itself
    assert [d["id"] for d in died["diagnoses"]] == [signature]
    assert "killed by SIGKILL" in out and "the server died while starting (loading weights" in out
    assert "diagnosis: " in out and "advice:" in out
    assert "giving up: 1 failed runs in a row" in out


def test_triton_diagnosis_names_the_kernel_and_the_patch(serve):
    code, out = serve({"die_loading": TRITON_SMEM}, sets=["health.max_restarts=0"]).run()
    assert code == 1
    assert "Required: 147456" in out and "fused-MoE fp8" in out and "sm120kit patch --verify" in out


def test_a_module_missing_at_the_start_is_diagnosed_as_an_incomplete_environment():
    [found] = diagnose("[2026-11-29 10:00:00] starting\n" + TRACEBACK)
    assert found.id == "missing-module" and not found.restart and "no module named 'numpy'" in found.title
    [found] = diagnose("ImportError: libcudart.so.13: cannot open shared object file: No such file or directory\n")
    assert found.id == "import-error" and not found.restart
    # a module named inside a logged line is not a traceback's end
    assert diagnose("[2026-11-29 10:00:00 TP0] WARNING: ModuleNotFoundError: No module named 'vllm'\n") == []


def triton_message(required: int) -> str:
    """Triton's own wording of the error (the test extra's Triton: imported, never skipped for)."""
    from triton.runtime import errors

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
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
            "GPU 3 has a total capacity of 95.59 GiB",
            "cuda-out-of-memory",
        ),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
            "nccl",
        ),
        ("RuntimeError: No supported CUDA architectures found for major versions [10].", "flashinfer-no-arch"),
        ("RuntimeError: CUDA error: an illegal instruction was encountered", "illegal-instruction"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "illegal-memory-access"),
        ("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered", "illegal-memory-access"),
        (
            "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
            "Address already in use",
            "address-in-use",
        ),
        (  # DeepGEMM's JIT: cuobjdump of the kernel it just compiled failed (sglang#18870)
            "RuntimeError: Assertion error (/sgl-workspace/DeepGEMM/csrc/apis/../jit_kernels/impls/../../jit/"
            "kernel_runtime.hpp:45): exit_code == 0",
            "deepgemm-jit-cuobjdump",
        ),
        (  # the DSA indexer's paged MQA logits on DeepGEMM (sglang#26087)
            "RuntimeError: Assertion error (/deepgemm/csrc/apis/attention.hpp:219): Unsupported architecture",
            "deepgemm-dsa-indexer-sm12x",
        ),
        (  # DeepSeek-V4's mHC pre-norm on DeepGEMM (sglang#25877)
            "tvm.error.InternalError: Assertion error (/deepgemm/csrc/apis/hyperconnection.hpp:56): "
            "Unsupported architecture",
            "deepgemm-mhc-prenorm-sm12x",
        ),
    ],
)
def test_each_signature(line, sig):
    [d] = diagnose(LOG_NOISE + line + "\n" + LOG_NOISE)
    assert d.id == sig and d.line == line.strip()


SITE = "/venv/lib/python3.12/site-packages"
KPOOL_CRASH = f"""\
[2026-11-29 10:00:02 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "{SITE}/sglang/srt/layers/attention/dsa_backend.py", line 2560, in forward_decode
    return self._forward_trtllm(
           ^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/sglang/srt/layers/attention/dsa_backend.py", line 4005, in _forward_trtllm
    out = flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(
          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
tvm.error.InternalError: Error in function 'TllmGenFmhaRunner' at \
{SITE}/flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh:37: Unsupported architecture
"""


def test_a_dsa_phase_on_trtllm_is_told_from_mla_prefill_by_its_frame():
    """The unpatched k-pool tail (and any DSA phase resolved to trtllm) dies with the very
    TllmGen line that MLA prefill on trtllm_mla prints: the DSA backend's frame above it
    names dsa-kpool-trtllm-sm12x first; the patched server's own NotImplementedError too."""
    found = diagnose(LOG_NOISE + KPOOL_CRASH)
    assert [d.id for d in found] == ["dsa-kpool-trtllm-sm12x", "trtllm-mla-prefill-sm12x"]
    assert found[0].line.endswith('dsa_backend.py", line 4005, in _forward_trtllm')
    [patched] = diagnose(
        "NotImplementedError: index_kpool > 1 appends tail tokens to topk_indices and is currently only "
        "supported by the FA3/TileLang/TRTLLM DSA decode backend.\n"
    )
    assert patched.id == "dsa-kpool-trtllm-sm12x"
    mla_prefill = f'  File "{SITE}/sglang/srt/layers/attention/trtllm_mla_backend.py", line 900, in forward_extend\n'
    assert [d.id for d in diagnose(mla_prefill + KPOOL_CRASH.splitlines()[-1])] == ["trtllm-mla-prefill-sm12x"]


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


@pytest.mark.parametrize("tail", ["0", "-3", "1000000000"])
def test_a_tail_out_of_range_is_refused(cli, tmp_path, tail):
    log = tmp_path / "server.log"
    log.write_text(LOG_NOISE)
    code, out, err = cli("diagnose", log, "--tail", tail)
    assert code == 2 and f"--tail {tail}: allowed: an integer from 1 to" in err and not out


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_huge_log_is_read_from_its_tail_in_bounded_memory(cli, tmp_path, monkeypatch, source):
    """A 1 GB log was read whole (2.1 GB of memory): only its tail is read now."""
    import sys
    import tracemalloc

    log = tmp_path / "huge.log"
    with open(log, "wb") as fh:
        fh.truncate(256 << 20)  # sparse: 256 MiB of NULs without a newline, then the death
        fh.seek(0, 2)
        fh.write(
            b"\n"
            + LOG_NOISE.encode()
            + b"RuntimeError: CUDA error: an illegal instruction was encountered\n"
            + LOG_NOISE.encode()
        )
    if source == "stdin":
        monkeypatch.setattr(sys, "stdin", open(log, encoding="utf-8"))  # noqa: SIM115 (closed with the test)
    tracemalloc.start()
    try:
        code, out, _ = cli("diagnose", "-" if source == "stdin" else log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 1 and "illegal-instruction" in out
    assert peak < 80 << 20, f"peak {peak >> 20} MiB"
