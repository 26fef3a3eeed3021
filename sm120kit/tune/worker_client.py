"""The parent's side of worker.py's JSON-lines protocol (the protocol is written at the top of
worker.py): asking the target's interpreter what it can time on (`probe`), and one worker process
on one GPU (`Worker`) whose output becomes events on a queue, ended whole with its process group.

Separate because the parent never imports torch: everything it knows of the GPUs it learns over
these pipes, and timing.py (the schedule) and compare.py (default against tuned) both speak it.
"""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from sm120kit import child_process
from sm120kit.errors import UserError

WORKER = Path(__file__).with_name("worker.py")
PROTOCOL = 1  # worker.py's
PROBE_TIMEOUT_S = 180.0
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
        done = child_process.run([str(python), str(worker), "--probe"], deadline_s=PROBE_TIMEOUT_S)
    except OSError as exc:
        raise UserError(f"{python}: cannot run it to look for GPUs: {exc}", hint) from exc
    if done.hung:
        raise UserError(f"{python}: the timing worker's probe gave no answer within {PROBE_TIMEOUT_S:g} s", hint)
    info = None
    for event in done.objects():
        if event.get("event") == "probe":
            info = event
    if info is None:
        tail = " ".join(done.stderr_tail(3))
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
    """One worker process on one GPU, its output turned into events on a queue as it comes."""

    def __init__(self, python: Path, script: Path, gpu: int, job: dict, events: Events) -> None:
        self.gpu = gpu
        self.batch: dict | None = None  # the request in flight
        self.results: list[dict] = []  # its result events so far
        self.reference_seen = False
        self.reference: dict = {}
        self.default: dict = {}
        self.finished = False  # told there is no more work
        self.fatal = False  # said why it stopped

        def said(event: dict) -> None:
            if "event" in event:
                events.put((self, event))

        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(gpu), "PYTHONUNBUFFERED": "1"}
        self.child = child_process.LineChild(
            [str(python), str(script)], env=env, on_object=said, on_end=lambda: events.put((self, None))
        )
        self.proc = self.child.proc
        self.send(job)

    def send(self, message: dict) -> None:
        self.child.send(message)  # where it died, its end of output says so

    def request(self, batch: dict) -> None:
        self.batch, self.results, self.reference_seen = batch, [], False
        self.send(batch)

    def finish(self) -> None:
        """No more work: close its stdin and let it exit."""
        self.finished = True
        self.child.close_stdin()

    def kill(self) -> None:
        """SIGTERM to its process group, SIGKILL after a grace period."""
        self.child.stop()

    def tail(self) -> str:
        return " | ".join(list(self.child.tail)[-5:])
