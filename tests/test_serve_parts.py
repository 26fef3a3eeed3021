"""The supervisor's parts on their own: the port plan as sglang derives it, progress read
from sglang's log lines, backoff, log rotation, the GPU check's rules, process scans."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from standin import PROFILES, free_port, make_env_python

from sm120kit.node.check import Status
from sm120kit.node.checks import serving
from sm120kit.node.checks.gpus import gpus as gpus_check
from sm120kit.node.nvml_schema import Gpu, NvmlDocument, visible
from sm120kit.node.registry import CheckInputs
from sm120kit.node.snapshot import Snapshot
from sm120kit.profiles.model import Health, Profile
from sm120kit.serve import procs
from sm120kit.serve.machine import Policy, ServerSpec
from sm120kit.serve.progress import LineSplitter, phase_of
from sm120kit.serve.rundir import copy_truncate, rotate, runs

GiB = 1 << 30


def profile(**parts) -> Profile:
    return Profile.model_validate(parts)


def inputs(profile=None, env=None, gpus=None, **choices) -> CheckInputs:
    """What a check looks at: this environment, and NVML answering with these GPUs."""
    doc = {"gpus": [g.model_dump() for g in gpus or []]}
    return CheckInputs(Snapshot(Path("/"), env or {}, lambda: doc), profile, **choices)


def test_port_plan_follows_sglang_port_args():
    assert serving.port_plan(profile()) == [("server.port", "127.0.0.1", 30000)]
    dp = profile(server={"port": 30000}, extra_args={"--enable-dp-attention": True, "--nccl-port": 29500})
    plan = serving.port_plan(dp)
    assert ("--nccl-port", "127.0.0.1", 29500) in plan
    assert [p for _, _, p in plan if p > 30000] == list(range(30233, 30239))  # --port + ZMQ_TCP_PORT_DELTA
    high = serving.port_plan(profile(server={"port": 65500}, extra_args={"--enable-dp-attention": True}))
    assert [p for _, _, p in high][1:] == list(range(65267, 65273))  # sglang steps down near 65535
    rank0 = profile(parallel={"nnodes": 2, "node_rank": 0, "dist_init_addr": "10.0.0.1:5000"})
    assert serving.port_plan(rank0)[-1] == ("parallel.dist_init_addr", "0.0.0.0", 5000)
    rank1 = profile(parallel={"nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:5000"})
    assert len(serving.port_plan(rank1)) == 1  # only rank 0 binds the rendezvous port


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
    assert [(tmp_path / n).read_text() for n in ("server.log", "server.log.1", "server.log.3")] == [
        "run 6\n",
        "run 5\n",
        "run 3\n",
    ]


def test_copy_truncate_keeps_an_appending_writer_writing(tmp_path):
    log = tmp_path / "server.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"old line\n")
    copy_truncate(log)
    os.write(fd, b"new line\n")
    os.close(fd)
    assert log.read_bytes() == b"new line\n" and (tmp_path / "server.log.1").read_bytes() == b"old line\n"


def gpu(index, cc="12.0", free=90, total=96, processes=None) -> Gpu:
    """A GPU as NVML's document has it (MiB; free and total given in GiB)."""
    return Gpu(
        index=index,
        name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        uuid=f"GPU-{index:04d}-aaaa",
        compute_capability=cc,
        memory_total_mib=total * 1024,
        memory_used_mib=(total - free) * 1024,
        memory_free_mib=free * 1024,
        processes={str(pid): used // (1 << 20) for pid, used in (processes or {}).items()},
    )


def test_cuda_visible_devices_by_index_and_uuid():
    eight = [gpu(i) for i in range(8)]
    assert [g.index for g in visible(eight, {})] == list(range(8))
    assert [g.index for g in visible(eight, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})] == [4, 5, 6, 7]
    assert [g.index for g in visible(eight, {"CUDA_VISIBLE_DEVICES": "GPU-0003,1"})] == [3, 1]
    assert [g.index for g in visible(eight, {"CUDA_VISIBLE_DEVICES": "0,9,1"})] == [0]  # CUDA stops at a bad entry
    assert visible(eight, {"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize(
    "found, problem",
    [
        ([gpu(i) for i in range(8)], None),
        ([gpu(i) for i in range(4)], "the profile needs 8 GPUs, 4 found"),
        ([gpu(i, cc="9.0") for i in range(8)], "the profile is for compute capability 12.0 (SM120); GPU 0-7 is not"),
        (
            [gpu(0, free=6, processes={4242: 88 * GiB})] + [gpu(i) for i in range(1, 8)],
            "GPU 0 has 6144 of 98304 MiB free, below 0.85 of it; held by pid 4242 (90112 MiB)",
        ),
    ],
)
def test_gpu_check_rules(found, problem):
    glm = profile(node={"gpus": 8, "compute_capability": "12.0"}, engine={"mem_fraction_static": 0.85})
    check = gpus_check(inputs(glm, gpus=found))
    assert check.status is (Status.OK if problem is None else Status.FAIL)
    if problem:
        assert problem in check.detail and "--no-gpu-check" in check.fix


def test_serve_reads_the_gpus_from_doctors_nvml_document():
    """One reader: the preflight's GPUs are those of the document doctor reports (here one
    recorded on a real H200 node, before it reported free memory)."""
    import json

    doc = json.loads((Path(__file__).parent / "fixtures" / "doctor" / "h200-recorded.json").read_text())
    found = NvmlDocument.model_validate(doc).gpus
    assert [g.index for g in found] == list(range(len(doc["gpus"])))
    assert found[0].name == "NVIDIA H200" and found[0].compute_capability == "9.0"
    assert found[0].memory_total_mib == 143771 and found[0].free_mib == 143771 - 615
    no_driver = "no NVIDIA driver: NVML cannot start (NVML Shared Library Not Found)"
    check = gpus_check(CheckInputs(Snapshot(Path("/"), {}, lambda: {"error": no_driver}), profile()))
    assert check.status is Status.FAIL and check.detail.endswith(no_driver)


@pytest.fixture
def no_driver(monkeypatch):
    """NVML as on a machine without the NVIDIA driver (CI), whatever this machine has."""
    import pynvml

    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


@pytest.mark.preflight
def test_without_a_driver_serve_and_doctor_both_fail_the_gpus(cli, no_driver, monkeypatch, tmp_path):
    """One truth: the preflight refuses a profile whose GPUs cannot be established, as
    doctor fails the node; only --no-gpu-check gets past it."""
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", "0.5.23")
    argv = [
        "serve",
        "standin",
        "--python",
        python,
        "--profile-dir",
        PROFILES,
        "--check",
        "--set",
        f"server.port={free_port()}",
        "--wide",  # each check on one line, as the assertions read it
    ]
    no_nvml = "no NVIDIA driver: NVML cannot start (NVML Shared Library Not Found)"
    code, out, err = cli(*argv)
    assert code == 1, out + err
    assert f"FAIL gpus: cannot tell whether the 2 GPUs the profile needs are here: {no_nvml}" in out
    assert "--no-gpu-check" in out and "sm120kit[gpu]" not in out + err
    code, out, _ = cli(*argv, "--no-gpu-check")
    assert code == 0 and "skip gpus: not checked (--no-gpu-check)" in out, out
    code, out, err = cli("doctor", "--python", python, "--wide")
    assert code == 1 and "sm120kit[gpu]" not in out + err, out
    assert any(line.split()[:2] == ["FAIL", "driver"] and no_nvml in line for line in out.splitlines()), out


def test_exit_descriptions():
    assert procs.exit_description(0) == (0, "exit code 0")
    assert procs.exit_description(1 << 8) == (1, "exit code 1")
    assert procs.exit_description(signal.SIGKILL) == (None, "killed by SIGKILL")


@pytest.mark.preflight
def test_scan_finds_sglang_titles_and_our_marker():
    titled = subprocess.Popen(["sglang::scheduler_TP3", "-c", "import time; time.sleep(60)"], executable=sys.executable)
    marked = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, procs.MARKER: "p:1234"}
    )
    try:
        time.sleep(0.3)
        by_title = {p.pid: p for p in procs.scan(sglang=True)}
        assert titled.pid in by_title and marked.pid not in by_title
        assert by_title[titled.pid].title.startswith("sglang::scheduler_TP3")
        assert [p.pid for p in procs.scan(marker="p:1234")] == [marked.pid]
        assert marked.pid in {p.pid for p in procs.scan(marker="")} and procs.scan(marker="p:other") == []
        report = procs.stop(None, None, timeout=5, pids={titled.pid, marked.pid})
        assert report.clean and report.processes == 2 and report.killed == []
    finally:
        for p in (titled, marked):
            p.kill()
            p.wait()


