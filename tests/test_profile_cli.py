"""The profile commands as a user runs them: list, show, check, schema, serve --dry-run,
and bad input answered with a message and exit 2."""

from __future__ import annotations

import json

from conftest import install


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
        code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site)
        assert code == 0 and f"ok for sglang {version}" in out, err


def test_bad_input(cli, site, tmp_path):
    install(site, "0.5.23", flashinfer=False)
    code, _, err = cli("profile", "check", "glm5-nvfp5", "--site", site)
    assert code == 2 and "glm5-nvfp4" in err and "Traceback" not in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "engine.max_runing_requests=1")
    assert code == 2 and "engine.max_running_requests" in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "engine.attention_backend=flashinfr")
    assert code == 2 and "flashinfer" in err and "accepts" in err
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--set", "server.host=0.0.0.0")
    assert code == 2 and "api_key_env" in err
    (tmp_path / "broken.toml").write_text('extends = "sm120-base"\n[engine\n')
    code, _, err = cli("profile", "show", "broken", "--profile-dir", tmp_path)
    assert code == 2 and "broken.toml" in err and "line 2" in err
    code, _, err = cli("profile", "check", "glm5-nvfp4", "--site", tmp_path)
    assert code == 2 and "sglang is not installed" in err
