"""Issue 31, items 7-9: one node, one verdict. serve's preflight is the one list of what a
launch must pass (sm120kit.node.registry.PREFLIGHT): doctor runs all of it; serve --dry-run,
profile check and bench's plan run the checks of the profile and the serving environment
(registry.ANYWHERE), render refuses a profile whose ports clash; so that no command says
"ready" where serve refuses. A user's launch rule that can never fire is said so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.node import node_tree as node
from support.paths import ROOT
from support.sites import install
from support.standin import PROFILES, free_port, make_env_python

from sm120kit import wheels
from sm120kit.catalogue import rules
from sm120kit.catalogue.survey import FILENAME, Survey, read_file
from sm120kit.cli import main
from sm120kit.node import registry

NVML = ROOT / "tests" / "fixtures" / "doctor" / "rtx-pro-6000-x8.json"  # 8 x RTX PRO 6000, healthy
VERSION = "0.5.23"


def one_line(text: str) -> str:
    """A message as one line, whatever width it was wrapped to."""
    return " ".join(text.split())


def checks(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"]}


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


# -- 7: doctor runs every check of serve's preflight, with serve's verdict ------------------------


def test_doctor_runs_every_check_of_serves_preflight():
    """HEAD: doctor ran "gpus" and "patches" of serve's six; never the imports, the API key,
    stale processes or the ports."""
    assert set(registry.PREFLIGHT) <= set(registry.DOCTOR)
    assert set(registry.ANYWHERE) | set(registry.THIS_NODE) == set(registry.PREFLIGHT)
    assert {"imports", "patches", "port plan"} == set(registry.ANYWHERE)


def test_doctor_without_sglang_does_not_say_this_node_can_serve(cli, tmp_path):
    """HEAD: `WARN software ... sglang is not installed here`, then "this node can serve",
    exit 0, where serve refuses the environment (no sglang in the target)."""
    empty = tmp_path / "site-packages"
    empty.mkdir()
    argv = ["doctor", "--nvml", NVML, "--root", node(tmp_path / "root"), "--site", empty]
    code, doc = cli.json(*argv)
    software = checks(doc)["software"]
    assert code == 1 and software["status"] == "fail", software
    assert f"sglang is not installed in site {empty}" in software["detail"] and "--python EXE" in software["fix"]
    code, out, _ = cli(*argv)
    assert code == 1 and "can serve" not in out and out.splitlines()[-1].startswith("1 failed")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A venv with every .py file of sglang 0.5.23 and nothing else: no torch, no numpy, none
    of the ~40 packages its server imports (what a `pip install --no-deps` leaves)."""
    root = tmp_path_factory.mktemp("bare") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    [site] = root.glob("lib/python*/site-packages")
    wheels.unpack(wheels.fetch("sglang", VERSION), site, ["sglang/*.py"])
    return root / "bin" / "python"


def test_doctor_fails_an_environment_without_torch_as_serve_check_and_dry_run_do(cli, bare_python, state, tmp_path):
    """HEAD: `doctor --profile glm5-nvfp4` had no imports check: "this node can serve" (exit 0
    but for the patches) where `serve --check` and `serve --dry-run` refuse on the imports."""
    tree = node(tmp_path / "root")
    doctor = ["doctor", "--python", bare_python, "--nvml", NVML, "--root", tree, "--profile", "glm5-nvfp4"]
    code, doc = cli.json(*doctor)
    said = checks(doc)["imports"]
    assert code == 1 and said["status"] == "fail" and {"torch", "numpy"} <= set(said["data"]["missing"]), said
    assert "sglang's server would not start" in said["detail"] and "pip install 'sglang==0.5.23'" in said["fix"]
    code, out, _ = cli(*doctor)
    assert code == 1 and "can serve" not in out

    serve = ["serve", "glm5-nvfp4", "--python", bare_python, "--no-gpu-check"]
    code, doc = cli.json(*serve, "--check", "--set", f"server.port={free_port()}")
    assert code == 1 and checks(doc)["imports"]["detail"] == said["detail"]  # one check, one verdict
    code, doc = cli.json(*serve, "--dry-run")
    assert code == 1 and checks(doc)["imports"]["detail"] == said["detail"] and doc["argv"]


# -- 8: a dry run says everything the real run would refuse -------------------------------------


def test_a_dry_run_and_profile_check_say_serve_would_refuse_a_profile_whose_patches_are_not_in_place(cli, site):
    """HEAD: both exit 0 and say nothing of the patches that serve refuses to start without."""
    install(site, VERSION)
    code, out, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site)
    assert code == 1 and "-m sglang.launch_server" in out, err  # the command still printed
    err = one_line(err)
    assert "serve would refuse to start glm5-nvfp4: 1 preflight check(s) failed" in err
    assert "FAIL patches: not in place: sglang-dsa-page-table-guard: would-apply" in err
    assert f"`sm120kit patch --verify --site {site}`" in err
    code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site)
    assert code == 1 and "profile glm5-nvfp4: renders for sglang 0.5.23" in out and "would refuse" in out, err
    assert "FAIL patches: not in place" in one_line(err)
    code, doc = cli.json("profile", "check", "glm5-nvfp4", "--site", site)
    assert (code, doc["ok"], doc["exit_code"], checks(doc)["patches"]["status"]) == (1, False, 1, "fail")
    assert checks(doc)["imports"]["status"] == "skip" and "--site" in checks(doc)["imports"]["detail"]

    code, out, err = cli("patch", "--site", site)
    assert code == 0, out + err
    code, out, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site)
    assert code == 0 and "-m sglang.launch_server" in out and "would refuse" not in err, err
    code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site)
    assert code == 0 and "profile glm5-nvfp4: ok for sglang 0.5.23" in out, err


def test_bench_dry_run_lists_a_variant_serve_would_refuse_as_refused(cli, state, tmp_path):
    """HEAD: the variant that needs a patch not in place was listed as runnable (exit 0),
    to be refused by serve's preflight once the search reached it."""
    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", VERSION)  # sglang's files, unpatched; the stand-in server
    argv = ["bench", "standin", "--serve", "--python", python, "--profile-dir", PROFILES, "--dry-run"]
    argv += ["--vary", "patches=['sglang-dsa-page-table-guard']"]
    code, out, err = cli(*argv, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["exit_code"] == 1, err
    [as_written, needing] = doc["plan"]["variants"]
    assert (as_written["name"], as_written["status"]) == ("as-written", "runnable")
    assert needing["status"] == "refused", needing
    assert needing["why"].startswith("serve would refuse to start it: patches: not in place")
    assert "sglang-dsa-page-table-guard: would-apply" in needing["why"]
    code, out, _ = cli(*argv)
    assert code == 1 and f"refused: {needing['name']}: serve would refuse" in one_line(out)


def test_a_metrics_port_that_is_the_servers_is_refused_wherever_the_launch_is_judged(cli, site, state, tmp_path):
    """HEAD: `server.metrics_port` = `server.port` passed profile check, serve --dry-run and
    render k8s (exit 0); serve's preflight alone refused it."""
    install(site, VERSION, flashinfer=False)
    mine = ["standin", "--profile-dir", PROFILES, "--site", site]
    clash = ["--set", "server.metrics_port=30000"]  # the stand-in profile's server.port
    said = "server.metrics_port 30000 is the server's too (server.port)"
    code, out, err = cli("profile", "check", *mine, *clash)
    assert code == 1 and said in one_line(err) and "would refuse" in out, err
    code, out, err = cli("serve", "--dry-run", *mine, *clash)
    assert code == 1 and "-m sglang.launch_server" in out and said in one_line(err), err
    code, out, err = cli("render", "k8s", *mine, *clash, "--image", "registry.example/sglang:v1")
    assert (code, out) == (2, "") and said in one_line(err) and "Traceback" not in err, err
    code, out, err = cli("serve", "--dry-run", *mine, "--metrics-port", "30000")
    assert code == 1 and "--metrics-port 30000 is the server's too (server.port)" in one_line(err), err
    code, out, err = cli("profile", "check", *mine, "--set", "server.metrics_port=30001")
    assert code == 0, err

    (tmp_path / "env").mkdir()  # serve's own verdict, kept: the same check refuses the start
    python = make_env_python(tmp_path / "env", VERSION)
    port = free_port()
    start = ["serve", "standin", "--profile-dir", PROFILES, "--python", python, "--no-gpu-check", "--check"]
    code, doc = cli.json(*start, "--set", f"server.port={port}", "--set", f"server.metrics_port={port}")
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert code == 1 and [c["check"] for c in failed] == ["port plan"], failed
    assert failed[0]["detail"] == f"server.metrics_port {port} is the server's too (server.port)"


# -- 9: profile check reads the site's known failures; a rule that cannot fire is said ----------

RULE = """
[[failure]]
id = "mine"
title = "a failure of our own"
package = "sglang"
affected = ">=0.5.20"
checked = "0.5.23"
upstream = ["https://github.com/sgl-project/sglang/issues/1"]
evidence = "our own logs"
answer = "rule"
avoid = "--attention-backend triton"
advice = "avoid it"

[failure.rule]
when = [{ flag = "FLAG", in = ["flashinfer"] }]
profile = "glm5-nvfp4"
avoid = ["engine.attention_backend=triton"]
"""


def user_rule(directory: Path, flag: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / FILENAME).write_text(RULE.replace("FLAG", flag))
    return directory


def test_profile_check_reads_the_known_failures_of_its_patch_dir(cli, site, tmp_path, capsys):
    """HEAD: `profile check` took no --patch-dir (argparse refused it), so it could not see
    the known-failures.toml that serve enforces; its help said nothing of known failures,
    and its refusal said "start anyway" on a command that starts nothing."""
    install(site, VERSION)
    mine = user_rule(tmp_path / "mine", "--attention-backend")  # glm5-nvfp4's own backend: refused
    code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site, "--patch-dir", mine)
    err = one_line(err)
    assert (code, out) == (2, "") and "known failure mine on sglang 0.5.23: a failure of our own" in err, err
    assert "start anyway" not in err and "allow them anyway with --allow-known-failure mine" in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--patch-dir", mine)
    assert code == 2 and "known failure mine on sglang 0.5.23" in one_line(err)  # what serve enforces
    code, _, err = cli("profile", "check", "glm5-nvfp4", "--site", site, "--patch-dir", mine, "--no-patch-check")
    assert code == 2  # the rule, whatever the patches
    with pytest.raises(SystemExit):
        main(["profile", "check", "--help"])
    text = one_line(capsys.readouterr().out)
    assert "known SM120 failure" in text and "known-failures.toml" in text and "--patch-dir" in text


