"""`sm120kit ps` over damaged run records: reported as damaged (exit 2), never skipped
as if nothing were served."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize(
    "text, says",
    [
        ("{", "Expecting property name"),
        ("[1, 2]", "a JSON list, not an object"),
        (
            json.dumps({"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": "123"}),
            "supervisor_pid: Input should be a valid integer",
        ),
        (
            json.dumps({"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "port": "30000"}),
            "port: Input should be a valid integer",
        ),
    ],
)
def test_a_damaged_state_file_is_reported(tmp_path, cli, monkeypatch, text, says):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(text)
    code, out, err = cli("ps")
    assert code == 2 and "glm5-nvfp4" in out and "damaged" in out
    assert f"damaged run record {state}: {says}" in err and "Traceback" not in err
    code, doc = cli.json("ps")
    assert code == 2 and doc["runs"][0]["status"] == "damaged" and says in doc["runs"][0]["error"]


def test_a_good_state_file_is_listed(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(
        json.dumps(
            {
                "profile": "glm5-nvfp4",
                "status": "stopped",
                "supervisor_pid": 1,
                "since": 1.5,
                "host": "127.0.0.1",
                "port": 30000,
            }
        )
    )
    code, out, _ = cli("ps")
    assert code == 0 and "glm5-nvfp4  stopped" in out and "127.0.0.1:30000" in out
