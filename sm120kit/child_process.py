"""A child process in a session of its own, bounded in time, ended with everything it started,
and the JSON lines it answers with.

Every program sm120kit runs in the target's interpreter (the imports probe, the NCCL probe,
sglang's resolution, the question for its site directories, tune-moe's timing worker) is
started the same way: in a new session, so that its process group holds whatever it starts
and a Ctrl-C at our terminal is ours to act on; past its deadline, on our own way out (an
exception, Ctrl-C) and after it exits (what it left running), its whole group is killed. Its
stdout is read as JSON lines, each parsed with its nesting bounded (shallow_json) and its
length bounded, a line that is neither passed over. What is sent and what the lines mean is
each caller's protocol, and stays with the caller.

`run`: a child that answers once (a request on its stdin or none, the answer read whole);
`LineChild`: a long-lived one (tune-moe's worker: requests on its stdin as the work goes,
events on its stdout read as they come).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from sm120kit import shallow_json
from sm120kit.textcheck import printable

KILL_GRACE_S = 5.0  # after a kill: for the group to go and the pipes to close
MAX_LINE = 16 << 20  # characters: a longer line is not read as JSON (no answer we read is near it)
TAIL_LINES = 30  # a long-lived child's stderr lines kept
TAIL_WIDTH = 2000  # characters of one such line kept


def loads_line(line: str) -> object:
    """One line of JSON; ValueError for one that is not JSON, nests deeper than shallow_json
    allows (json's own reading of it is a RecursionError) or is longer than MAX_LINE."""
    if len(line) > MAX_LINE:
        raise ValueError(f"a line of {len(line)} characters; no answer is longer than {MAX_LINE}")
    return shallow_json.loads(line)


# ----------------------------------------------------------------------------- the group


def _signal_group(pgid: int, sig: int) -> None:
    """Only while the leader is unreaped or a member lives: then the id is still its group's."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole group, unless we have reaped it (its id may be anyone's then)."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGKILL)


def _group_members(pgid: int, since: float) -> list[int]:
    """Live processes of process group pgid started since `since` (monotonic; a pid reused by
    a stranger is older than nothing of ours, so the start time rules it out)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the group is empty: no scan of every process
    except PermissionError:
        pass
    import psutil  # here: most children leave nothing, and most commands start none

    boot = time.time() - time.monotonic()
    found = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() >= boot + since - 1:
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


def end_group(pgid: int, since: float, grace_s: float = KILL_GRACE_S) -> list[int]:
    """Kill what is left of a child's process group (what it started and left running, after it
    exited or was killed) and wait for it to go; the pids still there after grace_s (none,
    unless the kernel holds one in an uninterruptible wait). since: when the child started."""
    deadline = time.monotonic() + grace_s
    while left := _group_members(pgid, since):
        _signal_group(pgid, signal.SIGKILL)  # a live member keeps the group id from being reused
        if time.monotonic() > deadline:
            return left
        time.sleep(0.05)
    return []


# ----------------------------------------------------------------------------- a child that answers once


@dataclass
class ChildRun:
    """How a child run to its end went: its exit status, what it wrote, whether it was killed at
    its deadline, and the pids of its group still running after the kill (none, normally)."""

    returncode: int | None
    out: bytes
    err: bytes
    hung: bool = False
    seconds: float = 0.0
    left_running: list[int] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return self.out.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.decode(errors="replace")

    def objects(self, marker: str = "") -> Iterator[dict]:
        """The JSON objects of its stdout, one a line (after `marker`, where its answers carry
        one: then lines without it are passed over); a line that is not one is passed over."""
        for line in self.stdout.splitlines():
            if not line.startswith(marker):
                continue
            try:
                doc = loads_line(line[len(marker) :])
            except ValueError:
                continue
            if isinstance(doc, dict):
                yield doc

    def last_line(self) -> str:
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""

    def stderr_tail(self, lines: int = 1) -> list[str]:
        """The last `lines` lines of its stderr that say something, as a terminal may show
        them (they are quoted to a person: no escape sequence of the child's reaches one)."""
        return [printable(line.rstrip()) for line in self.stderr.splitlines() if line.strip()][-lines:]


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | bytes | None = None,
    deadline_s: float | None = None,
    grace_s: float = KILL_GRACE_S,
) -> ChildRun:
    """argv run to its end in a session of its own, `input` on its stdin (None: /dev/null), both
    pipes read as it writes (no deadlock, however much it says). Past deadline_s its process
    group is killed (SIGKILL) and what it wrote until then is kept; what it leaves running in
    its group is killed when it exits; on our own way out (Ctrl-C) the group goes too.
    OSError: it could not be started."""
    data = input.encode() if isinstance(input, str) else input
    started = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    hung = False
    try:
        try:
            out, err = proc.communicate(data, timeout=deadline_s)
        except subprocess.TimeoutExpired:
            hung = True
            _kill(proc)
            out, err = _after_kill(proc, grace_s)
    except BaseException:
        _kill(proc)
        _after_kill(proc, grace_s)
        end_group(proc.pid, started, grace_s)
        raise
    left = end_group(proc.pid, started, grace_s)
    return ChildRun(proc.returncode, out or b"", err or b"", hung, round(time.monotonic() - started, 3), left)