def titled_child(parent_code: str) -> str:
    child = "import setproctitle, time; setproctitle.setproctitle('sglang::scheduler_TP0'); time.sleep(60)"
    spawn = f"subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
    return f"import subprocess, sys, time; print({spawn}.pid, flush=True); {parent_code}"


@pytest.mark.preflight
def test_stale_means_orphaned_not_merely_unrecognised(monkeypatch, tmp_path):
    """A scheduler whose launcher is alive is not stale, even when the launcher's command
    line says nothing of sglang (an operator's script around sglang's Engine); one whose
    launcher is gone (re-parented to a subreaper outside its process group) is."""
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    launcher = subprocess.Popen(
        [sys.executable, "-c", titled_child("time.sleep(60)")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    healthy = int(launcher.stdout.readline())
    gone = subprocess.run(
        [sys.executable, "-c", titled_child("")], capture_output=True, text=True, start_new_session=True, check=True
    )
    orphan = int(gone.stdout)
    try:
        for pid in (healthy, orphan):
            while psutil.Process(pid).cmdline()[:1] != ["sglang::scheduler_TP0"]:
                time.sleep(0.02)
        check = serving.stale_processes(inputs(processes=procs, runs=runs))
        listed, _, left_alone = check.detail.partition("left alone")
        assert (
            check.status is Status.FAIL and f"pid {orphan} " in listed and "orphaned: its launcher is gone" in listed
        ), check.detail
        assert f"pid {healthy} " not in listed and f"pid {healthy} " in left_alone, check.detail
    finally:
        launcher.kill()
        launcher.wait()
        for pid in (healthy, orphan):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(orphan, 0)  # adopted by the test run, a subreaper


@pytest.mark.parametrize(
    "parts, key",
    [
        ({"extra_args": {"--nccl-port": "auto"}}, 'extra_args."--nccl-port"'),
        ({"extra_args": {"--nccl-port": 99999}}, 'extra_args."--nccl-port"'),
        ({"parallel": {"nnodes": 2, "dist_init_addr": "10.0.0.1:abc"}}, "parallel.dist_init_addr"),
    ],
)
def test_a_port_that_is_not_a_port_is_a_clear_error(parts, key):
    from sm120kit.errors import UserError

    with pytest.raises(UserError, match=f"{key} = .* is not a port"):
        serving.port_plan(profile(**parts))


def test_api_keys_are_masked_in_process_titles():
    assert procs._title(["python", "-m", "sglang.launch_server", "--api-key", "sk-1", "--admin-api-key=sk-2"], "x") == (
        "python -m sglang.launch_server --api-key *** --admin-api-key=***"
    )


# -- an API key that would break a header is refused, a probe error never kills (item 9) --

SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (SECRET + "\r", "a carriage return"),
        (SECRET + "\n", "a newline"),
        (SECRET + "\r\n", "a carriage return"),
        (" " + SECRET, "a space"),
        (SECRET[:6] + "\t" + SECRET[6:], "a tab"),
        (SECRET + "\x00", "a control character"),
        (SECRET + "é", "a non-ASCII character"),
    ],
)
def test_an_api_key_that_is_not_one_printable_word_is_refused(key, says):
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": key}))
    assert check.status is Status.FAIL and says in check.detail and "$K" in check.detail
    assert SECRET not in check.detail + check.fix and "tr -d" in check.fix


