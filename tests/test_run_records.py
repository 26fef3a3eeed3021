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


def test_since_is_a_date_from_two_hours_on(tmp_path, cli, monkeypatch):
    """SINCE at a glance while recent ("5m ago"); an older run shows when (not "170h12m ago")."""
    import time

    from sm120kit import report

    now = time.time()
    old = now - 170 * 3600 - 12 * 60
    run = {"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "host": "127.0.0.1", "port": 30000}
    assert report.ps_row({**run, "since": now - 90})[4] == "90s ago"
    assert report.ps_row({**run, "since": now - 300})[4] == "5m ago"
    assert report.ps_row({**run, "since": now - 7100})[4] == "118m ago"
    assert report.ps_row({**run, "since": old})[4] == time.strftime("%Y-%m-%d %H:%M", time.localtime(old))
    health = {"ok": True, "detail": "generates", "at": old}
    assert report.ps_row({**run, "since": old, "last_health": health})[6].endswith(
        f"({time.strftime('%Y-%m-%d %H:%M', time.localtime(old))})"
    )
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({**run, "status": "stopped", "since": old}))
    code, out, _ = cli("ps", "--wide")
    assert code == 0 and time.strftime("%Y-%m-%d %H:%M", time.localtime(old)) in out and "h12m ago" not in out


def test_a_damaged_record_shows_no_invented_values(tmp_path, cli, monkeypatch):
    """A state.json that cannot be read is listed with "-" where it holds no value: no
    RESTARTS 0, no PORT ?:?, no supervisor "(gone)"."""
    from sm120kit import report

    row = report.ps_row({"profile": "glm5-nvfp4", "status": "damaged", "running": False})
    assert row == ["glm5-nvfp4", "damaged", "-", "-", "-", "-", "-", "-"]
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    code, out, err = cli("ps", "--wide")
    assert code == 2 and "damaged" in out and "?:?" not in out and " 0 " not in out, out
    assert "damaged run record" in err
