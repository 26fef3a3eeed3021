"""`sm120kit render systemd`: every shipped profile renders a unit that the real
`systemd-analyze verify` (Debian's systemd package) takes without a word; the unit runs
`sm120kit serve` with the very profile that was rendered, after the patch step, which
exits 0 on a real sglang release once the patches are in place; its budgets come from the
profile; its limits are the ones doctor's check passes; the API key never enters it.

The golden units are regenerated only on purpose, with the commands in
tests/golden/deploy/systemd/README.md."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.paths import ROOT
from support.standin import make_env_python

from sm120kit.cli import build_parser
from sm120kit.cli.profiles import load_for
from sm120kit.deploy import START_BURST, give_up_floor_s
from sm120kit.node.check import Status
from sm120kit.node.checks.system import limits
from sm120kit.profiles.loader import load_profile
from sm120kit.profiles.render import unservable

GOLDEN = ROOT / "tests" / "golden" / "deploy" / "systemd"
SM120KIT = Path(sys.executable).parent / "sm120kit"  # a real executable: verify checks ExecStart's
SERVABLE = sorted(
    p.stem for p in (ROOT / "profiles").glob("*.toml") if not unservable(load_profile(str(p)))
)  # every shipped profile but the node profile sm120-base
KEY = "s3cr3t-key-do-not-leak"
# The goldens: the file and the arguments of `sm120kit render systemd` that write it (README).
GOLDENS = {
    "sm120kit-glm5-nvfp4.service": ["glm5-nvfp4", "--unit-user", "sglang", "--sm120kit", "/opt/venv/bin/sm120kit"],
    "sm120kit-qwen3-30b-a3b-nvfp4-x8.service": [
        "qwen3-30b-a3b-nvfp4-x8",
        "--user",
        "--set",
        "server.api_key_env=SGLANG_API_KEY",
        "--python",
        "/opt/venv/bin/python",
        "--sm120kit",
        "/opt/venv/bin/sm120kit",
    ],
}


@pytest.fixture(autouse=True)
def no_user_paths(monkeypatch):
    """Only the shipped profiles and patches, whatever the environment running the tests holds."""
    monkeypatch.delenv("SM120KIT_PROFILE_PATH", raising=False)
    monkeypatch.delenv("SM120KIT_PATCH_PATH", raising=False)


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed: it comes with Debian's systemd package "
            "(apt-get install -y --no-install-recommends systemd); the units are proven with it"
        )
    return found


def verify(unit: Path, user: bool = False) -> subprocess.CompletedProcess:
    """The real `systemd-analyze verify`. It exits 0 over a key it cannot parse (it says
    "ignoring"): a unit passes when it exits 0 and says nothing. A --user verify needs a
    runtime directory of the user's manager."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    argv = [systemd_analyze()]
    if user:
        runtime = unit.parent / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        argv.append("--user")
    return subprocess.run([*argv, "verify", str(unit)], capture_output=True, text=True, env=env, timeout=60)


def render(cli, *argv) -> str:
    code, out, err = cli("render", "systemd", *argv)
    assert code == 0, err
    return out


def unit_at(tmp_path: Path, text: str) -> Path:
    name = re.search(r"^# (\S+\.service):", text, re.M).group(1)
    path = tmp_path / name
    path.write_text(text)
    return path


def settings(text: str) -> dict[str, dict[str, list[str]]]:
    """The unit as systemd reads it: comments dropped, backslash lines joined; every value
    of a key, by section."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(" ".join(value.split()))
    return sections


def one(unit: dict, section: str, key: str) -> str:
    [value] = unit[section][key]
    return value


def words(command: str) -> list[str]:
    """A unit's command line as systemd splits it: quotes, then $$ and %% unescaped."""
    return [w.replace("$$", "$").replace("%%", "%") for w in shlex.split(command)]


# -- the real systemd-analyze ------------------------------------------------------------


def test_systemd_analyze_is_there_and_is_debians():
    version = subprocess.run([systemd_analyze(), "--version"], capture_output=True, text=True, check=True).stdout
    assert re.match(r"systemd \d+ ", version), version


