"""The parent's side of worker.py's JSON-lines protocol (the protocol is written at the top of
worker.py): asking the target's interpreter what it can time on (`probe`), and one worker process
on one GPU (`Worker`) whose output becomes events on a queue, ended whole with its process group.

Separate because the parent never imports torch: everything it knows of the GPUs it learns over
these pipes, and timing.py (the schedule) and compare.py (default against tuned) both speak it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from sm120kit.errors import UserError

WORKER = Path(__file__).with_name("worker.py")
PROTOCOL = 1  # worker.py's
PROBE_TIMEOUT_S = 180.0
KILL_GRACE_S = 5.0
# How each candidate is timed (worker.py's job keys); part of the timing state's key.
DEFAULT_SETTINGS = {"seed": 0, "graph_runs": 10, "warmup": 3, "repeats": 10}


# ----------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class Probe:
    sglang: str
    triton: str | None
    torch: str
    devices: list[str]
    memory: list[int] = field(default_factory=list)  # bytes per GPU (empty: not reported)


def probe(python: Path, worker: Path = WORKER) -> Probe:
    """What the target can time on: versions and GPUs, asked of its interpreter. A target that
    cannot time (no torch, no CUDA, no GPU, no sglang) is a UserError before anything is written."""
    hint = "run tune-moe on a node with GPUs, with --python naming the environment sglang serves from"
    try:
        done = subprocess.run(
            [str(python), str(worker), "--probe"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(f"{python}: cannot run it to look for GPUs: {exc}", hint) from exc
    info = None
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "probe":
                info = event
    if info is None:
        tail = " ".join((done.stderr or "").strip().splitlines()[-3:])
        raise UserError(f"{python}: the timing worker's probe said nothing (exit {done.returncode}): {tail}", hint)
    if not info.get("torch") or info.get("error", "").startswith("torch cannot be imported"):
        raise UserError(f"{python}: no torch in this environment: timing needs torch with CUDA and a GPU", hint)
    if not info.get("cuda") or not info.get("devices"):
        why = f" ({info['error']})" if info.get("error") else ""
        raise UserError(f"{python}: torch {info['torch']} sees no CUDA GPU{why}: timing needs one", hint)
    if not info.get("sglang"):
        raise UserError(f"{python}: sglang is not installed in this environment", "pip install sglang")
    return Probe(
        info["sglang"], info.get("triton"), info["torch"], list(info["devices"]), list(info.get("memory") or [])
    )


# ----------------------------------------------------------------------------- workers


def visible_device(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES value for our GPU index `gpu`, counted among the GPUs visible to
    us (a parent started with CUDA_VISIBLE_DEVICES=4,5 means 4 by GPU 0)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        visible = [d.strip() for d in inherited.split(",") if d.strip()]
        if gpu < len(visible):
            return visible[gpu]
    return str(gpu)


# (the worker, its event; None: its output ended)
Events: TypeAlias = "queue.Queue[tuple[Worker, dict | None]]"


class Worker:
    """One worker process on one GPU, with threads that turn its output into events on a queue."""

    def __init__(self, python: Path, script: Path, gpu: int, job: dict, events: Events) -> None:
        self.gpu = gpu
        self.batch: dict | None = None  # the request in flight
        self.results: list[dict] = []  # its result events so far
        self.reference_seen = False
        self.reference: dict = {}
        self.default: dict = {}
        self.finished = False  # told there is no more work
        self.fatal = False  # said why it stopped
        self.stderr_tail: deque[str] = deque(maxlen=30)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(gpu), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # its own process group: Ctrl-C reaches us, and we end it whole
        )
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # all three are pipes
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(events,), daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.send(job)

    def _read_stdout(self, events: Events) -> None:
        for line in self.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.stderr_tail.append(line.rstrip())
                continue
            if isinstance(event, dict) and "event" in event:
                events.put((self, event))
        events.put((self, None))  # end of output: the worker is gone

    def _read_stderr(self) -> None:
        for line in self.stderr:
            self.stderr_tail.append(line.rstrip())

    def send(self, message: dict) -> None:
        try:
            self.stdin.write(json.dumps(message) + "\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: its end of output says so

    def request(self, batch: dict) -> None:
        self.batch, self.results, self.reference_seen = batch, [], False
        self.send(batch)

    def finish(self) -> None:
        """No more work: close its stdin and let it exit."""
        self.finished = True
        with contextlib.suppress(OSError):
            self.stdin.close()

    def kill(self) -> None:
        """SIGTERM to its process group, SIGKILL after a grace period."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()

    def tail(self) -> str:
        return " | ".join(list(self.stderr_tail)[-5:])
