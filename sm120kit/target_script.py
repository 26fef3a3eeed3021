"""What the scripts run in the TARGET's interpreter by their path share: their JSON-lines channel.

sm120kit/node/nccl_probe.py and sm120kit/tune/worker.py run as `<python> SCRIPT` in the
environment that serves sglang, which need not have sm120kit: they cannot import it, so each
runs this file by its path (`runpy.run_path`) and takes its names. It imports the standard
library only. The parent's side of the channel is sm120kit/child_process.py.

The channel: one JSON object a line on the real stdout, `{"event": ..., ...}`, and nothing
else there (file descriptor 1, where a C library's or torch's prints go, is pointed at
stderr); a `Fatal` error ends the script with one last event that says its kind and why.
"""

from __future__ import annotations

import json
import os
import sys


class Fatal(Exception):
    """The script cannot go on: `kind` is its protocol's word for why, `error` the reason."""

    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error


_protocol = sys.stdout  # the JSON-lines channel; see keep_stdout_for_protocol


def keep_stdout_for_protocol() -> None:
    """Only our JSON lines reach the parent on stdout: the real stdout is kept for them, and file
    descriptor 1 (what torch's, sglang's or a C library's prints write to) is pointed at stderr."""
    global _protocol
    sys.stdout.flush()
    _protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def channel():
    """The channel itself: a process the script starts writes its own lines to it."""
    return _protocol


def emit(event: str, **fields) -> None:
    # One write a line: processes may share this pipe, and a write of under PIPE_BUF bytes is atomic.
    _protocol.write(json.dumps({"event": event, **fields}) + "\n")
    _protocol.flush()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