@pytest.mark.parametrize("name", SERVABLE)
def test_every_shipped_profile_renders_a_unit_that_verify_takes(name, tmp_path, cli):
    assert "sm120-base" not in SERVABLE and "glm5-nvfp4" in SERVABLE
    unit = unit_at(tmp_path, render(cli, name, "--unit-user", "sglang", "--sm120kit", SM120KIT))
    done = verify(unit)
    assert (done.returncode, done.stdout + done.stderr) == (0, ""), unit.read_text()


@pytest.mark.parametrize("name", SERVABLE)
def test_every_shipped_profile_renders_a_user_unit_that_verify_takes(name, tmp_path, cli):
    text = render(cli, name, "--user", "--set", "server.api_key_env=SGLANG_API_KEY", "--sm120kit", SM120KIT)
    unit = unit_at(tmp_path, text)
    done = verify(unit, user=True)
    assert (done.returncode, done.stdout + done.stderr) == (0, ""), text


def test_verify_is_a_real_check(tmp_path, cli):
    """The harness catches what systemd rejects: a binary that is not there (exit 1) and a
    key it cannot parse (exit 0, said on stderr)."""
    text = render(cli, "glm5-nvfp4", "--sm120kit", SM120KIT)
    missing = verify(unit_at(tmp_path, text.replace(str(SM120KIT), "/nonexistent/sm120kit")))
    assert missing.returncode != 0 and "/nonexistent/sm120kit" in missing.stderr
    bad = verify(unit_at(tmp_path, text.replace("KillMode=mixed", "KillMode=mixed\nTimeoutStopSec=soon")))
    assert bad.returncode == 0 and "soon" in bad.stderr


def test_odd_words_are_escaped_and_verify_takes_them(tmp_path, cli):
    odd = "a name with $HOME and %h in it"
    text = render(cli, "glm5-nvfp4", "--set", f"model.served_name={odd}", "--sm120kit", SM120KIT)
    done = verify(unit_at(tmp_path, text))
    assert (done.returncode, done.stderr) == (0, "")
    serve = words(one(settings(text), "Service", "ExecStart"))
    assert serve[serve.index("--set") + 1] == f"model.served_name={odd}"


# -- the goldens --------------------------------------------------------------------------


def test_description_paths_and_environment_are_written_as_systemd_reads_them(tmp_path, cli):
    """A description with % and a newline, relative paths with spaces, $ and %: one line, no
    specifier, no directive of its own; absolute paths; Environment= where $ means nothing."""
    text = render(
        cli,
        "qwen3-30b-a3b-nvfp4-1gpu",
        "--set",
        'description="""Qwen 100%z fast\nUser=root"""',
        "--set",
        "server.api_key_env=MY_KEY",
        "--env-file",
        "rel dir/k%h.env",
        "--state-dir",
        "st $HOME/100%",
        "--sm120kit",
        SM120KIT,
    )
    done = verify(unit_at(tmp_path, text))
    assert (done.returncode, done.stderr) == (0, "")
    unit = settings(text)
    assert "User" not in unit["Service"] and one(unit, "Unit", "Description").endswith("Qwen 100%%z fast User=root")
    assert one(unit, "Service", "EnvironmentFile") == f"{Path.cwd()}/rel dir/k%%h.env"
    assert one(unit, "Service", "Environment") == f'"SM120KIT_STATE_DIR={Path.cwd()}/st $HOME/100%%"'


@pytest.mark.parametrize("file", GOLDENS)
def test_golden_unit(file, cli):
    golden = GOLDEN / file
    assert render(cli, *GOLDENS[file]) == golden.read_text(), f"regenerate {golden} only for a deliberate change"


def test_the_golden_readme_names_each_golden_command():
    readme = (GOLDEN / "README.md").read_text()
    for file, argv in GOLDENS.items():
        assert f"sm120kit render systemd {shlex.join(argv)} > tests/golden/deploy/systemd/{file}" in readme


# -- what the unit runs -------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVABLE)
def test_the_unit_serves_the_profile_it_was_rendered_from(name, cli):
    """ExecStart, parsed as `sm120kit` parses its argv, loads the very profile (--set and
    all): the sglang argv is the one `serve --dry-run` prints, by construction."""
    sets = ["--set", "engine.max_running_requests=7", "--set", "health.stop_timeout_s=12.5"]
    unit = settings(render(cli, name, *sets, "--python", "/srv/env/bin/python", "--sm120kit", "/x/sm120kit"))
    serve = words(one(unit, "Service", "ExecStart"))
    assert serve[:3] == ["/x/sm120kit", "serve", name]
    args = build_parser().parse_args(serve[1:])
    assert args.func.__name__ == "cmd_serve" and args.python == "/srv/env/bin/python"
    args.site = None
    args.python = sys.executable  # the target is not this test's business; the profile is
    profile, _ = load_for(args)
    assert profile == load_profile(name, None, ["engine.max_running_requests=7", "health.stop_timeout_s=12.5"])


