"""A run's record (sm120kit.serve.rundir, record_schema, status): its schema, `sm120kit ps`
over damaged records (reported as damaged, exit 2, never skipped), log rotation, and a full
disk under the state directory."""

from __future__ import annotations

import json
import os
import time

import pytest

from sm120kit.serve.record_schema import DamagedRecord, event_line, read_run_state
from sm120kit.serve.rundir import copy_truncate, read_state, rotate
from sm120kit.serve.status import EventKind, RunStatus


def test_a_full_disk_under_the_state_dir_does_not_stop_a_healthy_server(serve):
    """events.jsonl and the state file's temporary copy on /dev/full: every write of the
    record fails with ENOSPC, as on a full disk. The supervisor says so and supervises on."""
    s = serve().start()
    s.wait("ready")
    events, state_tmp = s.dir / "events.jsonl", s.dir / ".state.json.tmp"
    events.unlink()
    events.symlink_to("/dev/full")
    state_tmp.unlink(missing_ok=True)
    state_tmp.symlink_to("/dev/full")
    deadline = time.monotonic() + 10
    while "could not record" not in s.output and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # probes every 0.2 s: each one updates the state
    assert s.proc.poll() is None, s.output
    assert "could not record state.json (No space left on device)" in s.output, s.output
    assert s.output.count("could not record state.json") == 1, "said once, not at every probe"
    events.unlink()
    state_tmp.unlink()  # space again
    assert s.signal() == 0, s.output
    assert "recording state.json again" in s.output
    assert s.events("stopped")[-1]["clean"] is True


def test_rotation_keeps_the_newest(tmp_path):
    log = tmp_path / "server.log"
    for run in range(7):
        rotate(log, keep=3)
        log.write_text(f"run {run}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.log", "server.log.1", "server.log.2", "server.log.3"]
    assert [(tmp_path / n).read_text() for n in ("server.log", "server.log.1", "server.log.3")] == [
        "run 6\n",
        "run 5\n",
        "run 3\n",
    ]


def test_copy_truncate_keeps_an_appending_writer_writing(tmp_path):
    log = tmp_path / "server.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"old line\n")
    copy_truncate(log)
    os.write(fd, b"new line\n")
    os.close(fd)
    assert log.read_bytes() == b"new line\n" and (tmp_path / "server.log.1").read_bytes() == b"old line\n"


def test_a_log_copy_that_fails_on_a_full_disk_still_truncates_the_log(tmp_path, monkeypatch):
    import errno
    import shutil

    def full(src, dst):
        with open(dst, "wb") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfile", full)
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * 4096)
    with pytest.raises(OSError, match="No space left"):
        copy_truncate(log)
    assert log.stat().st_size == 0 and not (tmp_path / "server.log.1").exists()


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

    from sm120kit.serve.render import ps_row

    now = time.time()
    old = now - 170 * 3600 - 12 * 60
    run = {"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "host": "127.0.0.1", "port": 30000}
    assert ps_row({**run, "since": now - 90})[4] == "90s ago"
    assert ps_row({**run, "since": now - 300})[4] == "5m ago"
    assert ps_row({**run, "since": now - 7100})[4] == "118m ago"
    assert ps_row({**run, "since": old})[4] == time.strftime("%Y-%m-%d %H:%M", time.localtime(old))
    health = {"ok": True, "detail": "generates", "at": old}
    assert ps_row({**run, "since": old, "last_health": health})[6].endswith(
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
    from sm120kit.serve.render import ps_row

    row = ps_row({"profile": "glm5-nvfp4", "status": "damaged", "running": False})
    assert row == ["glm5-nvfp4", "damaged", "-", "-", "-", "-", "-", "-"]
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    code, out, err = cli("ps", "--wide")
    assert code == 2 and "damaged" in out and "?:?" not in out and " 0 " not in out, out
    assert "damaged run record" in err


GOOD = {"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "host": "127.0.0.1", "port": 30000}


def test_a_record_is_read_with_its_status_as_a_run_status(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({**GOOD, "phase": "smoke"}))
    state = read_run_state(path)
    assert state["status"] is RunStatus.READY and state["phase"] == "smoke"  # fields it does not check are kept
    assert read_state(tmp_path)["status"] is RunStatus.READY
    path.write_text(json.dumps({**GOOD, "status": "draining"}))  # a word a newer sm120kit writes
    assert read_run_state(path)["status"] == "draining"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "Expecting property name"),
        ("[1]", "a JSON list, not an object"),
        (json.dumps({**GOOD, "port": "30000"}), "port: Input should be a valid integer"),
        (json.dumps({**GOOD, "status": 1}), "status: Input should be a valid string"),
    ],
)
def test_a_damaged_record_is_one_error_naming_the_file(tmp_path, text, says):
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(DamagedRecord) as caught:
        read_run_state(path)
    assert str(caught.value).startswith(f"{path}: ") and says in caught.value.why


def test_no_record_is_not_a_damaged_one(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_run_state(tmp_path / "state.json")


def test_an_event_line_has_its_kind_as_an_event_kind():
    assert event_line('{"event": "ready", "after_s": 3.5}') == {"event": EventKind.READY, "after_s": 3.5}
    assert event_line('{"event": "ready", "after_s": 3.5}')["event"] is EventKind.READY
    for line in ('{"event": "ready"', "[1]", '{"event": "teleported"}', '{"event": 5}', '{"t": 1}', ""):
        assert event_line(line) is None, line
