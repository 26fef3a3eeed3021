"""tune-moe's timing parent (sm120kit.tune.timing) on a machine without GPUs: the workers are the
stand-in fixture tests/fixtures/moe_worker_standin.py, which speaks the real worker's protocol
(worker.py) and misbehaves on request; the real worker.py runs where the target lacks torch.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sm120kit.errors import UserError
from sm120kit.tune import compare, timing
from sm120kit.tune.shape import MoeShape
from sm120kit.tune.timing_result import Stop
from sm120kit.tune.worker_client import WORKER

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "fixtures" / "moe_worker_standin.py"
PYTHON = Path(sys.executable)
SHAPE = MoeShape(
    experts=384, hidden=7168, intermediate=256, shard=256, top_k=8, dtype="fp8_w8a8", block_shape=(128, 128)
)
CANDIDATES = [
    {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}
    for m in (16, 32, 64)
    for n in (64, 128)
]
# what each candidate "takes" in the stand-in: the fastest is wrong, the second fastest does not compile
US = {0: 90.0, 1: 40.0, 2: 70.0, 3: 60.0, 4: 55.0, 5: 120.0}
INCORRECT, FAILING = [1], [4]
STANDIN_DEFAULT_US = 150.0  # the stand-in's timing of sglang's default config


@pytest.fixture
def standin(monkeypatch, tmp_path):
    """Configure the stand-in worker; returns its log (one line per batch size it started)."""
    log = tmp_path / "standin.log"

    def configure(**settings) -> Path:
        settings = {"us": {str(i): us for i, us in US.items()}, "log": str(log), **settings}
        monkeypatch.setenv("SM120KIT_STANDIN", json.dumps(settings))
        return log

    return configure


def run(state: Path, batch_sizes=(1, 2, 4, 8), gpus=(0,), *, shape=SHAPE, candidates=CANDIDATES, **kwargs):
    kwargs.setdefault("compile_jobs", 0)
    return timing.time_candidates(
        PYTHON, shape, list(batch_sizes), candidates, list(gpus), budget_s=kwargs.pop("budget_s", None),
        state_path=state, worker=STANDIN, **kwargs,
    )  # fmt: skip


def started(log: Path) -> list[tuple[str, str, int]]:
    """(batch size or "compile", CUDA_VISIBLE_DEVICES, pid) per line of the stand-in's log."""
    if not log.exists():
        return []
    return [(m, gpu, int(pid)) for m, gpu, pid in (line.split() for line in log.read_text().splitlines())]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (our own child, not yet reaped) is gone too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def expected_best() -> int:
    correct = {i: us for i, us in US.items() if i not in INCORRECT + FAILING}
    return min(correct, key=correct.get)


def test_batch_sizes_spread_over_the_gpus_and_the_fastest_correct_candidate_wins(standin, tmp_path, monkeypatch):
    log = standin(incorrect=INCORRECT, fail=FAILING, sleep_s=0.02)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # our GPUs 0 and 1 are the node's 5 and 7
    ticks = []
    result = run(tmp_path / "state.json", gpus=(0, 1), progress=lambda *a: ticks.append(a))

    assert result.stop is Stop.COMPLETE and result.complete
    assert [row.batch_size for row in result.rows] == [1, 2, 4, 8]
    by_gpu = {gpu for _, gpu, _ in started(log)}
    assert by_gpu == {"5", "7"}, started(log)
    assert sorted(int(m) for m, _, _ in started(log)) == [1, 2, 4, 8]  # each once
    best = expected_best()
    for row in result.rows:
        assert row.best == CANDIDATES[best] and row.best_us == US[best]
        assert (row.timed, row.failed, row.incorrect, row.skipped) == (4, 1, 1, 0)
        assert row.speedup == pytest.approx(STANDIN_DEFAULT_US / US[best])
        assert any("OutOfResources" in e for e in row.errors)
    assert result.best_configs() == {m: CANDIDATES[best] for m in (1, 2, 4, 8)}
    assert ticks[-1][0] == ticks[-1][1] == 4 * len(CANDIDATES)
    saved = json.loads((tmp_path / "state.json").read_text())
    assert sorted(saved["batches"]) == ["1", "2", "4", "8"]


