"""The profile commands as a user runs them: list, show, check, schema, serve --dry-run,
and bad input answered with a message and exit 2."""

from __future__ import annotations

import json
import re

import pytest
from support.sites import install


def test_profiles_lists_the_shipped_ones(cli):
    code, doc = cli.json("profiles")
    names = {p["name"] for p in doc["profiles"]}
    assert code == 0 and {"glm5-nvfp4", "glm51-nvfp4", "sm120-base"} <= names
    assert all(p["description"] for p in doc["profiles"])


def test_show_resolves_extends_and_set(cli):
    code, doc = cli.json("profile", "show", "glm51-nvfp4", "--set", "engine.max_running_requests=2048")
    profile = doc["profile"]
    assert code == 0
    assert profile["engine"]["disable_shared_experts_fusion"] is True  # its own
    assert profile["engine"]["moe_runner_backend"] == "flashinfer_cutlass"  # from glm5-nvfp4
    assert profile["env"]["NCCL_P2P_LEVEL"] == "SYS"  # from sm120-base
    assert profile["engine"]["max_running_requests"] == 2048  # --set


def test_schema_is_json_schema_for_editors(cli):
    code, out, _ = cli("profile", "schema")
    schema = json.loads(out)
    assert code == 0 and schema["$schema"].startswith("https://json-schema.org/")
    assert "engine" in schema["properties"] and schema.get("additionalProperties") is False


def test_check_against_each_kind_of_release(cli, site):
    for version in ("0.5.9", "0.5.23"):
        install(site, version, flashinfer=False)
        code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site, "--no-patch-check")  # unpatched
        assert code == 0 and f"ok for sglang {version}" in out, err


def test_bad_input(cli, site, tmp_path):
    install(site, "0.5.23", flashinfer=False)
    code, _, err = cli("profile", "check", "glm5-nvfp5", "--site", site)
    assert code == 2 and "glm5-nvfp4" in err and "Traceback" not in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "engine.max_runing_requests=1")
    assert code == 2 and "engine.max_running_requests" in err
    code, _, err = cli(
        "serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "engine.attention_backend=flashinfr"
    )
    assert code == 2 and "flashinfer" in err and "accepts" in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "server.host=0.0.0.0")
    assert code == 2 and "api_key_env" in err
    (tmp_path / "broken.toml").write_text('extends = "sm120-base"\n[engine\n')
    code, _, err = cli("profile", "show", "broken", "--profile-dir", tmp_path)
    assert code == 2 and "broken.toml" in err and "line 2" in err
    code, _, err = cli("profile", "check", "glm5-nvfp4", "--site", tmp_path)
    assert code == 2 and "sglang is not installed" in err


def test_a_non_finite_health_budget_is_refused_by_every_command(cli, tmp_path):
    for argv in (
        ("serve", "glm5-nvfp4", "--dry-run", "--site", tmp_path),
        ("profile", "check", "glm5-nvfp4", "--site", tmp_path),
        ("bench", "glm5-nvfp4"),
    ):
        code, out, err = cli(*argv, "--set", "health.stop_timeout_s=inf")
        err = re.sub(r"\n +", " ", err)  # the message as one line, whatever it was wrapped to
        assert (
            code == 2
            and "health.stop_timeout_s: inf is not a finite number; allowed: a number above 0 and at most 86400" in err
        ), (argv, err)
        assert "Traceback" not in err and not out


def test_a_base_profile_without_a_model_cannot_serve(cli, tmp_path):
    """sm120-base names the node, not a model: sglang's parser rejects a command without
    --model-path, and tp 1 would use one of its 8 GPUs."""
    for argv in (
        ("serve", "sm120-base", "--dry-run", "--site", tmp_path),
        ("profile", "check", "sm120-base", "--site", tmp_path),
        ("bench", "sm120-base"),
    ):
        code, out, err = cli(*argv)
        assert code == 2 and not out and "Traceback" not in err, (argv, err)
        assert "profile sm120-base" in err and "cannot serve" in err and "model.path is not set" in err, err
        assert "node.gpus = 8" in err and "parallel.tp" in err, err
        assert 'extends = "sm120-base"' in err, "the next step: a profile of its own that extends it"


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["parallel.tp=4"], "parallel.tp × pp × dp = 4 GPUs, but node.gpus = 8"),
        (
            ["parallel.nnodes=2", "parallel.dist_init_addr=node0:5000"],
            "8 GPUs over parallel.nnodes = 2 is 4 per node, but node.gpus = 8",
        ),
        (["node.gpus=1"], "parallel.tp × pp × dp = 8 GPUs, but node.gpus = 1"),
    ],
)
def test_parallel_sizes_must_use_the_nodes_gpus(cli, tmp_path, sets, says):
    code, out, err = cli(
        "serve", "glm5-nvfp4", "--dry-run", "--site", tmp_path, *(a for s in sets for a in ("--set", s))
    )
    assert code == 2 and says in err and not out, err