def test_a_good_api_key_passes():
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": SECRET}))
    assert check.status is Status.OK and SECRET not in check.detail


def test_a_probe_with_a_key_that_breaks_the_header_fails_without_raising_or_telling_the_key():
    from sm120kit.serve.probe import probe

    with socket.socket() as listener:  # a port of our own that accepts: nothing of the host's
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        result = probe("127.0.0.1", listener.getsockname()[1], 1.0, api_key=SECRET + "\r")
    assert result.ok is False and result.status is None
    assert SECRET not in result.detail and "\r" not in result.detail


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


def test_an_error_that_mentions_the_key_is_reraised_without_it():
    import traceback

    from sm120kit.serve.command import keep_secret

    with pytest.raises(RuntimeError) as info, keep_secret(SECRET, "$K"):
        try:
            raise OSError(f"header Bearer {SECRET}")
        except OSError:
            raise RuntimeError("wrapped")  # noqa: B904 -- the chained one carries the key
    text = "".join(traceback.format_exception(info.value))
    assert SECRET not in text and "RuntimeError: wrapped" in text
    with pytest.raises(ValueError, match="no key here"), keep_secret(SECRET, "$K"):
        raise ValueError("no key here")


# -- redaction where a value is written, never of serialized records (item 10) -----------


def test_the_record_is_never_rewritten_by_text_substitution(tmp_path):
    """A key that is also a piece of the record ("0") must not turn 127.0.0.1 into
    127.$KEY.$KEY.1: state and events are written as they are; the key is kept out of
    them where it could enter (log lines, argv), not by rewriting the JSON."""
    import json

    from sm120kit.serve.rundir import RunRecord

    record = RunRecord(tmp_path / "run")
    record.secrets["0"] = "$KEY"
    record.update(host="127.0.0.1", port=30000, supervisor_pid=1030)
    record.event("started", pid=10, argv=["--port", "30000"])
    state = json.loads(record.state_file.read_text())
    [event] = [json.loads(line) for line in record.events.read_text().splitlines()]
    assert (state["host"], state["port"], state["supervisor_pid"]) == ("127.0.0.1", 30000, 1030)
    assert (event["pid"], event["argv"]) == (10, ["--port", "30000"])
    assert record.redact("api_key='0'") == "api_key='$KEY'"  # log lines are still redacted


