"""`sm120kit render docker`: a compose file, headed by the `docker run` line that says the
same, for every shipped profile; the compose file validates against the compose
specification's JSON Schema (tests/fixtures/compose/, its version named there); the
container runs the patch step, then `exec sm120kit serve` with the very profile that was
rendered; the API key passes by name, never by value.

The golden file is regenerated only on purpose, with the command in
tests/golden/deploy/docker/README.md."""

from __future__ import annotations

import json
import shlex
import sys

import jsonschema
import pytest
import yaml
from support.paths import ROOT

from sm120kit.cli import build_parser
from sm120kit.cli.profiles import load_for
from sm120kit.node.checks.system import NOFILE_GOOD, SHM_GOOD
from sm120kit.profiles.loader import load_profile
from sm120kit.profiles.render import unservable

SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "compose" / "compose-spec.json").read_text())
GOLDEN = ROOT / "tests" / "golden" / "deploy" / "docker"
IMAGE = "registry.example/sglang-sm120kit:0.5.23"
SERVABLE = sorted(p.stem for p in (ROOT / "profiles").glob("*.toml") if not unservable(load_profile(str(p))))
KEY = "s3cr3t-key-do-not-leak"
GOLDENS = {"sm120kit-glm5-nvfp4.compose.yaml": ["glm5-nvfp4", "--image", IMAGE]}


@pytest.fixture(autouse=True)
def no_user_paths(monkeypatch):
    monkeypatch.delenv("SM120KIT_PROFILE_PATH", raising=False)
    monkeypatch.delenv("SM120KIT_PATCH_PATH", raising=False)


def render(cli, *argv) -> str:
    code, out, err = cli("render", "docker", *argv)
    assert code == 0, err
    return out


def documents(cli, *argv) -> tuple[list[str], dict]:
    """(the run line's words, the compose document) from --json, checked against the text."""
    code, doc = cli.json("render", "docker", *argv)
    assert code == 0
    assert yaml.safe_load(render(cli, *argv)) == doc["compose"]  # the text is the same document
    return doc["run"], doc["compose"]


def valid(compose: dict) -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(compose)


def the_service(compose: dict) -> dict:
    [service] = compose["services"].values()
    return service


def run_options(run: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """docker run's options (every value of each) and what follows the image."""
    assert run[:2] == ["docker", "run"]
    options: dict[str, list[str]] = {}
    i = 2
    while run[i].startswith("--"):
        flag = run[i]
        if flag == "--detach":
            options[flag] = [""]
            i += 1
            continue
        options.setdefault(flag, []).append(run[i + 1])
        i += 2
    return options, run[i:]


def script_commands(script: str) -> list[list[str]]:
    """The container's `sh -c` script: its commands, `exec` dropped."""
    commands = [shlex.split(part) for part in script.split(" && ")]
    return [c[1:] if c[0] == "exec" else c for c in commands]


# -- the compose specification's schema ---------------------------------------------------


def test_the_fixture_is_the_compose_spec_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["title"] == "Compose Specification"
    readme = (ROOT / "tests" / "fixtures" / "compose" / "README.md").read_text()
    assert "a08f8d51631b7127ddac3d2c65537db429d0f1d0" in readme and "compose-spec/compose-spec" in readme


def test_the_schema_is_a_real_check():
    with pytest.raises(jsonschema.ValidationError):
        valid({"services": {"x": {"image": "i", "ulimits": {"nofile": {"soft": "many"}}}}})
    with pytest.raises(jsonschema.ValidationError):
        valid({"services": {"x": {"image": "i", "network-mode": "host"}}})


@pytest.mark.parametrize("name", SERVABLE)
def test_every_shipped_profile_renders_a_compose_file_the_schema_takes(name, cli):
    _, compose = documents(cli, name, "--image", IMAGE)
    valid(compose)
    _, keyed = documents(cli, name, "--image", IMAGE, "--set", "server.api_key_env=SGLANG_API_KEY")
    valid(keyed)
    _, files = documents(cli, name, "--image", IMAGE, "--env-file", "/etc/sm120kit/k.env", "--state-dir", "/srv/s")
    valid(files)


# -- the golden -------------------------------------------------------------------------------


@pytest.mark.parametrize("file", GOLDENS)
def test_golden_compose_file(file, cli):
    golden = GOLDEN / file
    assert render(cli, *GOLDENS[file]) == golden.read_text(), f"regenerate {golden} only for a deliberate change"


def test_the_golden_readme_names_each_golden_command():
    readme = (GOLDEN / "README.md").read_text()
    for file, argv in GOLDENS.items():
        assert f"sm120kit render docker {shlex.join(argv)} > tests/golden/deploy/docker/{file}" in readme


# -- what the container runs ----------------------------------------------------------------


@pytest.mark.parametrize("name", SERVABLE)
def test_the_container_patches_then_serves_the_profile_it_was_rendered_from(name, cli):
    sets = ["--set", "engine.max_running_requests=7"]
    run, compose = documents(cli, name, "--image", IMAGE, *sets)
    options, tail = run_options(run)
    assert options["--entrypoint"] == ["sh"] and tail[:2] == [the_service(compose)["image"], "-c"]  # the built one
    [script] = tail[2:]
    assert the_service(compose)["entrypoint"] == ["sh", "-c", script.replace("$", "$$")]
    *patch, serve = script_commands(script)
    profile = load_profile(name, None, ["engine.max_running_requests=7"])
    if profile.patches:
        [patch] = patch
        assert patch[:3] == ["sm120kit", "patch", "--verify"]
        assert [patch[i + 1] for i, w in enumerate(patch) if w == "--only"] == profile.patches
    assert serve[:3] == ["sm120kit", "serve", name]
    args = build_parser().parse_args(serve[1:])
    assert args.func.__name__ == "cmd_serve"
    args.python, args.site = sys.executable, None
    assert load_for(args)[0] == profile


def test_run_line_and_compose_file_say_the_same(cli):
    run, compose = documents(cli, "glm5-nvfp4", "--image", IMAGE, "--set", "server.api_key_env=SGLANG_API_KEY")
    options, _ = run_options(run)
    service = the_service(compose)
    profile = load_profile("glm5-nvfp4")
    assert options["--gpus"] == ["8"] == [str(profile.node.gpus)]
    assert service["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 8, "capabilities": ["gpu"]}
    ]
    assert options["--network"] == ["host"] and service["network_mode"] == "host"
    assert "--publish" not in options and "-p" not in run and "ports" not in service
    assert options["--shm-size"] == [service["shm_size"]] == ["32g"]
    assert SHM_GOOD <= 32 << 30  # doctor's /dev/shm check: ok
    assert options["--ulimit"] == [f"nofile={NOFILE_GOOD}:{NOFILE_GOOD}", "memlock=-1:-1"]
    assert service["ulimits"] == {
        "nofile": {"soft": NOFILE_GOOD, "hard": NOFILE_GOOD},
        "memlock": {"soft": -1, "hard": -1},
    }
    assert options["--stop-timeout"] == ["105"] and service["stop_grace_period"] == "105s"  # stop_timeout_s + 45
    assert options["--restart"] == [service["restart"]] == ["on-failure:3"]
    assert [v.replace("$HOME", "${HOME}") for v in options["--volume"]] == service["volumes"]
    assert options["--env"] == service["environment"]
    assert "$HOME/.cache/huggingface:/root/.cache/huggingface" in options["--volume"]
    assert "HF_HOME=/root/.cache/huggingface" in options["--env"]
    assert compose["volumes"] == {"sm120kit-state": {}, "sm120kit-jit": {}}


def test_the_api_key_passes_by_name_never_by_value(monkeypatch, cli):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    argv = ["glm5-nvfp4", "--image", IMAGE, "--set", "server.api_key_env=SGLANG_API_KEY"]
    text = render(cli, *argv)
    run, compose = documents(cli, *argv)
    assert KEY not in text and KEY not in json.dumps(run) and KEY not in json.dumps(compose)
    assert "SGLANG_API_KEY" in run_options(run)[0]["--env"]  # `--env NAME`: docker reads the value itself
    assert "SGLANG_API_KEY" in the_service(compose)["environment"]
    run, compose = documents(cli, *argv, "--env-file", "/etc/sm120kit/glm5.env")
    assert run_options(run)[0]["--env-file"] == ["/etc/sm120kit/glm5.env"]
    assert the_service(compose)["env_file"] == ["/etc/sm120kit/glm5.env"]
    assert "SGLANG_API_KEY" not in run_options(run)[0]["--env"]


def test_a_fleet_stops_router_then_replicas_within_its_budget(cli):
    run, compose = documents(cli, "qwen3-30b-a3b-nvfp4-x8", "--image", IMAGE)
    assert run_options(run)[0]["--stop-timeout"] == ["210"]  # two groups of stop_timeout_s + 45
    assert run_options(run)[0]["--gpus"] == ["8"]
    assert the_service(compose)["stop_grace_period"] == "210s"


def test_paths_of_the_host_are_mounted_where_the_container_reads_them(tmp_path, cli):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "local.toml").write_text('extends = "glm5-nvfp4"\n[model]\npath = "/models/GLM-5-NVFP4"\n')
    argv = ["local", "--image", IMAGE, "--profile-dir", tmp_path / "mine", "--state-dir", "/srv/sm120kit"]
    run, compose = documents(cli, *argv)
    options, tail = run_options(run)
    volumes = options["--volume"]
    assert f"{tmp_path / 'mine'}:/etc/sm120kit/profiles/0:ro" in volumes
    assert "/models/GLM-5-NVFP4:/models/GLM-5-NVFP4:ro" in volumes
    assert "/srv/sm120kit:/var/lib/sm120kit" in volumes and compose["volumes"] == {"sm120kit-jit": {}}
    serve = script_commands(tail[-1])[-1]
    assert serve[:3] == ["sm120kit", "serve", "local"]
    assert serve[serve.index("--profile-dir") + 1] == "/etc/sm120kit/profiles/0"
    run, _ = documents(cli, str(tmp_path / "mine" / "local.toml"), "--image", IMAGE)
    serve = script_commands(run[-1])[-1]
    assert serve[2] == "/etc/sm120kit/profiles/0/local.toml"
    assert f"{tmp_path / 'mine'}:/etc/sm120kit/profiles/0:ro" in run_options(run)[0]["--volume"]


