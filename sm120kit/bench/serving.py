"""`bench --serve`: the profile's server for the length of the sweep, run by serve's own
Python API (preflight, then the supervisor) in a child process, up when it generates and
stopped with SIGTERM, the supervisor's clean stop, after the sweep.

Why a child process and not a thread: the supervisor owns SIGINT, SIGTERM and SIGHUP (it
drains and stops the server on them, and a second Ctrl-C hurries it), and Python lets
only the main thread install signal handlers; bench needs its own main thread for the
sweep and its Ctrl-C. The child is forked from this process, so it starts from the profile,
launch and target already loaded (no command line is rebuilt); it moves to a session of
its own, so that a Ctrl-C in the terminal reaches bench alone and the server gets exactly
one SIGTERM, from the finally below; and it is tied to bench (PR_SET_PDEATHSIG), so that
a bench killed outright still stops the server cleanly. While the server is up, SIGTERM
and SIGHUP to bench raise KeyboardInterrupt like Ctrl-C: the server is stopped, the
finished levels are kept."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from sm120kit.errors import UserError, internal_error
from sm120kit.exit_codes import ExitCode
from sm120kit.serve import procs  # here, not in the child: procs resolves prctl (a dlopen), never after a fork
from sm120kit.serve.command import ServeOptions, serve
from sm120kit.serve.record_schema import event_line
from sm120kit.serve.status import EventKind

if TYPE_CHECKING:
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.target import Target

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
READY_SLACK_S = 60.0  # past the profile's startup budget: the preflight and the supervisor's own start


class EventTail:
    """The kinds of the events a run record gains from now on (events.jsonl)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> list[EventKind]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(complete)
        lines = complete.decode("utf-8", errors="replace").splitlines()
        # a damaged line, or a kind this sm120kit does not know, is none of the kinds waited for
        return [doc["event"] for line in lines if (doc := event_line(line)) is not None]


class Served:
    """The server of a `served` block: where its record is, and, once stopped, the exit
    code of the `sm120kit serve` child (0: stopped clean; 3, UNCLEAN: a process, port or
    GPU memory of the server was left; None: not stopped yet), and whether it ended before
    the block stopped it (ended_early: someone stopped the server, or the supervisor died)."""

    def __init__(self, events: Path) -> None:
        self.events = events
        self.exit_code: int | None = None
        self.ended_early = False
        self.child: BaseProcess | None = None  # the `sm120kit serve` child process

    def alive(self) -> bool:
        """Its `sm120kit serve` is still running (a sweep against no server is pointless)."""
        return self.child is not None and self.child.is_alive()


@contextlib.contextmanager
def served(
    profile: Profile,
    launch: Launch | FleetLaunch,
    target: Target,
    options: ServeOptions,
    width: int | None,
    out: TextIO | None = None,
    debug: bool = False,
    handle: Served | None = None,
) -> Iterator[Served]:
    """Up until it generates (or a UserError: nothing was benchmarked), stopped after.
    What we and the server say goes to out (stdout; stderr while stdout carries JSON);
    with debug, a bug in the child prints its traceback. `handle` (else a new one) gets
    the child's exit code, also when the server never got ready."""
    from sm120kit.serve.rundir import serve_root

    out = out or sys.stdout
    events = EventTail(serve_root() / profile.name / "events.jsonl")
    budget = profile.health.startup_timeout_s
    print(f"starting the server: serve {profile.name} --quiet (in a child process; up to {budget:g} s)", file=out)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # a forked child must not write our buffered output again
    child = multiprocessing.get_context("fork").Process(
        target=_serve,
        args=(os.getpid(), out is sys.stderr, profile, launch, target, options, width, debug),
        name=f"serve {profile.name}",
    )
    # A stop signal during the fork would be lost (Python ignores an exception raised in
    # the fork handlers): blocked meanwhile, it arrives inside the try below.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        child.start()  # before the handlers below: the child keeps the default ones until the supervisor's
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    handle = handle or Served(events.path)
    handle.child = child
    with stop_signals_interrupt():
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _wait_ready(child, events, profile, budget + READY_SLACK_S)
            yield handle
        finally:
            handle.ended_early = not child.is_alive()
            handle.exit_code = _stop(child, out)


def _stop(child, out) -> int | None:
    """The child's exit code, once it has stopped the server."""
    if not child.is_alive():
        child.join(5)
        return child.exitcode
    os.kill(child.pid, signal.SIGTERM)
    try:
        child.join()
    except KeyboardInterrupt:  # a second Ctrl-C hurries the stop, as it does for `sm120kit serve`
        os.kill(child.pid, signal.SIGTERM)
        child.join()
        raise
    print(f"stopped the server (sm120kit serve exit code {child.exitcode})", file=out, flush=True)
    return child.exitcode


def _wait_ready(child: BaseProcess, events: EventTail, profile: Profile, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        kinds = events.new()
        if EventKind.READY in kinds:
            return
        if not child.is_alive() or EventKind.GAVE_UP in kinds or time.monotonic() > deadline:
            child.join(0.5)
            code = child.exitcode
            raise UserError(
                f"the server for {profile.name} did not get ready"
                + (f" (sm120kit serve exit code {code})" if code is not None else "")
                + "; nothing was benchmarked",
                f"see the lines above; sm120kit serve {profile.name} --check; the log is in {events.path.parent}",
            )
        time.sleep(0.2)


def _serve(
    parent: int,
    to_stderr: bool,
    profile: Profile,
    launch: Launch | FleetLaunch,
    target: Target,
    options: ServeOptions,
    width: int | None,
    debug: bool,
) -> None:
    """The child: serve's Python API, its exit code as the process's; an error, a bug or
    Ctrl-C ends it as `sm120kit serve` would end (cli.main)."""
    if to_stderr:
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent around the fork
    if not procs.tie_to_parent(parent, signal.SIGTERM):  # bench gone: the supervisor's clean stop
        sys.exit(int(ExitCode.INTERRUPTED))  # bench died before the tie took effect
    from sm120kit.fleet.launch import FleetLaunch

    try:
        if isinstance(launch, FleetLaunch):  # a fleet profile: its replicas and router
            from sm120kit.fleet.command import serve_fleet

            code = serve_fleet(launch, target, options, width)
        else:
            code = serve(profile, launch, target, options, width)
    except UserError as exc:
        print(f"sm120kit: error: {exc}", file=sys.stderr)
        code = ExitCode.ERROR
    except KeyboardInterrupt:
        print("sm120kit: interrupted", file=sys.stderr)
        code = ExitCode.INTERRUPTED
    except Exception as exc:  # a bug: one line (the traceback with --debug), and 2, not 1 ("gave up")
        if debug:
            traceback.print_exc()
        else:
            print(internal_error(exc), file=sys.stderr)
        code = ExitCode.ERROR
    sys.exit(int(code))


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt meanwhile, as Ctrl-C does."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
