"""The supervisor's parts on their own: the port plan as sglang derives it, progress read
from sglang's log lines, backoff, log rotation, the GPU check's rules, process scans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sm120kit.profiles.model import Health, Profile
from sm120kit.serve import gpus, preflight, procs
from sm120kit.serve.progress import LineSplitter, phase_of
from sm120kit.serve.rundir import copy_truncate, rotate
from sm120kit.serve.supervisor import Policy

GiB = 1 << 30


def profile(**parts) -> Profile:
    return Profile.model_validate(parts)


def test_port_plan_follows_sglang_port_args():
    assert preflight.port_plan(profile()) == [("server.port", "127.0.0.1", 30000)]
    dp = profile(server={"port": 30000}, extra_args={"--enable-dp-attention": True, "--nccl-port": 29500})
    plan = preflight.port_plan(dp)
    assert ("--nccl-port", "127.0.0.1", 29500) in plan
    assert [p for _, _, p in plan if p > 30000] == list(range(30233, 30239))  # --port + ZMQ_TCP_PORT_DELTA
    high = preflight.port_plan(profile(server={"port": 65500}, extra_args={"--enable-dp-attention": True}))
    assert [p for _, _, p in high][1:] == list(range(65267, 65273))  # sglang steps down near 65535
    rank0 = profile(parallel={"nnodes": 2, "node_rank": 0, "dist_init_addr": "10.0.0.1:5000"})
    assert preflight.port_plan(rank0)[-1] == ("parallel.dist_init_addr", "0.0.0.0", 5000)
    rank1 = profile(parallel={"nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:5000"})
    assert len(preflight.port_plan(rank1)) == 1  # only rank 0 binds the rendezvous port


@pytest.mark.parametrize(
    "line, phase",
    [
        ("[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=94.50 GB", "loading weights"),
        ("Loading safetensors checkpoint shards:  45% Completed | 41/92 [01:02<01:15,  0.68it/s]", "loading weights 45% (41/92 shards)"),
        ("[2026-11-29 10:00:36 TP0] Load weight end. elapsed=36.20 s, type=GlmMoeDsaForCausalLM", "weights loaded"),
        ("[2026-11-29 10:00:40 TP0] Memory pool end. avail mem=12.02 GB", "KV cache allocated"),
        ("[2026-11-29 10:00:41 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=11.9 GB", "capturing CUDA graphs"),
        ("Capturing batches (bs=512 avail_mem=11.02 GB):  10%|", "capturing CUDA graphs"),
        ("[2026-11-29 10:04:09] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)", "HTTP server up, warming up"),
        ("[2026-11-29 10:04:12] The server is fired up and ready to roll!", "warmup done"),
        ("[2026-11-29 10:04:12] Prefill batch. #new-seq: 1", None),
    ],
)
def test_phases_from_sglang_log_lines(line, phase):
    assert phase_of(line) == phase


def test_tqdm_updates_joined_by_carriage_returns_are_lines():
    split = LineSplitter()
    assert split.feed("shards:  25% Completed | 1/4 [..]\rshards:  50% Completed | 2/4") == ["shards:  25% Completed | 1/4 [..]"]
    assert split.feed(" [..]\r\nnext") == ["shards:  50% Completed | 2/4 [..]"]
    assert split.feed("\n") == ["next"]


def test_backoff_doubles_up_to_the_cap():
    policy = Policy.from_health(Health(backoff_initial_s=5, backoff_max_s=60))
    assert [policy.backoff(n) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]
    assert policy.stop_timeout_s == 60 and policy.stable_after_s == 600


def test_rotation_keeps_the_newest(tmp_path):
    log = tmp_path / "server.log"
    for run in range(7):
        rotate(log, keep=3)
        log.write_text(f"run {run}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.log", "server.log.1", "server.log.2", "server.log.3"]
    assert [(tmp_path / n).read_text() for n in ("server.log", "server.log.1", "server.log.3")] == ["run 6\n", "run 5\n", "run 3\n"]


def test_copy_truncate_keeps_an_appending_writer_writing(tmp_path):
    log = tmp_path / "server.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"old line\n")
    copy_truncate(log)
    os.write(fd, b"new line\n")
    os.close(fd)
    assert log.read_bytes() == b"new line\n" and (tmp_path / "server.log.1").read_bytes() == b"old line\n"


def gpu(index, cc="12.0", free=90, total=96, processes=None) -> gpus.Gpu:
    return gpus.Gpu(index, "NVIDIA RTX PRO 6000 Blackwell Server Edition", f"GPU-{index:04d}-aaaa", cc, total * GiB, free * GiB, processes or {})


def test_cuda_visible_devices_by_index_and_uuid():
    eight = [gpu(i) for i in range(8)]
    assert [g.index for g in gpus.visible(eight, {})] == list(range(8))
    assert [g.index for g in gpus.visible(eight, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})] == [4, 5, 6, 7]
    assert [g.index for g in gpus.visible(eight, {"CUDA_VISIBLE_DEVICES": "GPU-0003,1"})] == [3, 1]
    assert [g.index for g in gpus.visible(eight, {"CUDA_VISIBLE_DEVICES": "0,9,1"})] == [0]  # CUDA stops at a bad entry
    assert gpus.visible(eight, {"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize(
    "found, problem",
    [
        ([gpu(i) for i in range(8)], None),
        ([gpu(i) for i in range(4)], "the profile needs 8 GPUs; 4 visible"),
        ([gpu(i, cc="9.0") for i in range(8)], "the profile is for compute capability 12.0; GPU 0 (NVIDIA RTX PRO 6000 Blackwell Server Edition) is 9.0"),
        ([gpu(0, free=6, processes={4242: 88 * GiB})] + [gpu(i) for i in range(1, 8)], "GPU 0 has 6144 of 98304 MiB free, below 0.85 of it; held by pid 4242 (90112 MiB)"),
    ],
)
def test_gpu_check_rules(monkeypatch, found, problem):
    monkeypatch.setattr(gpus, "read_gpus", lambda: found)
    glm = profile(node={"gpus": 8, "compute_capability": "12.0"}, engine={"mem_fraction_static": 0.85})
    check = preflight.check_gpus(glm, {})
    assert check.ok is (problem is None)
    if problem:
        assert problem in check.detail and "--no-gpu-check" in check.hint


def test_without_nvml_the_gpu_check_is_skipped_not_failed(monkeypatch):
    def unavailable():
        raise gpus.NvmlUnavailable("nvidia-ml-py is not installed (pip install 'sm120kit[gpu]')")

    monkeypatch.setattr(gpus, "read_gpus", unavailable)
    check = preflight.check_gpus(profile(), {})
    assert check.ok is None and "nvidia-ml-py is not installed" in check.detail


def test_exit_descriptions():
    assert procs.exit_description(0) == (0, "exit code 0")
    assert procs.exit_description(1 << 8) == (1, "exit code 1")
    assert procs.exit_description(signal.SIGKILL) == (None, "killed by SIGKILL")


def test_scan_finds_sglang_titles_and_our_marker():
    titled = subprocess.Popen(["sglang::scheduler_TP3", "-c", "import time; time.sleep(60)"], executable=sys.executable)
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, procs.MARKER: "p:1234"})
    try:
        time.sleep(0.3)
        by_title = {p.pid: p for p in procs.scan(sglang=True)}
        assert titled.pid in by_title and marked.pid not in by_title
        assert by_title[titled.pid].title.startswith("sglang::scheduler_TP3")
        assert [p.pid for p in procs.scan(marker="p:1234")] == [marked.pid]
        assert marked.pid in {p.pid for p in procs.scan(marker="")} and procs.scan(marker="p:other") == []
        report = procs.stop(None, "p:1234", timeout=5, pids={titled.pid})
        assert report.clean and report.processes == 2 and report.killed == []
    finally:
        for p in (titled, marked):
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "parts, key",
    [({"extra_args": {"--nccl-port": "auto"}}, 'extra_args."--nccl-port"'), ({"extra_args": {"--nccl-port": 99999}}, 'extra_args."--nccl-port"'),
     ({"parallel": {"nnodes": 2, "dist_init_addr": "10.0.0.1:abc"}}, "parallel.dist_init_addr")],
)  # fmt: skip
def test_a_port_that_is_not_a_port_is_a_clear_error(parts, key):
    from sm120kit.errors import UserError

    with pytest.raises(UserError, match=f"{key} = .* is not a port"):
        preflight.port_plan(profile(**parts))


def test_api_keys_are_masked_in_process_titles():
    assert procs._title(["python", "-m", "sglang.launch_server", "--api-key", "sk-1", "--admin-api-key=sk-2"], "x") == (
        "python -m sglang.launch_server --api-key *** --admin-api-key=***"
    )