def _after_kill(proc: subprocess.Popen, grace_s: float) -> tuple[bytes, bytes]:
    """What the killed child wrote, all of it (communicate keeps what it read before)."""
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired as exc:  # something outside its group holds the pipes
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        return exc.output or b"", exc.stderr or b""


# ----------------------------------------------------------------------------- a long-lived child


class LineChild:
    """A long-lived child in a session of its own that takes JSON lines on its stdin and answers
    in JSON lines on its stdout, read by a thread as they come: each object goes to on_object,
    the end of its output to on_end. Its stderr, and a stdout line that is not JSON, are kept
    in `tail`, as a terminal may show them."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        on_object: Callable[[dict], None],
        on_end: Callable[[], None],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.started = time.monotonic()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: Ctrl-C reaches us, and we end it whole
        )
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # all three are pipes
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._readers = [
            threading.Thread(target=self._read_stdout, args=(on_object, on_end), daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self, on_object: Callable[[dict], None], on_end: Callable[[], None]) -> None:
        try:
            for line in _lines(self.stdout):
                try:
                    doc = loads_line(line)
                except ValueError:
                    self.tail.append(printable(line.rstrip())[:TAIL_WIDTH])
                    continue
                if isinstance(doc, dict):
                    on_object(doc)
        finally:
            on_end()  # end of output: the child is gone

    def _read_stderr(self) -> None:
        for line in _lines(self.stderr):
            self.tail.append(printable(line.rstrip())[:TAIL_WIDTH])

    def send(self, message: object) -> bool:
        """One JSON line on its stdin; False where it is gone (its end of output says so)."""
        try:
            self.stdin.write(json.dumps(message) + "\n")
            self.stdin.flush()
            return True
        except (OSError, ValueError):  # a broken pipe; its stdin closed already
            return False

    def close_stdin(self) -> None:
        """No more requests: it reads the end of its input and exits."""
        with contextlib.suppress(OSError):
            self.stdin.close()

    def stop(self, grace_s: float = KILL_GRACE_S) -> None:
        """SIGTERM to its process group, SIGKILL after grace_s; then what it left running goes,
        and its pipes are closed."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
                self.proc.wait()
        end_group(self.proc.pid, self.started, grace_s)
        for reader in self._readers:  # at their pipes' end now, unless a process outside its group holds them
            if reader is not threading.current_thread():
                reader.join(grace_s)
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()


def _lines(stream: IO[str]) -> Iterator[str]:
    """Its lines; one longer than MAX_LINE comes as its first MAX_LINE + 1 characters, the rest
    passed over (so it is never read as JSON, and never held whole). A stream closed under
    the reader (stop() gave up waiting for its end) ends it too."""
    with contextlib.suppress(OSError, ValueError):
        while line := stream.readline(MAX_LINE + 1):
            if len(line) > MAX_LINE and not line.endswith("\n"):
                while (rest := stream.readline(MAX_LINE + 1)) and not rest.endswith("\n"):
                    pass
            yield line
