"""The resolution probe's protocol (sm120kit/resolution/probe.py in the target's interpreter,
run.py in sm120kit's): the node presented at every seam, sglang's refusals reported with
sglang's own words, and every way a resolution can fail to run — a timeout (its process
group killed), a crash, an import that fails, noise on stdout — a clear answer, never a
traceback. sglang here is the TEST FIXTURE tests/fixtures/resolution_standin/ (see its
README); the real resolution is recorded by scripts/resolution_matrix.py and judged in
tests/test_resolution_matrix.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from sm120kit.resolution import run

STANDIN = Path(__file__).resolve().parent / "fixtures" / "resolution_standin"
ARGV = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/glm5", "--tp", "8"]


def resolve(*argvs, fault="", capability="12.0", timeout=60.0, use_cache=False, **env):
    environment = {"PYTHONPATH": str(STANDIN), "SGLANG_STANDIN_FAULT": fault, **env}
    node = run.Node(capability, gpus=8, memory_mib=97887)
    return run.resolve(sys.executable, list(argvs or [ARGV]), environment, node, "0.5.23", "", timeout, use_cache, None)


def test_sglang_resolves_with_the_node_presented_at_every_seam():
    (answer,) = resolve()
    assert answer.ok, answer.error
    assert answer.sglang == "0.5.23" and answer.how == "resolve_once"
    resolved = answer.resolved
    assert resolved["dsa_decode_backend"] == "flashinfer_sparse_mla"  # the stand-in's 12.0 + fp8 branch
    assert resolved["nvml_capability"] == "12.0"  # pynvml
    assert resolved["gpus_seen_by_nvidia_smi"] == 8 and resolved["memory_mib"] == 97887  # nvidia-smi
    assert any("flashinfer_sparse_mla on sm120" in note for note in answer.notes)  # sglang's warnings


def test_the_capability_decides():
    (answer,) = resolve(capability="12.1")
    assert answer.ok and answer.resolved["dsa_decode_backend"] == "trtllm"
    assert answer.resolved["nvml_capability"] == "12.1"


def test_many_launches_in_one_child_each_on_a_fresh_environment():
    bf16 = [*ARGV, "--kv-cache-dtype", "bf16"]
    first, second = resolve(ARGV, bf16, fault="environ")
    assert first.ok and second.ok
    assert second.resolved["dsa_decode_backend"] == "trtllm"
    assert first.resolved["environ_left"] == "1" and second.resolved["environ_left"] == "1"
    assert first.seconds["wall"] == second.seconds["wall"]  # one child answered both


def test_a_launch_that_ends_the_process_leaves_the_others_answered():
    bf16 = [*ARGV, "--kv-cache-dtype", "bf16"]
    first, killer, third = resolve(ARGV, [*ARGV, "--attention-backend", "triton"], bf16, fault="exit-on-triton")
    assert first.ok and third.ok and third.resolved["kv_cache_dtype"] == "bf16"
    assert not killer.ok and not killer.rejected and killer.stage == "probe"
    assert "the probe ended the process (exit status 5" in killer.error
    assert first.seconds["wall"] != third.seconds["wall"]  # the third went to a new child


def test_an_invalid_choice_is_sglangs_own_argparse_message():
    (answer,) = resolve([*ARGV, "--attention-backend", "bogus"])
    assert not answer.ok and answer.rejected and answer.stage == "argv"
    assert "invalid choice: 'bogus'" in answer.error


def test_a_combination_sglang_refuses_is_its_own_message():
    (answer,) = resolve([*ARGV, "--attention-backend", "fa3"])
    assert answer.rejected and answer.stage == "resolve"
    assert answer.error == "ValueError: FlashAttention3 is only supported on sm90 and above, below sm100"


def test_a_hang_is_bounded_and_its_process_group_killed(tmp_path):
    # The bound must cover the probe's start, the stand-in's import and its child's start (the
    # evidence, child.pid, is written before the hang) on a loaded machine; the test costs it.
    bound = 10.0
    child_pid = tmp_path / "child.pid"
    started = time.monotonic()
    (answer,) = resolve(fault="hang", timeout=bound, SGLANG_STANDIN_CHILD=str(child_pid))
    took = time.monotonic() - started
    assert bound <= took < bound + 30, took  # killed at the bound, not left to the stand-in's 300 s
    assert answer.stage == "timeout" and not answer.ok and not answer.rejected
    assert f"no answer within {bound:.0f} s" in answer.error and run.TIMEOUT_ENV in answer.error
    assert child_pid.exists(), f"the probe did not reach the hang within {bound:g} s: nothing to prove"
    pid = int(child_pid.read_text())
    for _ in range(50):  # the group got SIGKILL; the grandchild is reaped by its new parent
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"sglang's child {pid} outlived the timeout")


@pytest.mark.parametrize(
    ("fault", "stage", "says"),
    [
        ("crash-at-import", "probe", "the probe gave no answer"),
        ("raise-at-import", "import", "ImportError: libcuda.so.1"),
    ],
)
def test_an_sglang_that_cannot_import_is_a_clear_answer(fault, stage, says):
    (answer,) = resolve(fault=fault)
    assert not answer.ok and not answer.rejected
    assert answer.stage == stage and says in answer.error


def test_what_sglang_prints_on_stdout_is_not_the_answer():
    (answer,) = resolve(fault="print")
    assert answer.ok


def test_an_interpreter_that_is_not_there():
    node = run.Node("12.0")
    (answer,) = run.resolve("/nonexistent/python3", [ARGV], {}, node, "0.5.23", use_cache=False)
    assert answer.stage == "probe" and "cannot start /nonexistent/python3" in answer.error


def test_an_interpreter_without_torch_says_so():
    (answer,) = resolve(PYTHONPATH=str(Path(__file__).parent / "fixtures" / "no_torch"))
    assert answer.stage == "import" and "no torch" in answer.error


@pytest.mark.cold_cache
def test_an_answer_is_cached_by_what_decides_it(tmp_path):
    count = tmp_path / "children"
    (first,) = resolve(fault="count", use_cache=True, SGLANG_STANDIN_COUNT=str(count))
    (again,) = resolve(fault="count", use_cache=True, SGLANG_STANDIN_COUNT=str(count))
    assert first.ok and not first.cached and again.cached and again.resolved == first.resolved
    assert count.read_text().count("x") == 1
    (other,) = resolve(fault="count", capability="12.1", use_cache=True, SGLANG_STANDIN_COUNT=str(count))
    assert not other.cached and count.read_text().count("x") == 2


@pytest.mark.cold_cache
def test_a_failure_to_run_is_not_cached(tmp_path):
    (first,) = resolve(fault="raise-at-import", use_cache=True)
    assert first.stage == "import"
    (again,) = resolve(fault="raise-at-import", use_cache=True)
    assert not again.cached


@pytest.mark.cold_cache
def test_a_damaged_cache_entry_is_read_as_a_miss(tmp_path):
    assert resolve(use_cache=True)[0].ok
    for entry in (Path(os.environ["SM120KIT_CACHE_DIR"]) / "resolution").iterdir():
        entry.write_text("[" * 100000)
    (again,) = resolve(use_cache=True)
    assert again.ok and not again.cached
