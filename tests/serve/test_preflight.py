"""serve's preflight (sm120kit.serve.preflight and the node checks it runs): the port plan as
sglang derives it, the GPU check's rules, what the server imports, process scans and stale
processes, the options a dry run checks as a start does, and a start refused before anything
runs. `render systemd` runs the same checks against the unit's interpreter.

Tests marked `preflight` are rerun with a foreign sglang process alive (the last test here):
the host's processes change no result."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.inner_pytest import run_pytest
from support.node import check_inputs as inputs
from support.paths import ROOT
from support.serve import VERSION, make_venv, profile, ps, said
from support.sites import install
from support.standin import PROFILES, STANDIN, Served, foreign_server, free_port, make_env_python

from sm120kit import wheels
from sm120kit.exit_codes import ExitCode
from sm120kit.node.check import Status
from sm120kit.node.checks import imports, serving
from sm120kit.node.checks.gpus import gpus as gpus_check
from sm120kit.node.nvml_schema import Gpu, NvmlDocument, visible
from sm120kit.node.registry import CheckInputs
from sm120kit.node.snapshot import Snapshot
from sm120kit.serve import procs
from sm120kit.serve.rundir import runs


@pytest.mark.preflight
def test_a_killed_supervisor_takes_the_server_down_and_the_next_preflight_finds_the_rest(serve):
    s = serve({"orphan": True}).start()
    s.wait("ready")
    launcher = s.events("started")[0]["pid"]
    s.proc.kill()  # SIGKILL: no chance to stop anything
    s.proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(s.ours()) > 1:
        time.sleep(0.05)
    left = s.ours()
    assert (
        not psutil.pid_exists(launcher) or psutil.Process(launcher).status() == psutil.STATUS_ZOMBIE
    )  # died with its supervisor
    assert [p.cmdline()[0] for p in left] == ["sglang::scheduler_TP1"]  # what escaped on purpose

    row = next(r for r in ps(s)[1]["runs"] if r["profile"] == "standin")
    assert row["status"] == "supervisor gone" and not row["running"]

    check = serve()
    check.state = s.state
    check.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = run_check(check)
    assert code == 1
    assert f"FAIL stale processes: 1 found: pid {left[0].pid} 'sglang::scheduler_TP1" in out and "--kill-stale" in out
    code, out = run_check(check, "--kill-stale")
    assert code == 0, out
    assert f"ok   stale processes: stopped 1: pid {left[0].pid}" in out
    assert not s.ours()


@pytest.mark.preflight
@pytest.mark.parametrize("marker", [None, "glm5-nvfp4:another-state-dir"])
def test_a_healthy_server_someone_else_started_is_not_stale(serve, tmp_path, marker):
    """`sglang serve` started by hand, its launcher alive: its scheduler and detokenizer
    are named and left alone, with or without --kill-stale (stale: of a run of ours that is
    over, or orphaned). So is one that sm120kit serves from another state directory (or
    another user's): a marker unknown here proves nothing."""
    other = foreign_server(tmp_path / "other", free_port(), env={"SM120KIT_SERVE_ID": marker} if marker else None)
    try:
        children = psutil.Process(other.pid).children()
        titles = sorted(c.cmdline()[0] for c in children)
        assert titles == ["sglang::detokenizer", "sglang::scheduler_TP0"]
        s = serve()
        for extra in ((), ("--kill-stale",)):
            code, out = run_check(s, *extra)
            assert code == 0, out
            assert "stale processes: none; another sglang server, not started by sm120kit, left alone" in out
            assert all(f"pid {c.pid} " in out for c in children)
            assert all(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children) and other.poll() is None
    finally:
        other.terminate()
        other.wait(10)


@pytest.mark.preflight
def test_a_port_already_taken_is_refused_and_nothing_starts(serve):
    s = serve()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", s.port))
        taken.listen()
        code, out = s.run()
    assert code == 2
    assert f"FAIL ports: in use: {s.port} (server.port) is held by pid {os.getpid()}" in out
    assert "refusing to start standin: 1 preflight check(s) failed" in out
    assert s.events("started") == [] and s.events("preflight")[0]["ok"] is False


def test_one_supervisor_per_profile(serve):
    s = serve().start()
    s.wait("ready")
    second = serve()
    second.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = second.run()
    assert code == 2 and f"profile standin is already being served by supervisor pid {s.proc.pid}" in out
    assert s.signal() == 0


@pytest.mark.preflight
def test_required_patches_are_verified_before_a_start(serve, env_python):
    """glm5-nvfp4 on an unpatched sglang 0.5.23: refused until `sm120kit patch`."""
    s = serve()
    argv = [
        sys.executable,
        "-m",
        "sm120kit",
        "serve",
        "glm5-nvfp4",
        "--python",
        str(env_python),
        "--check",
        "--no-gpu-check",
        "--set",
        f"server.port={s.port}",
        "--wide",  # each check on one line, as the assertions read it
    ]
    out = subprocess.run(argv, capture_output=True, text=True, env=s.env)
    assert out.returncode == 1
    assert (
        "FAIL patches: not in place: sglang-dsa-page-table-guard: would-apply; sglang-triton-smem-sm120: would-apply"
        in out.stdout
    )
    assert (  # each step for this environment and this profile, as it was changed
        f"-> run `sm120kit patch --verify --python {env_python}`; or `sm120kit serve glm5-nvfp4 --no-patch-check "
        f"--python {env_python} --set server.port={s.port}` to start anyway" in out.stdout
    )
    try:
        patched = subprocess.run(
            [sys.executable, "-m", "sm120kit", "patch", "--python", str(env_python)],
            capture_output=True,
            text=True,
            env=s.env,
        )
        assert patched.returncode == 0, patched.stdout + patched.stderr
        out = subprocess.run(argv, capture_output=True, text=True, env=s.env)
        assert out.returncode == 0, out.stdout
        assert "ok   patches: 6 in place, fixed upstream or not needed" in out.stdout
    finally:
        subprocess.run(
            [sys.executable, "-m", "sm120kit", "unpatch", "--python", str(env_python)],
            capture_output=True,
            env=s.env,
            check=True,
        )


GiB = 1 << 30


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

    doc = json.loads((ROOT / "tests" / "fixtures" / "doctor" / "h200-recorded.json").read_text())
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


SERVER = ["sglang.launch_server", "?sglang.srt.entrypoints.http_server"]  # what the check reads


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would point a venv's python at other packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | extra


def stand_in(site: Path, name: str) -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text("# TEST FIXTURE: an empty stand-in for a package sglang imports\n")


def standin_server(site: Path) -> None:
    """The sglang stand-in as the environment's sglang.launch_server (its imports: runpy)."""
    (site / "sglang" / "launch_server.py").write_text(
        f"# TEST FIXTURE\nimport runpy\n\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )


@pytest.fixture(scope="module")
def no_numpy(tmp_path_factory) -> Path:
    """sglang 0.5.23, every .py file of its wheel, in a venv that has every package its
    server imports but numpy (each one an empty stand-in)."""
    python, site = make_venv(tmp_path_factory.mktemp("no-numpy") / "env")
    wheels.unpack(wheels.fetch("sglang", VERSION), site, ["sglang/*.py"])
    bare = imports.probe(str(python), SERVER, clean_env())
    assert {"torch", "numpy", "fastapi", "uvicorn", "zmq", "transformers"} <= set(bare["missing"]), bare
    assert bare["files"] > 500 and bare["absent"] == [] and bare["unread"] == []  # the HTTP server's modules too
    for name in bare["missing"]:
        if name != "numpy":
            stand_in(site, name)
    return python


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_the_probe_names_the_one_package_missing_and_where_sglang_imports_it(no_numpy):
    said = imports.probe(str(no_numpy), SERVER, clean_env())
    assert list(said["missing"]) == ["numpy"], said["missing"]
    # where Python itself fails: its traceback ends at sglang/srt/utils/common.py, line 84, `import numpy as np`
    assert said["missing"]["numpy"] == "sglang/srt/utils/common.py:84"
    where, line = said["missing"]["numpy"].rsplit(":", 1)
    site = next(no_numpy.parent.parent.glob("lib/python*/site-packages"))
    statement = (site / where).read_text().splitlines()[int(line) - 1]
    assert statement.startswith(("import numpy", "from numpy")), statement  # a module-level import, really there
    assert "torch" in said["found"] and said["version"] == ".".join(map(str, sys.version_info[:3]))


def test_serve_refuses_to_start_naming_the_missing_package(no_numpy, tmp_path):
    """Before: `ok profile renders`, then the server crashed three times ("no known SM120
    failure signature"), exit 1. Now: refused before anything starts, exit 2."""
    s = Served(tmp_path / "run", no_numpy, {}, [], [], {})
    code, out = s.run()
    assert code == ExitCode.ERROR, out
    out = said(out)
    assert "FAIL imports: sglang's server would not start:" in out and "no module named 'numpy' (imported by" in out
    assert "the environment is incomplete" in out and f"{no_numpy} -m pip install 'sglang=={VERSION}'" in out
    assert "refusing to start standin: 1 preflight check(s) failed" in out
    assert s.events("started") == []
    [refused] = s.events("preflight")
    [check] = [c for c in refused["checks"] if c["check"] == "imports"]
    assert check["status"] == "fail" and list(check["data"]["missing"]) == ["numpy"]


def test_serve_check_and_dry_run_say_it_too(no_numpy, cli, state):
    argv = ["serve", "standin", "--profile-dir", PROFILES, "--python", no_numpy, "--no-gpu-check"]
    code, out, _ = cli(*argv, "--check", "--set", f"server.port={free_port()}")
    assert code == ExitCode.FINDINGS and "FAIL imports:" in out and "'numpy'" in said(out)
    code, out, err = cli(*argv, "--dry-run")  # the command printed, and what the start would refuse (issue 31)
    assert code == ExitCode.FINDINGS and "-m sglang.launch_server" in out and "Traceback" not in err
    assert "serve would refuse to start standin" in said(err) and "no module named 'numpy'" in said(err)


def test_a_complete_environment_passes_and_says_what_it_read(cli, state, tmp_path):
    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", VERSION)
    argv = ["serve", "standin", "--profile-dir", PROFILES, "--python", python, "--no-gpu-check", "--check"]
    code, doc = cli.json(*argv, "--set", f"server.port={free_port()}")
    [check] = [c for c in doc["checks"] if c["check"] == "imports"]
    assert code == 0 and check["status"] == "ok" and "has every package sglang's server imports" in check["detail"], (
        check
    )


def test_an_interpreter_that_hangs_is_stopped_and_the_check_only_warns(tmp_path):
    hangs = tmp_path / "python"
    hangs.write_text(f"#!{sys.executable}\n# TEST FIXTURE: a python that never answers\nimport time\ntime.sleep(600)\n")
    hangs.chmod(0o755)
    began = time.monotonic()
    check = imports.judge([(str(hangs), "sglang.launch_server")], clean_env(), timeout_s=1.0)
    assert time.monotonic() - began < 10
    assert check.status is Status.WARN and "no answer within 1 s" in check.detail, check


@pytest.fixture(scope="module")
def no_router(tmp_path_factory) -> Path:
    """sglang 0.5.23 (the files sm120kit reads) and the stand-in server, no sglang-router."""
    python, site = make_venv(tmp_path_factory.mktemp("no-router") / "env")
    install(site, VERSION, flashinfer=False)
    standin_server(site)
    return python


def test_render_systemd_refuses_a_python_without_sglang(cli):
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--python", sys.executable)  # this venv: no sglang
    assert (code, out) == (ExitCode.ERROR, "") and "sglang is not installed in python" in said(err), err


def test_render_systemd_refuses_a_fleet_without_sglang_router_as_serve_dry_run_does(cli, no_router, tmp_path):
    fleet = ["qwen3-30b-a3b-nvfp4-x8", "--python", no_router]
    code, out, err = cli("serve", *fleet, "--dry-run")
    assert (code, out) == (ExitCode.ERROR, "") and "sglang-router is not installed" in said(err)
    code, out, err = cli("render", "systemd", *fleet)
    assert (code, out) == (ExitCode.ERROR, "") and "sglang-router is not installed" in said(err), err
    (tmp_path / "env").mkdir()
    with_router = make_env_python(tmp_path / "env", VERSION)  # the tests' venv has sglang-router
    code, out, err = cli("render", "systemd", "qwen3-30b-a3b-nvfp4-x8", "--python", with_router)
    assert code == 0 and "ExecStart=" in out, err


def test_render_systemd_refuses_an_environment_missing_a_package(cli, no_numpy):
    code, out, err = cli("render", "systemd", "standin", "--profile-dir", PROFILES, "--python", no_numpy)
    assert (code, out) == (ExitCode.ERROR, "") and "no module named 'numpy'" in said(err)


def test_render_systemd_says_plainly_what_it_could_not_check(cli):
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--python", "/nonexistent/env/bin/python")
    assert code == 0 and "ExecStart=" in out
    assert "the serving environment was not checked: --python /nonexistent/env/bin/python is not on this machine" in (
        " ".join(err.split())
    )
    code, out, err = cli("render", "systemd", "glm5-nvfp4")  # this sm120kit's python, which has no sglang
    assert code == 0 and "has no sglang" in " ".join(err.split()) and "--python" in said(err)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("site") / "site-packages"
    install(path, VERSION, flashinfer=False)
    return path


@pytest.mark.parametrize("port", ["99999", "0", "-1", "70000"])
def test_a_metrics_port_out_of_range_is_refused_in_a_dry_run(cli, site, port):
    code, out, err = cli(
        "serve", "standin", "--profile-dir", PROFILES, "--site", site, "--dry-run", f"--metrics-port={port}"
    )
    assert (code, out) == (ExitCode.ERROR, "") and "--metrics-port" in said(err) and "65535" in said(err), err


def test_an_unknown_allow_missing_id_is_refused_in_a_dry_run(cli, site):
    code, out, err = cli(
        "serve", "standin", "--profile-dir", PROFILES, "--site", site, "--dry-run", "--allow-missing", "nosuch"
    )
    assert (code, out) == (ExitCode.ERROR, "") and "--allow-missing: unknown patch id 'nosuch'" in said(err), err


@pytest.mark.parametrize("command", [["profile", "check"], ["serve", "--dry-run"]])
def test_a_profile_naming_an_unknown_patch_is_refused(cli, site, command):
    argv = [*command[:1], *command[1:], "glm5-nvfp4", "--site", site, "--set", "patches=['nosuch']"]
    code, out, err = cli(*argv)
    assert (
        (code, out) == (ExitCode.ERROR, "")
        and "profile glm5-nvfp4" in said(err)
        and "unknown patch id 'nosuch'" in said(err)
    )
    assert "sm120kit patches" in said(err)


def check_stale(kill_stale: bool = False):
    inputs = CheckInputs(Snapshot(Path("/"), {}, dict), processes=procs, runs=list, kill_stale=kill_stale)
    return serving.stale_processes(inputs)


def test_a_router_under_a_live_supervisor_is_not_stale_and_is_when_that_is_gone():
    """An `sglang::router` in a session of its own under a process that is sm120kit (its
    command line: as `sm120kit` runs), recorded in no state directory here. Before: FAIL,
    "orphaned: its launcher is gone", and --kill-stale stopped it."""
    router = "import setproctitle, time; setproctitle.setproctitle('sglang::router'); time.sleep(60)"
    spawn = (  # its sys.executable is found by its argv[0], `sm120kit`: the interpreter is named
        f"import subprocess, sys; p = subprocess.Popen([{sys.executable!r}, '-c', {router!r}], "
        "start_new_session=True); print(p.pid, flush=True); sys.stdin.read()"
    )
    supervisor = subprocess.Popen(
        ["sm120kit", "-c", spawn], executable=sys.executable, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pid = int(supervisor.stdout.readline())
    try:
        while psutil.Process(pid).cmdline()[:1] != ["sglang::router"]:
            time.sleep(0.02)
        for kill_stale in (False, True):
            check = check_stale(kill_stale)
            assert check.status is Status.INFO, check.detail
            assert f"served by a live sm120kit, left alone: pid {pid} 'sglang::router'" in check.detail
            assert f"supervised by sm120kit pid {supervisor.pid}" in check.detail and psutil.pid_exists(pid)
        supervisor.stdin.close()  # the supervisor goes; the router is re-parented to the test run (a subreaper)
        supervisor.wait(10)
        deadline = time.monotonic() + 10
        while psutil.Process(pid).ppid() == supervisor.pid and time.monotonic() < deadline:
            time.sleep(0.02)
        check = check_stale()
        assert check.status is Status.FAIL and f"pid {pid} 'sglang::router'" in check.detail
        assert "orphaned: its launcher is gone" in check.detail
    finally:
        supervisor.kill()
        supervisor.wait()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_a_live_fleets_router_is_not_stale_to_a_serve_from_another_state_directory(tmp_path):
    """The issue's case: a fleet served (its own state directory, as another unit's or
    another user's), then `serve --check` of another profile on the node."""
    from support.standin import Fleet

    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", VERSION)
    fleet = Fleet(tmp_path / "fleet", python, {})
    try:
        fleet.start()
        fleet.wait("ready", timeout=90)
        router = fleet.member_state("router")["server_pid"]
        assert psutil.Process(router).cmdline()[0].startswith("sglang::router")
        other = Served(tmp_path / "other", python, {}, [], ["--check"], {})  # its own SM120KIT_STATE_DIR
        for extra in ([], ["--kill-stale"]):
            done = subprocess.run([*other.argv, *extra], capture_output=True, text=True, env=other.env, timeout=60)
            out = done.stdout + done.stderr
            assert done.returncode == 0, out
            assert "FAIL stale processes" not in out and f"pid {router} 'sglang::router" in said(out)
            assert psutil.Process(router).is_running() and fleet.proc.poll() is None
        assert fleet.signal(signal.SIGTERM, timeout=60) == 0, fleet.output
    finally:
        fleet.cleanup()
        for p in psutil.process_iter():
            try:
                if str(fleet.dir) in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass


# A scheduler whose launcher is gone, titled as sglang titles it (setproctitle).
FOREIGN = "import setproctitle, time; setproctitle.setproctitle('sglang::scheduler_TP0'); time.sleep(600)"


def foreign_orphan() -> int:
    """An orphaned `sglang::scheduler_TP0` outside the scope of a test run started later:
    started through a parent that exits at once."""
    spawn = (
        f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {FOREIGN!r}], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    pid = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout)
    proc = psutil.Process(pid)
    for _ in range(100):  # until its title is set
        if proc.cmdline()[:1] == ["sglang::scheduler_TP0"]:
            return pid
        psutil.wait_procs([proc], timeout=0.05)
    raise AssertionError("the foreign scheduler did not title itself")


def test_the_preflight_tests_give_the_same_results_with_a_foreign_sglang_process_alive(tmp_path: Path, monkeypatch):
    """Operators run the suite on GPU nodes that are serving: an unrelated sglang process
    changes no result. conftest.py makes the test run a child subreaper and the scope of
    every process scan (SM120KIT_PROCESS_SCOPE); the host's processes are outside it."""
    pid = foreign_orphan()
    try:
        monkeypatch.delenv(procs.SCOPE, raising=False)  # as on a node: the scan sees the whole machine
        assert pid in {p.pid for p in procs.scan(sglang=True)}
        args = [
            "-q",
            "-p",
            "no:cacheprovider",
            # in this process, not pyproject's four more workers on a machine this run already loads
            "-n",
            "0",
            "--basetemp",
            str(tmp_path / "t"),
            "-m",
            "preflight",
            "tests/serve",
        ]
        code, out = run_pytest(args, ROOT, timeout=400)
        summary = [line for line in out.splitlines() if re.search(r" in [0-9.]+s", line)][-1:]
        assert code == 0 and summary, out[-4000:]
        assert " passed" in summary[0] and "failed" not in summary[0] and "error" not in summary[0], out[-4000:]
        assert psutil.Process(pid).cmdline()[:1] == ["sglang::scheduler_TP0"]  # --kill-stale left it alone
    finally:
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # adopted by this test run (a subreaper): reap it


def run_check(s: Served, *extra: str) -> tuple[int, str]:
    argv = [*s.argv, "--check", "--wide", *extra]  # --wide: each check on one line, as the assertions read it
    proc = subprocess.run(argv, capture_output=True, text=True, env=s.env, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr
