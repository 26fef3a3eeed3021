"""Issue 25's fit-and-finish items, as a new operator meets them: tune-moe where sm120kit's
environment has no Triton (8), tables at 80 columns that never break an id (12), `profile
show` as TOML that loads back (13), --set with its section left out (14), `try`'s diff as a
stat and its pip steps said for what they are (16), and `render docker`'s Dockerfile and JIT
cache (18)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import dockerfile
import jsonschema
import pytest
from support.paths import ROOT
from support.sites import install
from support.tree import tree_snapshot
from support.tune import KIMI_K2_CONFIG as KIMI  # the same Kimi K2 shape and release as test_tune_cli
from support.tune import MOE_MEMBERS, SERVER
from support.tune import TUNED_RELEASE as VERSION

from sm120kit import __version__, report, wheels
from sm120kit.profiles.loader import list_profiles, load_profile
from sm120kit.profiles.render import unservable
from sm120kit.tune import space
from sm120kit.tune.lookup import CONFIG_DIR_ENV

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FITS = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}
TOO_BIG = {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 8}
TOO_BIG["num_stages"] = 4
EXTRA = "pip install 'sm120kit[tune]'"
TRITON = Path(importlib.util.find_spec("triton").origin).parent  # this machine's (the test extra's), to link in


# -- 8: tune-moe without Triton in sm120kit's environment ------------------------------------


@pytest.fixture
def moe_node(tmp_path, monkeypatch):
    """A site with sglang 0.5.23's MoE code, the Kimi config.json, two candidates (one fits),
    no GPU of this machine, no Hugging Face cache."""
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(space, "search_space", lambda shape: [dict(FITS), dict(TOO_BIG)])
    monkeypatch.setattr("sm120kit.node.nvml.gpu_name_here", lambda: None)
    site = tmp_path / "site"
    wheels.install(site, "sglang", VERSION, MOE_MEMBERS)
    config = tmp_path / "kimi" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(KIMI))
    return site, config


@pytest.fixture
def no_triton_here(monkeypatch):
    """sm120kit's own interpreter without Triton: `import triton` fails, as in an
    environment where it is not installed."""
    monkeypatch.setitem(sys.modules, "triton", None)


def target_python(root: Path, with_triton: bool) -> Path:
    """A serving environment of its own (a venv): sglang 0.5.23's MoE files and, with_triton,
    this machine's Triton (linked in). No sm120kit in it."""
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True).stdout.strip())
    wheels.install(site, "sglang", VERSION, MOE_MEMBERS)
    if with_triton:
        for item in (TRITON, *TRITON.parent.glob("triton-*.dist-info")):
            (site / item.name).symlink_to(item)
    return python


@pytest.mark.parametrize("plan", [True, False], ids=["--plan", "timing"])
def test_no_triton_anywhere_is_exit_2_naming_the_extra(plan, moe_node, no_triton_here, cli):
    """HEAD: `internal error: ModuleNotFoundError: ... triton` (the kernels compiled in-process)."""
    site, config = moe_node
    before = tree_snapshot(site)
    code, out, err = cli("tune-moe", "kimi-k2-int4-triton", *(["--plan"] if plan else []), "--site", site,
                         "--model-config", config)  # fmt: skip
    assert code == 2 and out == "", err
    assert "internal error" not in err and "Traceback" not in err
    assert "has no Triton" in err and f"next: {EXTRA}" in err
    assert tree_snapshot(site) == before


def test_a_target_without_triton_either_is_exit_2(moe_node, no_triton_here, cli, tmp_path):
    _, config = moe_node
    python = target_python(tmp_path / "env", with_triton=False)
    code, _, err = cli("tune-moe", "kimi-k2-int4-triton", "--plan", "--python", python, "--model-config", config)
    assert code == 2 and "internal error" not in err
    assert f"neither has python {python}" in err and f"next: {EXTRA}" in err


def test_the_targets_triton_compiles_when_sm120kits_environment_has_none(moe_node, no_triton_here, cli, tmp_path):
    """--python names an environment with Triton: the plan compiles the release's kernel there
    (this interpreter never imports Triton), and says so."""
    _, config = moe_node
    python = target_python(tmp_path / "env", with_triton=True)
    argv = ["tune-moe", "kimi-k2-int4-triton", "--plan", "--python", python, "--model-config", config]
    code, doc = cli.json(*argv, "--device-name", SERVER, "--jobs", "2")
    assert code == 0, doc
    assert sys.modules["triton"] is None  # not imported here
    installed = next((python.parent.parent / "lib").glob("python3*/site-packages/triton-*.dist-info"))
    assert doc["compiler"] == doc["triton"] == installed.name.removesuffix(".dist-info").split("-")[1]
    assert doc["compiler_python"] == str(python)
    assert (doc["space"], doc["fit"]) == (2, 1) and 0 < doc["largest_fit_bytes"] <= 101376
    assert doc["rejected"][0]["config"] == TOO_BIG and doc["rejected"][0]["shared"] > 101376
    code, out, _ = cli(*argv, "--device-name", SERVER, "--jobs", "2")
    assert code == 0 and f"of the target's {python}" in " ".join(out.split())


def test_without_a_config_json_the_next_line_names_model_config(moe_node, cli):
    """HEAD: `next: huggingface-cli download ...` only."""
    site, _ = moe_node
    code, _, err = cli("tune-moe", "kimi-k2-int4-triton", "--plan", "--site", site)
    assert code == 2 and "no config.json for moonshotai/Kimi-K2.5" in err
    [hint] = [line for line in err.splitlines() if "next:" in line]
    assert "--model-config FILE" in hint and "huggingface-cli download moonshotai/Kimi-K2.5 config.json" in hint
    code, _, err = cli("tune-moe", "kimi-k2-int4-triton", "--plan", "--site", site, "--model-config", site / "none")
    assert code == 2 and f"--model-config {site / 'none'}: no such file" in err


def test_a_marlin_profile_says_so_before_the_missing_config_json(moe_node, cli):
    """kimi-k2-int4 runs its experts on Marlin: that is the answer, config.json or not (HEAD:
    "no config.json ... huggingface-cli download" first, the Marlin refusal only after it)."""
    site, config = moe_node
    code, _, err = cli("tune-moe", "kimi-k2-int4", "--plan", "--site", site)
    assert code == 2 and "no config.json" not in err
    assert "Marlin" in err and "next: sm120kit tune-moe kimi-k2-int4-triton" in err
    code, _, err = cli("tune-moe", "kimi-k2-int4", "--plan", "--site", site, "--model-config", config)
    assert code == 2 and "Marlin" in err and "next: sm120kit tune-moe kimi-k2-int4-triton" in err  # with it too
    code, _, err = cli("tune-moe", "glm5-nvfp4", "--plan", "--site", site)  # its runner is in the profile
    assert code == 2 and "flashinfer_cutlass" in err and "no config.json" not in err


def test_the_tune_extra_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("triton>=") for dep in project["optional-dependencies"]["tune"])


# -- 12: 80 columns never break an id --------------------------------------------------------


def rows_at_80(cli, *argv) -> tuple[str, set[str]]:
    with report.fitted_to(80):
        _, out, _ = cli(*argv)
    return out, {line.split()[0] for line in out.splitlines() if line and not line[0].isspace()}


def test_status_patches_and_known_failures_keep_every_id_whole_at_80_columns(cli, site):
    """HEAD: `flashinfer-sm120-arch-suff` / `ix` in status and patches; known-failures 88 wide."""
    from sm120kit.catalogue.survey import load_survey
    from sm120kit.patching.registry import load_patches

    install(site, VERSION)
    patch_ids = {p.id for p in load_patches()}
    for argv in (("status", "--site", site), ("patches",)):
        out, first_words = rows_at_80(cli, *argv)
        assert patch_ids <= first_words, (argv, patch_ids - first_words)
        # a line that is the site's path alone (as long as the test's temp dir) cannot be broken
        assert max(len(line) for line in out.splitlines() if str(site) not in line) <= 80, argv
    out, first_words = rows_at_80(cli, "known-failures")
    assert {f.id for f in load_survey(None).failures} <= first_words
    assert max(map(len, out.splitlines())) <= 80
    cli("patch", "--site", site)
    out, _ = rows_at_80(cli, "unpatch", "--site", site)
    assert max(len(line) for line in out.splitlines() if str(site) not in line) <= 80


def test_a_whole_column_gives_up_width_only_down_to_its_longest_id():
    rows = [["sglang-moe-autotune-flashinfer-cutlass", "flashinfer-python", "0.5.9, 0.5.14, open"]]
    text = report.table(["PATCH", "PACKAGE", "FIXED IN"], rows, 61, narrow=(0, 1, 2), whole=(0,))
    assert text.splitlines()[1:] == [  # the others wrap at a space or after a "-", the id stays whole
        "sglang-moe-autotune-flashinfer-cutlass  flashinfer-  0.5.9,",
        "                                        python       0.5.14,",
        "                                                     open",
    ]
    ids = "sglang-triton-smem-sm120, sglang-dsa-page-table-guard"  # unpatch's PATCHES column: a list of ids
    lines = report.table(["PATCHES", "OUTCOME"], [[ids, "restored"]], 40, narrow=(0,), whole=(0,)).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["sglang-triton-smem-sm120,", "sglang-dsa-page-table-guard"]


# -- 13: profile show prints TOML ------------------------------------------------------------


def toml_body(out: str) -> str:
    comment = [line for line in out.splitlines() if line.startswith("#")][:3]
    assert comment and "--json for JSON" in " ".join(line[2:] for line in comment)
    return out


@pytest.mark.parametrize("name", [name for name, _, _ in list_profiles()])
def test_profile_show_is_toml_that_loads_back_as_the_same_profile(name, cli, tmp_path):
    """HEAD: JSON after the `#` lines, which no TOML (nor JSON) reader takes."""
    code, out, _ = cli("profile", "show", name, "--set", "engine.max_running_requests=96")
    assert code == 0
    tomllib.loads(toml_body(out))
    copy = tmp_path / f"copy-of-{name}.toml"
    copy.write_text(out)
    shown, loaded = load_profile(name, None, ["engine.max_running_requests=96"]), load_profile(str(copy))
    assert loaded.model_dump(exclude={"name", "source"}) == shown.model_dump(exclude={"name", "source"})
    code, doc = cli.json("profile", "show", name)
    assert code == 0 and doc["name"] == name  # --json: the JSON document, as before


def test_odd_strings_and_keys_survive_the_round_trip(cli, tmp_path):
    from sm120kit.profiles import toml_text

    (tmp_path / "odd.toml").write_text(
        'extends = "glm5-nvfp4"\ndescription = "quote \\" backslash \\\\ tab \\t é \\u007f end"\n'
        '[env]\nEMPTY = ""\n[extra_args]\n"--odd-flag" = "a b"\n'
    )
    code, out, _ = cli("profile", "show", "odd", "--profile-dir", tmp_path)
    assert code == 0
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "odd2.toml").write_text(out)
    original, loaded = load_profile("odd", [str(tmp_path)]), load_profile(str(tmp_path / "copy" / "odd2.toml"))
    assert loaded.model_dump(exclude={"name", "source"}) == original.model_dump(exclude={"name", "source"})
    assert loaded.description == 'quote " backslash \\ tab \t é \x7f end' and loaded.extra_args["--odd-flag"] == "a b"
    doc = {
        "k": [1, 2.5, True, "s"],
        "not set": None,
        "a b": {"c.d": "x", "inf": float("inf")},
        "t": [{"x": 1}, {"x": 2}],
    }
    assert tomllib.loads(toml_text.dumps(doc)) == {k: v for k, v in doc.items() if v is not None}


# -- 14: --set with its section left out -------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "meant"),
    [
        ("max_running_requests=2048", "engine.max_running_requests=2048"),  # HEAD: the top level's keys
        ("tp=4", "parallel.tp=4"),
        ("engine.tp=4", "parallel.tp=4"),  # the wrong section
        ("path=/models/x", "model.path=/models/x"),  # HEAD: "did you mean patches?"
        ("max_runing_requests=64", "engine.max_running_requests=64"),  # a typo, the section left out
        ("engine.max_runing_requests=64", "engine.max_running_requests=64"),  # a typo alone
    ],
)
def test_a_set_without_its_section_names_the_key_it_meant(item, meant, cli):
    code, out, err = cli("profile", "show", "glm5-nvfp4", "--set", item)
    assert code == 2 and out == ""
    key = meant.partition("=")[0]
    assert f"did you mean {key}?" in err and err.splitlines()[-1] == f"  next: --set {meant}"


def test_a_profile_file_with_a_key_in_the_wrong_table_is_told_where_it_goes(tmp_path, cli):
    (tmp_path / "mine.toml").write_text('extends = "glm5-nvfp4"\n[engine]\ntp = 4\n')
    code, _, err = cli("profile", "check", "mine", "--profile-dir", tmp_path)
    assert code == 2 and "unknown key engine.tp; did you mean parallel.tp?" in err
    assert "next: put it under [parallel]" in err


# -- 16: try's diff step and its pip steps ------------------------------------------------------


def test_try_shows_the_diffs_stat_and_says_pip_is_not_run(cli):
    """HEAD: the diff's lines cut at the width with `…`, and `$ pip install ...   # as pip does`."""
    scratch = Path(tempfile.mkdtemp(prefix="try-", dir="/tmp"))
    try:
        code, out, err = cli("try", "--dir", scratch)
    finally:
        scratch.rmdir()
    assert code == 0, out + err
    transcript = out.split("\nsm120kit try: the cycle on real release wheels", 1)[0]
    assert not [line for line in transcript.splitlines() if line.endswith("…")] and "$ pip" not in transcript
    step = transcript.split("$ sm120kit patch --diff --site $SITE\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert step[0].startswith("    the diff (") and "the command prints it whole" in step[0]
    files = [line.split() for line in step[1:-1]]
    assert files and all(len(f) == 3 and f[1].startswith("+") and f[2].startswith("-") for f in files)
    added, removed = sum(int(f[1]) for f in files), sum(-int(f[2]) for f in files)
    assert step[-1] == f"    {len(files)} files changed: {added} lines added, {removed} removed"
    pip = [line for line in transcript.splitlines() if "pip install" in line]
    assert len(pip) == 2 and all(line.startswith("# in place of `pip install ") for line in pip)
    assert "(not run)" in pip[0] and "(not run)" in pip[1]


def test_diff_stat_reads_hunks_by_their_counts():
    from sm120kit.tryout import diff_stat

    diff = (
        "--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n keep\n--- a removed line that starts with two dashes\n"
        "+++ an added line that starts with two pluses\n keep\n"
        "--- a/y.py\n+++ b/y.py\n@@ -5 +5,2 @@\n-old\n+new\n+more\n"
        "\\ No newline at end of file\n"
    )
    assert diff_stat(diff) == [("x.py", 1, 1), ("y.py", 2, 1)]


# -- 18: render docker's Dockerfile and its JIT cache ------------------------------------------

IMAGE = "registry.example/sglang:v0.5.23"
SERVABLE = sorted(p.stem for p in (ROOT / "profiles").glob("*.toml") if not unservable(load_profile(str(p))))
COMPOSE_SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "compose" / "compose-spec.json").read_text())
INSTRUCTIONS = {"FROM", "ARG", "RUN", "ENV", "COPY", "LABEL", "WORKDIR", "USER", "ENTRYPOINT", "CMD"}


@pytest.fixture
def no_user_paths(monkeypatch):
    monkeypatch.delenv("SM120KIT_PROFILE_PATH", raising=False)
    monkeypatch.delenv("SM120KIT_PATCH_PATH", raising=False)


def parsed(text: str) -> list:
    """The Dockerfile as BuildKit's parser reads it (hadolint has no Debian package)."""
    commands = dockerfile.parse_string(text)
    assert {c.cmd for c in commands} <= INSTRUCTIONS, [c.cmd for c in commands]
    return commands


@pytest.mark.parametrize("name", SERVABLE)
def test_the_image_is_patched_and_proven_when_it_is_built(name, cli, no_user_paths):
    """HEAD: no Dockerfile; the compose file runs --image as it is."""
    code, out, _ = cli("render", "docker", name, "--image", IMAGE, "--dockerfile")
    assert code == 0
    commands = parsed(out)
    assert [c.cmd for c in commands[:2]] == ["FROM", "COPY"] and commands[0].value == (IMAGE,)
    wheel = f"sm120kit-{__version__}-py3-none-any.whl"  # sm120kit's own, beside it in the context (--out DIR)
    assert commands[1].value == (wheel, "/opt/sm120kit/")
    assert commands[2].cmd == "RUN" and shlex.split(commands[2].value[0]) == [
        "pip",
        "install",
        "--no-cache-dir",
        f"/opt/sm120kit/{wheel}",
    ]
    profile = load_profile(name)
    if profile.patches:
        patch = shlex.split(commands[3].value[0])
        assert patch[:3] == ["sm120kit", "patch", "--verify"] and len(commands) == 4
        assert [patch[i + 1] for i, w in enumerate(patch) if w == "--only"] == profile.patches
    else:
        assert len(commands) == 3
    code, doc = cli.json("render", "docker", name, "--image", IMAGE)
    [service] = doc["compose"]["services"].values()
    jsonschema.Draft7Validator(COMPOSE_SCHEMA).validate(doc["compose"])
    assert service["build"]["dockerfile_inline"] == out.replace("$", "$$") == doc["dockerfile"].replace("$", "$$")
    assert service["image"] == doc["image"] == doc["run"][-3] == f"sm120kit-{name}:v0.5.23"  # the built one


def test_the_jit_caches_live_in_a_volume(cli, no_user_paths):
    """HEAD: FlashInfer and Triton JIT into the container's own layer: gone with it."""
    _, doc = cli.json("render", "docker", "glm5-nvfp4", "--image", IMAGE)
    [service] = doc["compose"]["services"].values()
    assert "sm120kit-jit:/var/cache/sm120kit/jit" in service["volumes"]
    assert doc["compose"]["volumes"]["sm120kit-jit"] == {}
    env = dict(e.split("=", 1) for e in service["environment"] if "=" in e)
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/sm120kit/jit"  # flashinfer: <base>/.cache/flashinfer
    assert env["TRITON_CACHE_DIR"].startswith("/var/cache/sm120kit/jit/")
    run = doc["run"]
    assert "sm120kit-jit:/var/cache/sm120kit/jit" in run and "TRITON_CACHE_DIR=/var/cache/sm120kit/jit/triton" in run


def test_a_user_patch_is_applied_at_the_start_not_in_the_build(cli, tmp_path, no_user_paths):
    """A --patch-dir is mounted into the container, not in the build's context: its patches
    are named in the Dockerfile and applied by the container's patch step."""
    (tmp_path / "mine.toml").write_text(
        'extends = "glm5-nvfp4"\npatches = ["sglang-triton-smem-sm120", "test-version-marker"]\n'
    )
    fixture = ROOT / "tests" / "fixtures" / "patches"
    argv = ["render", "docker", "mine", "--image", IMAGE, "--profile-dir", tmp_path, "--patch-dir", fixture]
    code, out, _ = cli(*argv, "--dockerfile")
    assert code == 0
    run = [c for c in parsed(out) if c.cmd == "RUN"][-1]
    assert shlex.split(run.value[0]) == ["sm120kit", "patch", "--verify", "--only", "sglang-triton-smem-sm120"]
    assert "# applied when the container starts, from its --patch-dir: test-version-marker" in out
    code, doc = cli.json(*argv)
    assert "--only test-version-marker" in doc["run"][-1]  # the container's own patch step


def test_dockerfile_is_for_docker_alone(cli):
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--dockerfile")
    assert (code, out) == (2, "") and "--dockerfile" in err