def test_an_incorrect_or_failing_candidate_never_wins_even_when_fastest(standin, tmp_path):
    standin(incorrect=[0, 1, 2, 3, 4], fail=[5])
    result = run(tmp_path / "state.json", batch_sizes=(16,))
    (row,) = result.rows
    assert row.best is None and row.best_us is None and row.speedup is None
    assert (row.timed, row.incorrect, row.failed) == (0, 5, 1)
    assert not result.complete  # a batch size without a winner is not a finished table
    assert result.best_configs() == {}


def test_the_budget_stops_the_batch_in_flight_and_a_rerun_resumes(standin, tmp_path):
    state = tmp_path / "state.json"
    # The budget counts from before the probe: it must cover the probe, the worker's start and
    # batch sizes 8, 4 and 2 on a loaded machine. Batch size 1 (timed last: largest first) would
    # take 300 s: only the budget ends it.
    budget = 10.0
    log = standin(slow={"1": 300})
    t0 = time.monotonic()
    result = run(state, budget_s=budget)
    took = time.monotonic() - t0
    assert budget <= took < budget + 60, took  # the slow worker was killed at the deadline, not waited for
    assert result.stop is Stop.BUDGET
    assert [row.batch_size for row in result.rows] == [2, 4, 8] and result.pending == [1]
    assert all(gone(pid) for _, _, pid in started(log))

    log.unlink()
    standin()
    again = run(state)
    assert again.stop is Stop.COMPLETE and again.resumed == [2, 4, 8]
    assert [m for m, _, _ in started(log)] == ["1"]  # only the batch size that had not finished
    assert [row.batch_size for row in again.rows] == [1, 2, 4, 8]


def test_ctrl_c_kills_the_workers_and_keeps_what_finished(standin, tmp_path):
    state = tmp_path / "state.json"
    log = standin(sleep_s=0.01)

    def progress(done: int, total: int, detail: str) -> None:
        if detail.startswith("batch 1 "):
            raise KeyboardInterrupt  # as Ctrl-C arrives in the main thread

    result = run(state, progress=progress)
    assert result.stop is Stop.INTERRUPTED
    assert [row.batch_size for row in result.rows] == [2, 4, 8] and result.pending == [1]
    assert all(gone(pid) for _, _, pid in started(log))
    assert sorted(json.loads(state.read_text())["batches"]) == ["2", "4", "8"]


def test_the_state_is_not_reused_for_another_shape_or_candidate_set(standin, tmp_path):
    state = tmp_path / "state.json"
    log = standin()
    run(state, batch_sizes=(1, 2))
    other_shape = MoeShape(experts=256, hidden=7168, intermediate=256, shard=256, top_k=8, dtype="fp8_w8a8")
    for kwargs in ({"shape": other_shape}, {"candidates": CANDIDATES[:4]}):
        log.unlink()
        result = run(state, batch_sizes=(1, 2), **kwargs)
        assert result.resumed == [] and sorted(m for m, _, _ in started(log)) == ["1", "2"]
        assert any("another shape, candidate set" in note for note in result.notes)
    log.unlink()
    state.write_text("{ not json")
    result = run(state, batch_sizes=(1, 2), candidates=CANDIDATES[:4])
    assert result.resumed == [] and any("not readable" in note for note in result.notes)
    assert len(started(log)) == 2


