"""Where a supervised run leaves its record: <state dir>/serve/<profile>/ holds the server's
log (rotated), events.jsonl (one JSON object per event) and state.json (what `sm120kit ps`
shows). The state dir is $SM120KIT_STATE_DIR or the platform's user state directory.
What a record may hold, and how a reader gets it back, is sm120kit.serve.record_schema's."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from sm120kit import shallow_json
from sm120kit.serve.record_schema import DamagedRecord, read_run_state, run_status
from sm120kit.serve.status import TERMINAL, EventKind, RunStatus

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
    as logrotate's copytruncate does. A copy that fails (a full disk) is removed and the
    log truncated all the same, so that the server can go on writing; then it raises."""
    _shift(path, keep)
    copy = path.with_name(f"{path.name}.1")
    try:
        shutil.copyfile(path, copy)
    except OSError:
        copy.unlink(missing_ok=True)
        raise
    finally:
        with open(path, "r+b") as fh:
            fh.truncate(0)


class RunRecord:
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
        self.on_problem: Callable[[str], None] = lambda text: print(f"sm120kit: {text}", file=sys.stderr, flush=True)
        self._problems: dict[str, str] = {}  # file name -> why it could not be written, said once

    def redact(self, text: str) -> str:
        """The key's occurrences in text that may quote it (sglang's log: its server_args
        line) -> "$NAME". Records are written as they are and never rewritten: a key that
        is also a piece of a record ("0" in "127.0.0.1") once corrupted state.json."""
        for value, name in self.secrets.items():
            text = text.replace(value, name)
        return text

    def secret_prefix_at_end(self, text: str) -> int:
        """How many of text's last characters could be the start of a key that the next
        read completes: held back, so that a key split across two reads is redacted too."""
        return max(
            (
                n
                for value in self.secrets
                for n in range(min(len(value) - 1, len(text)), 0, -1)
                if text.endswith(value[:n])
            ),
            default=0,
        )

    def _written(self, path: Path, write: Callable[[], None]) -> None:
        """A record that cannot be written (a full disk, an I/O error) is said, once, and
        not raised: keeping a healthy server up matters more than its record."""
        try:
            write()
        except OSError as exc:
            problem = f"could not record {path.name} ({exc.strerror or exc}); supervising on, the record is incomplete"
            if self._problems.get(path.name) != problem:
                self._problems[path.name] = problem
                self.on_problem(problem)
            return
        if self._problems.pop(path.name, None):
            self.on_problem(f"recording {path.name} again")

    def event(self, kind: EventKind, **fields: Any) -> dict:
        now = time.time()
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}",
            "t": now,
            "event": kind,
            **fields,
        }

        def append() -> None:
            with open(self.events, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(doc) + "\n")

        self._written(self.events, append)
        return doc

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")

        def replace() -> None:
            tmp.write_text(json.dumps(self.state, indent=2))
            os.replace(tmp, self.state_file)

        self._written(self.state_file, replace)


def read_state(directory: Path) -> dict | None:
    """A run directory's state.json as last written, "status" a RunStatus; None while there
    is none (or it is being replaced: os.replace makes that a moment, not a torn file)."""
    try:
        state = shallow_json.loads((directory / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    return {**state, "status": run_status(state["status"])} if "status" in state else state


def _supervisor_alive(state: dict) -> bool:
    try:
        proc = psutil.Process(state["supervisor_pid"])
        return abs(proc.create_time() - (state.get("supervisor_started") or 0)) < 1.0
    except (KeyError, TypeError, ValueError, OverflowError, psutil.Error):  # a pid psutil refuses: not ours
        return False


def runs() -> list[dict]:
    """The state of every profile that was served here, the live ones first."""
    found = []
    root = serve_root()
    paths = [*root.glob("*/state.json"), *root.glob("*/*/state.json")] if root.is_dir() else []  # fleets' members
    for path in sorted(paths):
        try:
            state = read_run_state(path)
        except (OSError, DamagedRecord) as exc:  # reported, never skipped: `ps` must not say "nothing served"
            if isinstance(exc, DamagedRecord):
                status, error = RunStatus.DAMAGED, str(exc)
            else:  # it could not be read: the record may be sound
                status, error = RunStatus.UNREADABLE, f"{path}: {exc.strerror or exc}"
            found.append(
                {
                    "profile": str(path.parent.relative_to(root)),
                    "status": status,
                    "running": False,
                    "dir": str(path.parent),
                    "error": error,
                }
            )
            continue
        alive = _supervisor_alive(state)
        if not alive and state.get("status") not in TERMINAL:
            state["status"] = RunStatus.SUPERVISOR_GONE  # killed without a chance to stop the server
        state["running"] = alive
        state["dir"] = str(path.parent)
        found.append(state)
    return sorted(found, key=lambda s: (not s["running"], s.get("profile", "")))