def test_a_rule_on_a_flag_the_installed_sglang_lacks_is_said_never_to_fire(cli, site, tmp_path, monkeypatch):
    """HEAD: a misspelt flag (or one of another release) made a rule that can never fire,
    accepted in silence."""
    install(site, VERSION, flashinfer=False)
    monkeypatch.setenv("SM120KIT_PATCH_PATH", str(user_rule(tmp_path / "mine", "--attention-bakend")))
    said = (
        "known failure mine on sglang 0.5.23: a failure of our own: its rule can never fire here: it needs "
        "--attention-bakend, which sglang 0.5.23 does not have"
    )
    for argv in (["profile", "check"], ["serve", "--dry-run"]):
        code, _, err = cli(*argv, "standin", "--profile-dir", PROFILES, "--site", site)
        assert code == 0 and f"warning: {said}" in one_line(err), (argv, err)


def test_only_a_condition_that_needs_the_missing_flag_makes_a_rule_inert(tmp_path):
    """A condition that holds without the flag (a `default`, `present = false`) still judges."""
    rule = user_rule(tmp_path, "--x")
    [base] = read_file(rule / FILENAME)

    def judged(condition: dict) -> list[str]:
        rule = base.rule.model_validate({**base.rule.model_dump(), "when": [condition]})
        survey = Survey((base.model_copy(update={"rule": rule}),), (tmp_path / FILENAME,))
        argv = ["python", "-m", "sglang.launch_server"]  # neither --x nor --y given
        facts = rules.Facts(argv, {}, {"sglang": "0.5.23"}, {}, flags=frozenset({"--y"}))  # a release with --y alone
        return [j.verdict.value for j in rules.judge(survey, facts)]

    assert judged({"flag": "--x", "in": ["a"]}) == ["inert"]
    assert judged({"flag": "--x", "present": True}) == ["inert"]
    assert judged({"flag": ["--x", "--y"], "in": ["a"]}) == []  # one spelling it has: judged, and it does not hold
    assert judged({"flag": "--x", "in": ["a"], "default": "a"}) == ["refused"]
    assert judged({"flag": "--x", "present": False}) == ["refused"]
