"""A start until ready: sglang's progress read from its log lines, readiness only when the
server generates, and the health probe (sm120kit.serve.progress, probe)."""

from __future__ import annotations

import signal

import pytest
from support.serve import SECRET

from sm120kit.serve import procs
from sm120kit.serve.progress import LineSplitter, phase_of


def test_ready_only_when_it_generates_with_progress_then_a_clean_stop(serve):
    s = serve({"load_s": 1.0, "shards": 4, "warmup_s": 1.0}).start()
    ready = s.wait("ready")
    phases = [e["phase"] for e in s.events("progress")]
    assert phases[0] == "loading weights" and "loading weights 100% (4/4 shards)" in phases
    # sglang (0.5.9-0.5.23, _wait_and_warmup) is Up before it logs its ready line: a probe may
    # answer 200 before that line is read, and no progress is recorded once ready
    assert "HTTP server up, warming up" in phases and phases[-1] in ("HTTP server up, warming up", "warmup done")
    assert ready["after_s"] >= 2.0  # 1 s of loading and 1 s of 503 while warming up
    assert s.ours()  # the launcher, two schedulers and a detokenizer
    assert s.signal(signal.SIGINT) == 0
    stopped = s.wait("stopped")
    assert (
        stopped["clean"] and stopped["processes"] == 4 and stopped["sigkilled"] == [] and stopped["ports_taken"] == []
    )
    assert not s.ours()
    assert not procs.port_in_use("127.0.0.1", s.port)
    out = s.output
    assert "starting: loading weights" in out and "ready: standin generates" in out
    assert "Load weight begin" in out  # the live tail
    assert "stopped: 4 processes ended" in out


def test_503_while_starting_is_not_death_and_a_slow_start_is_waited_for(serve):
    s = serve({"load_s": 2.0, "warmup_s": 2.0}).start()
    s.wait("ready", timeout=30)
    assert s.events("died") == [] and s.events("probe_failed") == []
    assert "Uvicorn running" in (s.dir / "server.log").read_text()
    s.signal()


@pytest.mark.parametrize(
    "line, phase",
    [
        ("[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=94.50 GB", "loading weights"),
        (
            "Loading safetensors checkpoint shards:  45% Completed | 41/92 [01:02<01:15,  0.68it/s]",
            "loading weights 45% (41/92 shards)",
        ),
        ("[2026-11-29 10:00:36 TP0] Load weight end. elapsed=36.20 s, type=GlmMoeDsaForCausalLM", "weights loaded"),
        ("[2026-11-29 10:00:40 TP0] Memory pool end. avail mem=12.02 GB", "KV cache allocated"),
        (
            "[2026-11-29 10:00:41 TP0] Capture cuda graph begin. This can take up to several minutes. "
            "avail mem=11.9 GB",
            "capturing CUDA graphs",
        ),
        ("Capturing batches (bs=512 avail_mem=11.02 GB):  10%|", "capturing CUDA graphs"),
        (
            "[2026-11-29 10:04:09] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
            "HTTP server up, warming up",
        ),
        ("[2026-11-29 10:04:12] The server is fired up and ready to roll!", "warmup done"),
        ("[2026-11-29 10:04:12] Prefill batch. #new-seq: 1", None),
    ],
)
def test_phases_from_sglang_log_lines(line, phase):
    assert phase_of(line) == phase


def test_tqdm_updates_joined_by_carriage_returns_are_lines():
    split = LineSplitter()
    assert split.feed("shards:  25% Completed | 1/4 [..]\rshards:  50% Completed | 2/4") == [
        "shards:  25% Completed | 1/4 [..]"
    ]
    assert split.feed(" [..]\r\nnext") == ["shards:  50% Completed | 2/4 [..]"]
    assert split.feed("\n") == ["next"]


def test_an_exception_in_the_probe_thread_is_a_failed_probe_and_probing_goes_on(monkeypatch):
    import threading

    from sm120kit.serve import probe

    def broken(*args, **kwargs):
        raise RuntimeError(f"boom with {SECRET} in it")

    monkeypatch.setattr(probe, "probe", broken)
    answered = threading.Semaphore(0)
    prober = probe.ThreadProber("127.0.0.1", 1, 1.0, SECRET, answered.release)
    for attempt in (1, 2):  # the next probe can start
        prober.start(attempt)
        assert answered.acquire(timeout=5)
        [(answered_for, result)] = prober.results()
        assert answered_for == attempt and result.ok is False
        assert "RuntimeError" in result.detail and SECRET not in result.detail
