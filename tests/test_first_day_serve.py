"""Issue 25, serve on a first day (items 5, 7, 11, the first parts of 31, and 23), as a new
operator meets it:

- 5: serve's preflight reads what `python -m sglang.launch_server` imports (the real
  sglang 0.5.23 sources, in the target's own interpreter) and refuses, naming the package,
  where the environment lacks one; a server that dies of a missing module all the same is
  not restarted: serve exits 2, which a unit's RestartPreventExitStatus=2 does not retry.
- 7: `render systemd` runs `serve --dry-run`'s checks against the unit's interpreter.
- 11, 31: `--metrics-port`, `--allow-missing` and a profile's `patches` are checked in a
  dry run and by `profile check` as a start checks them (exit 2).
- 23: an sglang process whose parent is a live sm120kit supervisor is never stale: a
  fleet's router, seen from another state directory.

The environments are real: venvs made here (`python -m venv`) holding real sglang release
files; where a package sglang imports must be there, an empty package stands in for it
(TEST FIXTURE: nothing imports it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import install
from standin import PROFILES, STANDIN, Served, free_port, make_env_python
from test_supervisor_machine import OOM, Script, World, supervise

from sm120kit import wheels
from sm120kit.exit_codes import ExitCode
from sm120kit.node.check import Status
from sm120kit.node.checks import imports, serving
from sm120kit.node.registry import CheckInputs
from sm120kit.node.snapshot import Snapshot
from sm120kit.serve import procs
from sm120kit.serve.diagnose import diagnose

VERSION = "0.5.23"
SERVER = ["sglang.launch_server", "?sglang.srt.entrypoints.http_server"]  # what the check reads
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/env/lib/python3.11/site-packages/sglang/srt/utils/common.py", line 25, in <module>\n'
    "    import numpy as np\n"
    "ModuleNotFoundError: No module named 'numpy'\n"
)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would point a venv's python at other packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | extra


def said(text: str) -> str:
    """Text as a reader takes it: the lines a terminal's width wrapped joined again."""
    return " ".join(text.split())


def make_venv(root: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new, empty virtual environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    [site] = root.glob("lib/python*/site-packages")
    return root / "bin" / "python", site


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


# -- 5: the preflight reads what the server imports ------------------------------------------


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
    code, out, err = cli(*argv, "--dry-run")
    assert (code, out) == (ExitCode.ERROR, "") and "no module named 'numpy'" in said(err) and "Traceback" not in err


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


def test_a_module_missing_at_the_start_is_diagnosed_as_an_incomplete_environment():
    [found] = diagnose("[2026-11-29 10:00:00] starting\n" + TRACEBACK)
    assert found.id == "missing-module" and not found.restart and "no module named 'numpy'" in found.title
    [found] = diagnose("ImportError: libcudart.so.13: cannot open shared object file: No such file or directory\n")
    assert found.id == "import-error" and not found.restart
    # a module named inside a logged line is not a traceback's end
    assert diagnose("[2026-11-29 10:00:00 TP0] WARNING: ModuleNotFoundError: No module named 'vllm'\n") == []


def test_the_supervisor_stops_with_exit_2_after_one_such_start(tmp_path):
    world = World(Script(log=((0.1, TRACEBACK),), dies_at=0.5, wait_status=1 << 8))
    done = supervise(tmp_path, world, max_restarts=3)
    assert done.code == ExitCode.ERROR
    assert done.record.kinds() == ["started", "died", "gave_up"] and len(world.servers) == 1
    [gave_up] = done.record.read("gave_up")
    assert gave_up["restart"] is False and "no module named 'numpy'" in gave_up["reason"]
    assert "not restarting fake: the serving environment is incomplete" in done.out
    assert done.record.state_json()["status"] == "gave-up"


@pytest.mark.parametrize(
    "script",
    [
        Script(log=((4.9, TRACEBACK),), dies_at=5.0, wait_status=1 << 8),  # it served first: restarted
        Script(log=((0.1, TRACEBACK), (0.4, OOM)), dies_at=0.5),  # out of memory as well: restarted
    ],
)
def test_other_deaths_are_restarted_as_before(tmp_path, script):
    world = World(script, Script())
    world.signal(12.0)
    done = supervise(tmp_path, world)
    kinds = done.record.kinds()
    assert done.code == ExitCode.OK and "restarting" in kinds and kinds.count("started") == 2, kinds


def test_a_real_start_that_dies_of_a_missing_module_is_not_restarted(tmp_path):
    """The static read cannot see an import inside a function: the server dies at its
    start. Before: restarted up to health.max_restarts, exit 1 (systemd restarts serve on).
    Now: one start, exit 2."""
    python, site = make_venv(tmp_path / "env")
    install(site, VERSION, flashinfer=False)
    (site / "sglang" / "launch_server.py").write_text(
        "# TEST FIXTURE: a server that imports, when it starts, a package the environment lacks\n"
        "def main():\n    import sm120kit_fixture_absent_package  # noqa: F401\n\n\nmain()\n"
    )
    s = Served(tmp_path / "run", python, {}, ["health.max_restarts=2"], [], {})
    code, out = s.run()
    assert code == ExitCode.ERROR, out
    assert len(s.events("started")) == 1 and s.events("restarting") == []
    assert [d["id"] for d in s.events("died")[0]["diagnoses"]] == ["missing-module"]
    assert "not restarting standin: the serving environment is incomplete" in said(out)


def test_a_fleet_whose_every_replica_lacks_a_module_exits_2(tmp_path):
    """Each replica's scheduler dies loading, for want of a kernel package (imported where
    no static read looks): each member supervisor stops with 2 after one start, and so
    does the fleet (before: each restarted up to health.max_restarts, the fleet exit 1)."""
    from test_fleet import Fleet

    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", VERSION)
    fleet = Fleet(tmp_path / "fleet", python, {"die_loading": "ModuleNotFoundError: No module named 'sgl_kernel'"})
    try:
        code, out = fleet.run(timeout=120)
        assert code == ExitCode.ERROR, out
        exited = {e["member"]: e["exit_code"] for e in fleet.events("member_exited")}
        assert exited == {"replica-0": 2, "replica-1": 2, "replica-2": 2}, exited
        for name in exited:
            member = [json.loads(line) for line in (fleet.dir / name / "events.jsonl").read_text().splitlines()]
            assert [e["event"] for e in member].count("started") == 1
        assert "lacks a module (a restart cannot mend that)" in said(out)
    finally:
        fleet.cleanup()


# -- 7: render systemd checks the environment the unit runs ------------------------------------


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


# -- 11 and 31: a dry run checks the options as a start does -------------------------------------


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


# -- 23: a process whose supervisor lives is never stale ----------------------------------------


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
    from test_fleet import Fleet

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