def test_a_worker_that_dies_on_a_candidate_is_replaced_and_the_candidate_blamed(standin, tmp_path):
    best = expected_best()
    log = standin(crash=[[2, best]], incorrect=INCORRECT, fail=FAILING)
    result = run(tmp_path / "state.json")
    assert result.complete
    rows = {row.batch_size: row for row in result.rows}
    assert rows[2].best != CANDIDATES[best] and rows[2].failed == 2
    assert any("died" in e for e in rows[2].errors)
    assert all(rows[m].best == CANDIDATES[best] for m in (1, 4, 8))
    batch_2 = [pid for m, _, pid in started(log) if m == "2"]
    assert len(set(batch_2)) == 2  # a fresh worker took batch size 2 up again


def test_compile_processes_run_before_the_timing(standin, tmp_path):
    log = standin(fail=FAILING)
    ticks = []
    result = run(tmp_path / "state.json", gpus=(0, 1), compile_jobs=3, progress=lambda *a: ticks.append(a))
    assert result.complete and result.compile_jobs == 3
    lines = started(log)
    assert [m for m, _, _ in lines[:3]] == ["compile"] * 3 and "compile" not in [m for m, _, _ in lines[3:]]
    assert {gpu for m, gpu, _ in lines[:3]} == {"0", "1"}
    compiling = [t for t in ticks if "compiling" in t[2]]
    assert compiling[-1][0] == compiling[-1][1] == 4 * len(CANDIDATES)


@pytest.mark.parametrize(
    ("settings", "gpus", "message"),
    [
        ({"cuda": False, "devices": []}, (0,), "sees no CUDA GPU"),
        ({}, (3,), "GPU 3 does not exist"),
        ({}, (), "no GPU to time on"),
        (
            {"fatal": {"kind": "import", "error": "ModuleNotFoundError: No module named 'sglang.srt'"}},
            (0,),
            "sglang.srt",
        ),
    ],
)
def test_a_target_that_cannot_time_is_a_user_error_and_nothing_is_written(standin, tmp_path, settings, gpus, message):
    standin(**settings)
    state = tmp_path / "out" / "state.json"
    with pytest.raises(UserError, match=message):
        run(state, gpus=gpus)
    assert not state.exists()


@pytest.fixture
def python_without_torch(tmp_path) -> Path:
    """An interpreter that cannot import torch (no site-packages), as a target without it is."""
    fake = tmp_path / "python-without-torch"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_the_real_worker_in_a_target_without_torch(python_without_torch, tmp_path):
    state = tmp_path / "out" / "state.json"
    with pytest.raises(UserError, match="no torch in this environment"):
        timing.time_candidates(
            python_without_torch, SHAPE, [1], CANDIDATES, [0], budget_s=None, state_path=state
        )  # the real worker.py
    assert not state.parent.exists()
    job = {"protocol": 1, "shape": SHAPE.to_json(), "candidates": CANDIDATES, "batch_sizes": [1]}
    done = subprocess.run(
        [str(python_without_torch), str(WORKER)], input=json.dumps(job) + "\n", capture_output=True, text=True
    )
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 3 and [e["event"] for e in events] == ["fatal"] and events[0]["kind"] == "no-torch"


def test_default_against_tuned_in_one_worker_run(standin, tmp_path):
    log = standin()
    tuned = {1: CANDIDATES[3], 64: CANDIDATES[2], 1024: CANDIDATES[3]}
    compared = compare.compare_with_default(PYTHON, SHAPE, tuned, gpu=0, worker=STANDIN)
    assert [c.batch_size for c in compared] == [1, 64, 1024]
    assert len({pid for _, _, pid in started(log)}) == 1
    distinct = []  # the worker's job holds each tuned config once, and the stand-in times by index
    for m in sorted(tuned):
        if tuned[m] not in distinct:
            distinct.append(tuned[m])
    for c in compared:
        assert c.error is None and c.default_us == STANDIN_DEFAULT_US
        assert c.tuned_us == US[distinct.index(c.tuned)]
        assert c.speedup == pytest.approx(STANDIN_DEFAULT_US / c.tuned_us)