def test_the_patch_step_is_the_profiles_patches_and_exits_0_once_they_are_in_place(tmp_path, cli):
    """ExecStartPre as systemd would run it, twice, on a real sglang release: it applies
    what is missing, then proves it (exit 0 both times), and `patch --check` finds nothing."""
    env = tmp_path / "env"
    env.mkdir()
    python = make_env_python(env, "0.5.10")
    unit = settings(render(cli, "glm5-nvfp4", "--python", python, "--sm120kit", SM120KIT))
    pre = words(one(unit, "Service", "ExecStartPre"))
    profile = load_profile("glm5-nvfp4")
    assert pre[:3] == [str(SM120KIT), "patch", "--verify"]
    assert [pre[i + 1] for i, w in enumerate(pre) if w == "--only"] == profile.patches
    assert pre[-2:] == ["--python", str(python)]
    for _ in range(2):
        done = subprocess.run(pre, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    check = [str(SM120KIT), "patch", "--check", "--python", str(python)]
    check += [w for p in profile.patches for w in ("--only", p)]
    assert subprocess.run(check, capture_output=True, text=True, timeout=300).returncode == 0


def test_a_profile_without_patches_has_no_patch_step(tmp_path, cli):
    text = render(cli, "glm5-nvfp4", "--set", "patches=[]", "--sm120kit", SM120KIT)
    assert "ExecStartPre" not in settings(text)["Service"]
    assert "needs no patches" in text
    assert verify(unit_at(tmp_path, text)).returncode == 0


# -- the budgets, the limits, the key -------------------------------------------------------


@pytest.mark.parametrize(("name", "groups"), [("glm5-nvfp4", 1), ("qwen3-30b-a3b-nvfp4-x8", 2)])
def test_the_budgets_come_from_the_profile(name, groups, cli):
    unit = settings(render(cli, name, "--set", "health.stop_timeout_s=100", "--set", "health.max_restarts=4"))
    service = unit["Service"]
    profile = load_profile(name, None, ["health.max_restarts=4"])
    assert service["Type"] == ["exec"] and service["KillMode"] == ["mixed"]
    assert service["TimeoutStopSec"] == [str(groups * (100 + 45))]  # the README's margin, per group
    assert service["Restart"] == ["on-failure"]
    restart_s = profile.health.backoff_max_s
    assert service["RestartSec"] == [f"{restart_s:g}"]
    # systemd's limit is over whole crash loops of serve: after START_BURST of the fastest ones, the
    # next start (one more loop later) still falls inside the window, and is refused
    window = float(one(unit, "Unit", "StartLimitIntervalSec"))
    assert one(unit, "Unit", "StartLimitBurst") == str(START_BURST)
    assert window >= (START_BURST + 1) * (give_up_floor_s(profile) + restart_s)
    assert service["RestartPreventExitStatus"] == ["2"]  # refused (bad input, preflight): a restart mends nothing
    assert give_up_floor_s(profile) == 5 + 10 + 20 + 40  # 4 restarts, backoff doubling from 5 s
    # the start is the patch step and the exec; the load is serve's
    assert 0 < int(one(unit, "Service", "TimeoutStartSec")) < profile.health.startup_timeout_s


def test_the_limits_are_what_doctor_wants(cli):
    unit = settings(render(cli, "glm5-nvfp4"))
    nofile, memlock = one(unit, "Service", "LimitNOFILE"), one(unit, "Service", "LimitMEMLOCK")
    assert memlock == "infinity"
    proc_limits = (
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        f"Max open files            {nofile}                {nofile}                files     \n"
        "Max locked memory         unlimited            unlimited            bytes     \n"
    )
    inputs = SimpleNamespace(node=SimpleNamespace(text=lambda path: proc_limits))
    assert limits(inputs).status is Status.OK


def test_the_api_key_comes_from_an_environment_file_never_the_unit(monkeypatch, cli):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    text = render(cli, "glm5-nvfp4", "--set", "server.api_key_env=SGLANG_API_KEY")
    assert KEY not in text
    assert settings(text)["Service"]["EnvironmentFile"] == ["/etc/sm120kit/glm5-nvfp4.env"]
    assert "# SGLANG_API_KEY=..." in text
    user = render(cli, "glm5-nvfp4", "--set", "server.api_key_env=SGLANG_API_KEY", "--user")
    assert settings(user)["Service"]["EnvironmentFile"] == ["%h/.config/sm120kit/glm5-nvfp4.env"]
    given = render(cli, "glm5-nvfp4", "--set", "server.api_key_env=K", "--env-file", "/run/keys/glm5.env")
    assert settings(given)["Service"]["EnvironmentFile"] == ["/run/keys/glm5.env"]
    assert "EnvironmentFile" not in settings(render(cli, "glm5-nvfp4"))["Service"]  # no key, no file


def test_system_and_user_units(cli):
    system = settings(render(cli, "glm5-nvfp4", "--unit-user", "sglang", "--state-dir", "/var/lib/sm120kit"))
    assert system["Service"]["User"] == ["sglang"]
    assert system["Service"]["Environment"] == ["SM120KIT_STATE_DIR=/var/lib/sm120kit"]
    assert system["Install"]["WantedBy"] == ["multi-user.target"]
    user = settings(render(cli, "glm5-nvfp4", "--user"))
    assert "User" not in user["Service"] and user["Install"]["WantedBy"] == ["default.target"]
    assert user["Service"]["StandardOutput"] == ["journal"]  # serve echoes the server's log there
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--user", "--unit-user", "sglang")
    assert (code, out) == (2, "") and "--unit-user" in err


def test_the_default_executable_is_this_installs_absolute_path(cli):
    serve = words(one(settings(render(cli, "glm5-nvfp4")), "Service", "ExecStart"))
    assert os.path.isabs(serve[0]) and os.access(serve[0], os.X_OK)
    assert serve[0] == str(SM120KIT) or serve[1:3] == ["-m", "sm120kit"]


def test_json_is_the_same_unit(cli):
    code, doc = cli.json("render", "systemd", "glm5-nvfp4")
    assert code == 0 and doc["unit"] == "sm120kit-glm5-nvfp4.service"
    assert doc["text"] == render(cli, "glm5-nvfp4")


# -- multi-node and bad input ---------------------------------------------------------------

TWO_NODES = ["--set", "parallel.nnodes=2", "--set", "parallel.tp=16"]


def test_a_multi_node_profile_renders_one_unit_per_rank(tmp_path, cli):
    text = render(cli, "glm5-nvfp4", *TWO_NODES, "--set", "parallel.dist_init_addr=10.0.0.1:5000", "--node-rank", "1")
    assert "sm120kit-glm5-nvfp4-rank1.service" in text
    serve = words(one(settings(text), "Service", "ExecStart"))
    assert serve[-2:] == ["--node-rank", "1"]
    done = verify(unit_at(tmp_path, text.replace(serve[0], str(SM120KIT))))
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["sm120-base"], "cannot serve"),
        (["glm5-nvfp4", *TWO_NODES, "--node-rank", "0"], "rendezvous port"),
        (["glm5-nvfp4", *TWO_NODES, "--set", "parallel.dist_init_addr=10.0.0.1", "--node-rank", "0"], "rendezvous"),
        (["glm5-nvfp4", *TWO_NODES, "--set", "parallel.dist_init_addr=10.0.0.1:5000"], "--node-rank"),
        (["glm5-nvfp4", "--node-rank", "1"], "--node-rank is for multi-node profiles"),
        (["glm5-nvfp4", "--set", "patches=['no-such-patch']"], "no-such-patch"),
        (["glm5-nvfp4", "--image", "img"], "--image"),
        (["glm5-nvfp4", "--site", "/tmp"], "--site"),
        (["no-such-profile"], "unknown profile"),
    ],
)
def test_bad_input_is_exit_2_and_prints_nothing(argv, said, cli):
    code, out, err = cli("render", "systemd", *argv)
    assert (code, out) == (2, "")
    assert said in err and "Traceback" not in err


def test_an_unknown_target_is_exit_2(cli):
    with pytest.raises(SystemExit) as exc:
        cli("render", "upstart", "glm5-nvfp4")
    assert exc.value.code == 2