@pytest.mark.parametrize("key", ["0", "sk-1234"])
def test_a_key_too_short_to_be_a_secret_is_refused(key):
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": key}))
    assert check.status is Status.FAIL and f"{len(key)} character" in check.detail and "at least 8" in check.detail
    assert repr(key) not in check.detail + check.fix
    assert serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": "sk-12345"})).status is Status.OK


def test_the_specs_that_carry_the_key_keep_it_out_of_their_repr():
    from sm120kit.bench.client import Sweep

    server = ServerSpec(
        "p", ["x", "--api-key", SECRET], ["x", "--api-key", "$K"], {"K": SECRET}, "127.0.0.1", 1, [], api_key=SECRET
    )
    sweep = Sweep("python", "sglang.benchmark.serving", "http://127.0.0.1:1", 256, 128, 3.0, api_key=SECRET)
    assert SECRET not in repr(server) and "$K" in repr(server) and SECRET not in repr(sweep)


def test_a_key_split_across_two_reads_of_the_log_is_redacted(tmp_path):
    import io

    from sm120kit.serve import supervisor
    from sm120kit.serve.rundir import RunRecord

    server = ServerSpec("p", ["x"], ["x"], {}, "127.0.0.1", 1, [], api_key=SECRET, api_key_env="K")
    out = io.StringIO()
    sup = supervisor.Supervisor(server, Policy.from_health(profile().health), RunRecord(tmp_path / "run"), out=out)
    log = tmp_path / "server.log"
    log.write_text("")
    with open(log, "rb") as fh:
        run = supervisor.Child(None, fh)
        for part in (f"server_args=ServerArgs(api_key='{SECRET[:7]}", f"{SECRET[7:]}', port=1)\n"):
            with open(log, "a") as w:
                w.write(part)
            sup._read_log(run)
    assert SECRET not in out.getvalue() and "api_key='$K', port=1)" in out.getvalue()


def test_a_log_copy_that_fails_on_a_full_disk_still_truncates_the_log(tmp_path, monkeypatch):
    import errno
    import shutil

    def full(src, dst):
        with open(dst, "wb") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfile", full)
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * 4096)
    with pytest.raises(OSError, match="No space left"):
        copy_truncate(log)
    assert log.stat().st_size == 0 and not (tmp_path / "server.log.1").exists()


def test_the_key_file_replaces_the_key_by_its_place_in_argv_not_its_text(tmp_path):
    """A key that is also another argument ("127.0.0.1", --host's value) once had --config
    replace --host, and left --api-key KEY in the process list."""
    from sm120kit.profiles.render import EnvRef, Launch
    from sm120kit.serve.command import resolve_argv

    launch = Launch(
        ["python3", "-m", "sglang.launch_server", "--host", "127.0.0.1", "--api-key", EnvRef("K")], {}, "0.5.23"
    )
    argv, shown, key = resolve_argv(launch, {"K": "127.0.0.1"}, tmp_path / "api-key.yaml")
    assert argv[3:] == shown[3:] == ["--host", "127.0.0.1", "--config", str(tmp_path / "api-key.yaml")]
    assert key == "127.0.0.1" and '"127.0.0.1"' in (tmp_path / "api-key.yaml").read_text()
