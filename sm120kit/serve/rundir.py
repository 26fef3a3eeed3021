"""Where a supervised run leaves its record: <state dir>/serve/<profile>/ holds the server's
log (rotated), events.jsonl (one JSON object per event) and state.json (what `sm120kit ps`
shows). The state dir is $SM120KIT_STATE_DIR or the platform's user state directory."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil

ENV_VAR = "SM120KIT_STATE_DIR"
LOG_BACKUPS = 5


def state_root() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    from platformdirs import user_state_dir

    return Path(user_state_dir("sm120kit"))


def serve_root() -> Path:
    return state_root() / "serve"


def _shift(path: Path, keep: int) -> None:
    """path.1 -> path.2 -> ... -> path.<keep> (the oldest is dropped)."""
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))


def rotate(path: Path, keep: int = LOG_BACKUPS) -> None:
    """A new log for a new start: path becomes path.1, and so on down."""
    _shift(path, keep)
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.1"))


def copy_truncate(path: Path, keep: int = LOG_BACKUPS) -> None:
    """Rotate a log that a live process still appends to (O_APPEND): copy, then truncate,
    as logrotate's copytruncate does."""
    _shift(path, keep)
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with open(path, "r+b") as fh:
        fh.truncate(0)


class Record:
    """events.jsonl and state.json of one run directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # sglang writes its --api-key into its own log line
        self.log = directory / "server.log"
        self.events = directory / "events.jsonl"
        self.state_file = directory / "state.json"
        self.state: dict = {}
        self.secrets: dict[str, str] = {}  # value -> what to write instead ("$NAME")

    def redact(self, text: str) -> str:
        for value, name in self.secrets.items():
            text = text.replace(value, name)
        return text

    def event(self, kind: str, **fields) -> dict:
        now = time.time()
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}", "t": now, "event": kind, **fields}
        with open(self.events, "a", encoding="utf-8") as fh:
            fh.write(self.redact(json.dumps(doc)) + "\n")
        return doc

    def update(self, **fields) -> None:
        self.state.update(fields)
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        tmp.write_text(self.redact(json.dumps(self.state, indent=2)))
        os.replace(tmp, self.state_file)


def _supervisor_alive(state: dict) -> bool:
    try:
        proc = psutil.Process(state["supervisor_pid"])
        return abs(proc.create_time() - state.get("supervisor_started", 0)) < 1.0
    except (KeyError, TypeError, psutil.Error):
        return False


def runs() -> list[dict]:
    """The state of every profile that was served here, the live ones first."""
    found = []
    root = serve_root()
    for path in sorted(root.glob("*/state.json")) if root.is_dir() else []:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        alive = _supervisor_alive(state)
        if not alive and state.get("status") not in ("stopped", "gave-up"):
            state["status"] = "supervisor gone"  # killed without a chance to stop the server
        state["running"] = alive
        state["dir"] = str(path.parent)
        found.append(state)
    return sorted(found, key=lambda s: (not s["running"], s.get("profile", "")))
