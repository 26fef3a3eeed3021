"""The `nccl all-reduce` check (`doctor --nccl`): its orchestration against the stand-in worker
(TEST FIXTURE tests/fixtures/nccl_probe_standin.py, which speaks sm120kit/node/nccl_probe.py's
protocol without torch or GPUs), each verdict, the bound on a hang (the whole process group killed
within it), the GPU pair it picks from NVML, its options; and the real worker's argument handling
and its answer where torch cannot be imported (TEST FIXTURE tests/fixtures/no_torch/). The real
worker on two GPUs: scripts/nccl_probe_gpu_proof.py."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from sm120kit.errors import UserError
from sm120kit.node import registry
from sm120kit.node.check import Status
from sm120kit.node.checks import nccl
from sm120kit.node.inputs import NcclRequest
from sm120kit.node.snapshot import Snapshot

FIXTURES = Path(__file__).parent / "fixtures"
STANDIN = FIXTURES / "nccl_probe_standin.py"
NO_TORCH = FIXTURES / "no_torch"
SM120 = json.loads((FIXTURES / "doctor" / "rtx-pro-6000-x8.json").read_text())
UUID = [g["uuid"] for g in SM120["gpus"]]
# Each run's bound in these tests. A healthy run (three Python starts: the launcher and its two
# ranks) must finish well within it on a loaded machine; a run that hangs costs it in wall time.
HANG_BOUND_S = 5.0


def inputs(tmp_path, standin: dict | None = None, *, doc=SM120, env=None, profile_env=None, gpus=None, worker=STANDIN):
    """CheckInputs over the 8-GPU SM120 fixture node with doctor --nccl asked; the stand-in's
    behaviour travels in the node's environment, as the server's environment does to the worker."""
    node_env = {"PATH": os.environ.get("PATH", ""), **(env or {})}
    if standin is not None:
        node_env["SM120KIT_NCCL_STANDIN"] = json.dumps(standin)
    node = Snapshot(tmp_path, node_env, lambda: doc)
    profile = SimpleNamespace(name="test", env=profile_env) if profile_env is not None else None
    request = NcclRequest(sys.executable, gpus, HANG_BOUND_S, worker)
    return registry.CheckInputs(node, profile, nccl=request)


def launches(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_without_the_option_it_is_not_run_and_says_how_to_ask(tmp_path):
    request = registry.CheckInputs(Snapshot(tmp_path, {}, lambda: SM120))
    found = nccl.nccl_all_reduce(request)
    assert (found.status, found.detail) == (
        Status.SKIP,
        "not run (--nccl): it runs NCCL on two idle GPUs for some seconds",
    )
    assert "doctor --nccl" in found.fix


# ----------------------------------------------------------------------------- the verdicts

SHM = "SHM/direct/direct"
VERDICTS = [
    # (name, stand-in per run, the server's NCCL_P2P_DISABLE, status, words in the detail, words in the fix)
    (
        "both run, P2P faster",
        {"p2p": {"busbw": 24.0}, "off": {"busbw": 12.0}},
        None,
        Status.OK,
        f"P2P 24.0 GB/s via P2P/CUMEM; P2P disabled 12.0 GB/s via {SHM}",
        "",
    ),
    (
        "both run, P2P slower",
        {"p2p": {"busbw": 8.0}, "off": {"busbw": 12.0}},
        None,
        Status.WARN,
        "P2P 8.0 GB/s via P2P/CUMEM; P2P disabled 12.0 GB/s via SHM/direct/direct: P2P is slower than NCCL without it",
        "iommu=pt",
    ),
    (
        "P2P hangs, disabled runs",
        {"p2p": {"hang": "first"}, "off": {"busbw": 12.0}},
        None,
        Status.FAIL,
        f"P2P hung in the first all-reduce (where the ranks connect), connected via P2P/CUMEM; killed after "
        f"{HANG_BOUND_S:g} s; P2P disabled 12.0 GB/s via {SHM}: the server's NCCL would use P2P, and P2P does not work",
        "set NCCL_P2P_DISABLE=1 in the profile's [env]",
    ),
    (
        "P2P fails, disabled runs",
        {
            "p2p": {
                "rank_fatal": {"kind": "nccl", "error": "rank 1: DistBackendError: NCCL error: unhandled cuda error"}
            }
        },
        None,
        Status.FAIL,
        "P2P failed (connected via P2P/CUMEM): rank 1: DistBackendError: NCCL error: unhandled cuda error",
        "pci=noacs",
    ),
    (
        "both fail",
        {"p2p": {"hang": "init"}, "off": {"crash": True}},
        None,
        Status.FAIL,
        f"P2P hung in setting up the communicator; killed after {HANG_BOUND_S:g} s; P2P disabled failed: the worker "
        "exited with status 1 without a result: NCCL cannot all-reduce between these GPUs, with P2P or without",
        "NCCL_DEBUG=INFO",
    ),
    (
        "P2P runs, disabled fails (not the server's path)",
        {"off": {"rank_fatal": {"kind": "nccl", "error": "rank 1: shm open failed"}}},
        None,
        Status.OK,
        "P2P 20.0 GB/s via P2P/CUMEM; P2P disabled failed (connected via SHM/direct/direct): rank 1: shm open failed",
        "",
    ),
    (
        "the server disables P2P, which hangs here",
        {"p2p": {"hang": "first"}},
        "1",
        Status.OK,
        "P2P is broken here, and the server's environment sets NCCL_P2P_DISABLE",
        "",
    ),
    (
        "the server disables P2P, and without it NCCL fails",
        {"off": {"rank_fatal": {"kind": "nccl", "error": "rank 0: no shared memory"}}},
        "1",
        Status.FAIL,
        "the server's environment sets NCCL_P2P_DISABLE, and without P2P the all-reduce fails",
        "remove NCCL_P2P_DISABLE",
    ),
    (
        "the server disables P2P, which is faster here",
        {"p2p": {"busbw": 40.0}, "off": {"busbw": 12.0}},
        "1",
        Status.WARN,
        "though P2P works and is faster here",
        "remove NCCL_P2P_DISABLE",
    ),
    (
        "the server disables P2P, which is no faster here",
        {"p2p": {"busbw": 12.5}, "off": {"busbw": 12.0}},
        "1",
        Status.OK,
        "(the server's environment sets NCCL_P2P_DISABLE)",
        "",
    ),
    (
        "P2P runs, but NCCL connects through shared memory",
        {"p2p": {"busbw": 12.0, "transport": SHM}, "off": {"busbw": 12.0}},
        None,
        Status.OK,
        f"P2P 12.0 GB/s via {SHM}; P2P disabled 12.0 GB/s via {SHM} (NCCL did not use P2P between these GPUs)",
        "",
    ),
]


@pytest.mark.parametrize(
    "standin, server_disables, status, words, fix", [v[1:] for v in VERDICTS], ids=[v[0] for v in VERDICTS]
)
def test_the_verdict_on_the_two_runs(tmp_path, standin, server_disables, status, words, fix):
    env_log = tmp_path / "launches.jsonl"
    profile_env = {"NCCL_P2P_LEVEL": "SYS", **({"NCCL_P2P_DISABLE": server_disables} if server_disables else {})}
    began = time.monotonic()
    found = nccl.nccl_all_reduce(inputs(tmp_path, {**standin, "env": str(env_log)}, profile_env=profile_env))
    assert found.status is status and words in found.detail, found
    assert fix in found.fix and (found.fix == "") == (fix == "")
    assert found.detail.startswith("GPU 0 and 4 (across-sockets), 64 MiB all-reduce, bus bandwidth: P2P ")
    hangs = sum("hang" in run for run in standin.values())
    assert time.monotonic() - began < 20 + hangs * (HANG_BOUND_S + nccl.KILL_GRACE_S)
    # P2P disabled first, so that a P2P hang cannot spoil it; both with the profile's variables
    runs = launches(env_log)
    assert [r["env"].get("NCCL_P2P_DISABLE") for r in runs] == ["1", None]
    assert all(r["env"]["NCCL_P2P_LEVEL"] == "SYS" for r in runs)
    assert found.data["gpus"] == [0, 4] and found.data["server_p2p_disabled"] is bool(server_disables)
    assert set(found.data["runs"]) == {"p2p", "p2p_disabled"}


def test_no_torch_in_the_target_is_information_and_the_p2p_run_is_spared(tmp_path):
    env_log = tmp_path / "launches.jsonl"
    standin = {"off": {"fatal": {"kind": "no-torch", "error": "torch cannot be imported here: ModuleNotFoundError"}}}
    found = nccl.nccl_all_reduce(inputs(tmp_path, {**standin, "env": str(env_log)}))
    assert found.status is Status.INFO
    assert found.detail == "not run: torch cannot be imported here: ModuleNotFoundError"
    assert "--python" in found.fix and len(launches(env_log)) == 1


def test_a_target_torch_that_sees_too_few_gpus_is_information(tmp_path):
    standin = {"off": {"fatal": {"kind": "no-gpu", "error": "torch sees 1 GPU(s), 2 needed"}}}
    found = nccl.nccl_all_reduce(inputs(tmp_path, standin))
    assert (found.status, found.detail) == (Status.INFO, "not run: torch sees 1 GPU(s), 2 needed")


def test_a_python_that_cannot_be_run_is_information(tmp_path):
    request = inputs(tmp_path, {})
    request = registry.CheckInputs(
        request.node, nccl=NcclRequest(str(tmp_path / "no-python"), None, HANG_BOUND_S, STANDIN)
    )
    found = nccl.nccl_all_reduce(request)
    assert found.status is Status.INFO and found.detail.startswith(f"not run: cannot run {tmp_path / 'no-python'}: ")


# ----------------------------------------------------------------------------- the bound


# The bound of a run that hangs on purpose: the stand-in must reach the stage it hangs in (its
# launcher and ranks started) within it, on a loaded machine too; each case costs it in wall time.
HANG_TEST_BOUND_S = 4.0


@pytest.mark.parametrize(
    "hang, said",
    [
        ("first", "hung in the first all-reduce (where the ranks connect), connected via P2P/CUMEM"),
        ("timed", "hung in the timed all-reduces, connected via P2P/CUMEM"),
        ("ranks", "hung while the ranks started (importing torch)"),
        ("start", "hung before the worker was ready (importing torch, or the driver)"),
    ],
)
def test_a_hang_is_killed_within_the_bound_with_everything_it_started(tmp_path, monkeypatch, hang, said):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    pids = tmp_path / "pids"
    env = {"PATH": os.environ["PATH"], "SM120KIT_NCCL_STANDIN": json.dumps({"pids": str(pids), "p2p": {"hang": hang}})}
    bound = HANG_TEST_BOUND_S
    began = time.monotonic()
    run = nccl.probe(sys.executable, "0,1", env, "P2P", bound, STANDIN)
    took = time.monotonic() - began
    assert bound <= took < bound + nccl.KILL_GRACE_S, took
    assert run.outcome == "hung" and run.said(bound) == f"{said}; killed after {bound:g} s"
    started = dict(line.split() for line in pids.read_text().splitlines())
    assert set(started) == ({"launcher"} if hang == "start" else {"launcher", "rank0", "rank1"})
    assert all(gone(int(pid)) for pid in started.values())  # the ranks ignore SIGTERM: the group got SIGKILL
    assert run.left_running == []
    assert list((tmp_path / "tmp").iterdir()) == []  # the scratch directory (store, NCCL's logs) is removed


def test_a_run_that_finishes_leaves_nothing_and_reports_its_figures(tmp_path):
    pids = tmp_path / "pids"
    env = {
        "PATH": os.environ["PATH"],
        "SM120KIT_NCCL_STANDIN": json.dumps({"pids": str(pids), "p2p": {"busbw": 31.25}}),
    }
    run = nccl.probe(sys.executable, "0,1", env, "P2P", 30.0, STANDIN)
    assert (run.outcome, run.busbw_gbps, run.transport, run.stage) == ("ok", 31.25, ["P2P/CUMEM"], "timed")
    assert run.ready["nccl"] == "2.27.7" and run.seconds < 30
    assert all(gone(int(line.split()[1])) for line in pids.read_text().splitlines())


def test_the_group_kill_reaches_a_rank_that_outlived_its_launcher(tmp_path):
    """A rank left behind by a launcher that exited is found by its process group and killed."""
    script = tmp_path / "orphan.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
    )
    env = {"PATH": os.environ["PATH"]}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    orphan = int(proc.stdout.readline())
    proc.wait()
    began = time.monotonic() - 5
    assert not gone(orphan)
    assert nccl.child_process.end_group(proc.pid, began) == []
    assert gone(orphan)


# ----------------------------------------------------------------------------- the pair


def test_the_pair_is_the_farthest_linked_and_named_by_uuid(tmp_path):
    env_log = tmp_path / "launches.jsonl"
    found = nccl.nccl_all_reduce(inputs(tmp_path, {"env": str(env_log)}))
    assert found.status is Status.OK and found.data["link"] == "across-sockets"
    run = launches(env_log)[0]
    assert run["env"]["CUDA_VISIBLE_DEVICES"] == f"{UUID[0]},{UUID[4]}"
    argv = run["argv"]
    assert argv[argv.index("--size-mib") + 1] == "64" and argv[argv.index("--timeout") + 1] == f"{HANG_BOUND_S:g}"
    assert "--scratch" in argv


def test_the_pair_can_be_chosen(tmp_path):
    env_log = tmp_path / "launches.jsonl"
    found = nccl.nccl_all_reduce(inputs(tmp_path, {"env": str(env_log)}, gpus=(2, 3)))
    assert found.detail.startswith("GPU 2 and 3, ") and found.data["gpus"] == [2, 3]
    assert launches(env_log)[0]["env"]["CUDA_VISIBLE_DEVICES"] == f"{UUID[2]},{UUID[3]}"


def test_the_pair_is_among_the_gpus_the_server_sees(tmp_path):
    env_log = tmp_path / "launches.jsonl"
    found = nccl.nccl_all_reduce(inputs(tmp_path, {"env": str(env_log)}, env={"CUDA_VISIBLE_DEVICES": "1,2,5"}))
    assert found.data["gpus"] == [1, 5] and found.data["link"] == "across-sockets"
    with pytest.raises(UserError, match=r"--nccl-gpus 0,1: no GPU 0 of the visible 1-2, 5"):
        nccl.nccl_all_reduce(inputs(tmp_path, {}, env={"CUDA_VISIBLE_DEVICES": "1,2,5"}, gpus=(0, 1)))


def test_without_topology_or_uuids_the_first_two_by_pci_order(tmp_path):
    doc = copy.deepcopy(SM120)
    doc["topology"] = []
    for g in doc["gpus"]:
        g["uuid"] = ""
    env_log = tmp_path / "launches.jsonl"
    found = nccl.nccl_all_reduce(inputs(tmp_path, {"env": str(env_log)}, doc=doc))
    assert found.data["gpus"] == [0, 1] and found.data["link"] is None
    env = launches(env_log)[0]["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("0,1", "PCI_BUS_ID")


@pytest.mark.parametrize(
    "change, env, detail",
    [
        (
            lambda d: d["gpus"][4].update(processes={"4242": 81000}),
            {},
            "not run on GPU 0 and 4 (across-sockets): in use (pid 4242 on GPU 4); an all-reduce beside them "
            "would disturb both",
        ),
        (lambda d: None, {"CUDA_VISIBLE_DEVICES": "3"}, "not run: fewer than two GPUs (1 visible)"),
        (
            lambda d: d.update(error="no NVIDIA driver: NVML cannot start"),
            {},
            "not run: the GPUs cannot be listed (no NVIDIA driver: NVML cannot start)",
        ),
    ],
    ids=["a gpu in use", "one gpu visible", "no nvml"],
)
def test_when_it_cannot_run_it_says_why_and_starts_nothing(tmp_path, change, env, detail):
    doc = copy.deepcopy(SM120)
    change(doc)
    env_log = tmp_path / "launches.jsonl"
    found = nccl.nccl_all_reduce(inputs(tmp_path, {"env": str(env_log)}, doc=doc, env=env))
    assert (found.status, found.detail) == (Status.INFO, detail)
    assert launches(env_log) == []


# ----------------------------------------------------------------------------- the options


@pytest.mark.parametrize(
    "args, message",
    [
        ((None, None, "0", None), "--nccl-gpus 0: two different GPU indices are needed"),
        ((None, None, "3,3", None), "--nccl-gpus 3,3: two different GPU indices are needed"),
        ((None, None, "a,b", None), "--nccl-gpus a,b: two different GPU indices are needed"),
        ((None, None, None, "--nvml"), "--nccl runs NCCL on this node, and --nvml describes another one"),
        ((None, "site-packages", None, None), "--site names files, not an interpreter"),
    ],
)
def test_bad_options_are_refused(args, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        nccl.request(*args, "python3")


def test_the_options_make_a_request():
    assert nccl.request(None, None, None, None, "py") == NcclRequest("py", None, nccl.RUN_TIMEOUT_S, nccl.WORKER)
    assert nccl.request("/venv/bin/python", None, " 0, 4", None, "py").gpus == (0, 4)
    assert nccl.WORKER.name == "nccl_probe.py" and nccl.WORKER.is_file()


def test_doctor_nccl_from_the_command_line(cli, tmp_path, monkeypatch):
    from sm120kit.node import nvml

    env_log = tmp_path / "launches.jsonl"
    monkeypatch.setattr(nvml, "read", lambda pairs=True: copy.deepcopy(SM120))
    monkeypatch.setattr(nccl, "WORKER", STANDIN)
    monkeypatch.setattr(registry, "DOCTOR", ("gpus", "nccl all-reduce"))
    monkeypatch.setenv("SM120KIT_NCCL_STANDIN", json.dumps({"env": str(env_log), "p2p": {"busbw": 22.0}}))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code, out = cli.json("doctor", "--nccl-gpus", "1,6", "--profile", "glm5-nvfp4")
    check = {c["check"]: c for c in out["checks"]}["nccl all-reduce"]
    assert code == 0 and check["status"] == "ok", check
    assert check["detail"].startswith("GPU 1 and 6, 64 MiB all-reduce, bus bandwidth: P2P 22.0 GB/s via P2P/CUMEM")
    assert [r["env"]["NCCL_P2P_LEVEL"] for r in launches(env_log)] == ["SYS", "SYS"]  # the profile's [env]
    code, out = cli.json("doctor", "--profile", "glm5-nvfp4")
    assert {c["check"]: c for c in out["checks"]}["nccl all-reduce"]["status"] == "skip"
    assert len(launches(env_log)) == 2


def test_doctor_refuses_nccl_on_a_recorded_node(cli, tmp_path):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(SM120))
    code, _, err = cli("doctor", "--nccl", "--nvml", path)
    assert code == 2 and "--nccl runs NCCL on this node, and --nvml describes another one" in err


# ----------------------------------------------------------------------------- the real worker

WORKER = nccl.WORKER


def real_worker(*argv: str, torch_missing: bool = True) -> tuple[int, list[dict]]:
    env = {"PATH": os.environ["PATH"], **({"PYTHONPATH": str(NO_TORCH)} if torch_missing else {})}
    done = subprocess.run([sys.executable, str(WORKER), *argv], capture_output=True, text=True, env=env, timeout=60)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--world", "0"], "--world 0: at least one rank"),
        (["--size-mib", "0"], "--size-mib and --iterations must be >= 1, --warmup >= 0, --timeout > 0"),
        (["--rank", "0"], "--rank and --store go together"),
        (["--rank", "2", "--store", "x"], "--rank 2 is not in 0..1"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--iterations", "many"], "argument --iterations: invalid int value: 'many'"),
    ],
)
def test_the_real_worker_refuses_bad_arguments_with_a_fatal_event(argv, error):
    code, events = real_worker(*argv)
    assert code == 3 and len(events) == 1
    assert events[0]["event"] == "fatal" and events[0]["kind"] == "bad-args" and error in events[0]["error"]


@pytest.mark.parametrize("argv", [[], ["--rank", "1", "--store", "store"]], ids=["launcher", "rank"])
def test_the_real_worker_without_torch_says_so(argv):
    code, events = real_worker("--size-mib", "1", *argv)
    assert code == 3 and events == [
        {
            "event": "fatal",
            "kind": "no-torch",
            "error": "torch cannot be imported here: ImportError: no torch in this environment (the test fixture's "
            "stand-in)",
        }
    ]


def test_the_check_with_the_real_worker_and_no_torch_is_information(tmp_path):
    found = nccl.nccl_all_reduce(inputs(tmp_path, env={"PYTHONPATH": str(NO_TORCH)}, worker=WORKER))
    assert found.status is Status.INFO and found.detail.startswith(
        "not run: torch cannot be imported here: ImportError"
    )


def test_the_real_launcher_kills_the_peers_of_a_dead_rank(monkeypatch):
    """A NCCL peer waits for a dead rank forever: the launcher gives it RANK_GRACE_S, then kills it."""
    from sm120kit.node import nccl_probe

    monkeypatch.setattr(nccl_probe, "RANK_GRACE_S", 0.3)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    began = time.monotonic()
    assert nccl_probe.wait_ranks([waiting, dead]) == "rank 1 exited with status 3"
    assert time.monotonic() - began < 10 and waiting.returncode == -9
    fine = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert nccl_probe.wait_ranks(fine) == ""


def test_the_transport_is_read_from_nccl_log_lines_as_nccl_writes_them(tmp_path):
    from sm120kit.node import nccl_probe

    assert nccl_probe.TRANSPORT.pattern == nccl.TRANSPORT.pattern  # the worker cannot import sm120kit
    lines = [
        "node:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "node:123:456 [0] NCCL INFO Channel 01 : 0[0] -> 1[1] via SHM/direct/direct",
        "node:123:456 [0] NCCL INFO Channel 02/0 : 0[18000] -> 1[5d000] [send] via NET/Socket/0",
        "node:123:456 [0] NCCL INFO Connected all rings",
    ]
    (tmp_path / "nccl.123.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "nccl.999.log").write_text("node:999:1 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/IPC\n")
    assert nccl_probe.transports(tmp_path, 123) == ["NET/Socket/0", "P2P/CUMEM/read", "SHM/direct/direct"]
    assert nccl._logged_transports(tmp_path) == ["NET/Socket/0", "P2P/CUMEM/read", "P2P/IPC", "SHM/direct/direct"]