def test_a_dollar_stays_a_dollar(cli):
    odd = "name $HOME 'quoted'"
    run, compose = documents(cli, "glm5-nvfp4", "--image", IMAGE, "--set", f"model.served_name={odd}")
    serve = script_commands(run[-1])[-1]
    assert serve[serve.index("--set") + 1] == f"model.served_name={odd}"
    assert the_service(compose)["entrypoint"][2] == run[-1].replace("$", "$$")  # compose reads $$ as $
    text = render(cli, "glm5-nvfp4", "--image", IMAGE, "--set", f"model.served_name={odd}")
    printed = "\n".join(line[4:] for line in text.splitlines() if line.startswith("#   "))
    printed = printed[printed.index("docker run") :]
    assert shlex.split(printed.replace("\\\n", " ")) == run  # the printed line is the same argv


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["glm5-nvfp4"], "--image"),
        (["glm5-nvfp4", "--image", IMAGE, "--user"], "--user"),
        (["glm5-nvfp4", "--image", IMAGE, "--namespace", "ns"], "--namespace"),
        (["sm120-base", "--image", IMAGE], "cannot serve"),
        (
            [
                "glm5-nvfp4",
                "--image",
                IMAGE,
                "--set",
                "parallel.nnodes=2",
                "--set",
                "parallel.tp=16",
                "--node-rank",
                "1",
            ],
            "rendezvous port",
        ),
    ],
)
def test_bad_input_is_exit_2_and_prints_nothing(argv, said, cli):
    code, out, err = cli("render", "docker", *argv)
    assert (code, out) == (2, "")
    assert said in err and "Traceback" not in err
