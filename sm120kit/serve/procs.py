"""The server's processes: start them in a session of their own, find them again (ours as
the supervisor's descendants, stale sglang ones by title), stop them with a deadline and
prove that none is left.

sglang's schedulers can leave the launcher's tree (re-parented to PID 1 after a crash,
sglang #23627, PR #31645) and then hold ~90 GB per GPU. What keeps them in reach: the
supervisor is a child subreaper, so orphans of the run are re-parented to it, not to PID 1,
and stay its descendants; the tree is sampled while the run lives (a Tree), so a process
that left it is still known by pid and start time; and the launcher dies with the
supervisor (PR_SET_PDEATHSIG), so a killed supervisor leaves only what escaped on purpose.
The SM120KIT_SERVE_ID marker in the environment is only a hint for a later preflight: the
schedulers call setproctitle, which writes over their /proc/PID/environ.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import psutil

from sm120kit.serve import clock

MARKER = "SM120KIT_SERVE_ID"
# Test-only: a pid whose descendants are all that scans look at. The test suite sets it to
# itself (a child subreaper, so the orphans it leaves stay its descendants): an sglang
# process of the host's must not change a test's result.
SCOPE = "SM120KIT_PROCESS_SCOPE"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GROUP_GRACE_S = 2.0
SGLANG_CMDLINE = ("sglang.launch_server", "sglang.srt.entrypoints", "sglang_router.launch_server")


_PRCTL: Callable[..., int] | None
try:  # resolved once, here: the child of a fork must not dlopen (another thread may hold the loader lock)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _prctl(option: int, value: int) -> bool:
    return _PRCTL is not None and _PRCTL(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (and reaped by it)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def tie_to_parent(parent: int, sig: int) -> bool:
    """In a child: `sig` when its parent dies (PR_SET_PDEATHSIG). False when the parent
    (pid `parent`) died before the tie took effect: the child is to exit now."""
    _prctl(PR_SET_PDEATHSIG, sig)
    return os.getppid() == parent


def spawn(argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    """argv in a new session (its own process group), stdout and stderr appended to the
    log, killed if the supervisor dies."""
    parent = os.getpid()

    def killed_with_parent() -> None:  # runs in the child, after setsid
        if not tie_to_parent(parent, signal.SIGKILL):  # the supervisor died already
            os._exit(1)

    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=killed_with_parent,
            close_fds=True,
        )


def reap() -> dict[int, int]:
    """Collect every finished child (ours and adopted orphans): pid -> wait status."""
    done: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def exit_description(status: int) -> tuple[int | None, str]:
    """(exit code or None, "exit code 1" / "killed by SIGKILL")."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return None, f"killed by {signal.Signals(sig).name}"
    code = os.waitstatus_to_exitcode(status)
    return code, f"exit code {code}"


@dataclass(frozen=True)
class Proc:
    pid: int
    title: str
    ppid: int
    started: float
    user: str
    marker: str | None = None  # the run it belongs to (SM120KIT_SERVE_ID), if readable
    orphan: bool = False  # an sglang child whose launcher is gone
    supervisor: int | None = None  # the pid of the live sm120kit it runs under (a supervisor): not stale

    def as_json(self) -> dict:
        return {
            "pid": self.pid,
            "title": self.title,
            "ppid": self.ppid,
            "started": self.started,
            "user": self.user,
            "run": self.marker,
            "orphan": self.orphan,
            "supervisor": self.supervisor,
        }

    def line(self) -> str:
        age = clock.age(time.time() - self.started)
        orphan = ", orphaned: its launcher is gone" if self.orphan else ""
        supervised = f", supervised by sm120kit pid {self.supervisor}" if self.supervisor else ""
        return f"pid {self.pid} {self.title!r} (user {self.user}, up {age}{orphan}{supervised})"


SECRET_FLAGS = ("--api-key", "--admin-api-key")


def _title(cmdline: list[str], name: str) -> str:
    """The command line as `ps` shows it, shortened, with API keys masked."""
    if not cmdline:
        return name
    words = list(cmdline)
    for i, word in enumerate(words):
        if word in SECRET_FLAGS and i + 1 < len(words):
            words[i + 1] = "***"
        elif word.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            words[i] = word.split("=", 1)[0] + "=***"
    # setproctitle pads argv's memory: with NULs (empty words) or, on some systems, spaces
    return " ".join(w.strip() for w in words if w.strip())[:120]


def _is_sglang(cmdline: list[str], name: str) -> bool:
    first = cmdline[0] if cmdline else ""
    if first.startswith("sglang::") or name.startswith("sglang::"):
        return True  # sglang's setproctitle names: sglang::scheduler_TP0, sglang::detokenizer, ...
    joined = " ".join(cmdline[:4])
    console_script = [os.path.basename(w) for w in cmdline[1:3]] == ["sglang", "serve"]  # python .../bin/sglang serve
    return any(word in joined for word in SGLANG_CMDLINE) or console_script


def _is_sm120kit(cmdline: list[str]) -> bool:
    """An sm120kit process: `sm120kit ...` (its console script, run or through its python),
    `python -m sm120kit ...`, a fleet member's `python -m sm120kit.fleet.member DIR`. Only
    serve's supervisors (a fleet member's, bench's) start sglang processes."""
    for i, word in enumerate(cmdline[:3]):
        if i < 2 and os.path.basename(word) == "sm120kit":
            return True
        if i and cmdline[i - 1] == "-m" and (word == "sm120kit" or word.startswith("sm120kit.")):
            return True
    return False


def _sm120kit_above(info: dict, by_pid: dict[int, dict]) -> int | None:
    """The pid of the nearest live sm120kit process among a process's ancestors."""
    pid, seen = info["ppid"], set()
    while pid and pid in by_pid and pid not in seen:
        seen.add(pid)
        if _is_sm120kit(by_pid[pid]["cmdline"] or []):
            return pid
        pid = by_pid[pid]["ppid"]
    return None


def _mine_to_skip() -> set[int]:
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def _in_scope(every: list[psutil.Process]) -> list[psutil.Process]:
    """The processes under $SM120KIT_PROCESS_SCOPE (all of them when it is not set)."""
    root = os.environ.get(SCOPE, "")
    if not root.isdigit():
        return every
    parent = {p.info["pid"]: p.info["ppid"] for p in every}
    inside = {int(root)}

    def under(pid: int) -> bool:
        seen = set()
        while pid not in inside and pid in parent and pid not in seen:
            seen.add(pid)
            pid = parent[pid]
        return pid in inside

    return [p for p in every if under(p.info["pid"])]


def scan(marker: str | None = None, sglang: bool = False) -> list[Proc]:
    """Live processes that carry our marker (any value when marker is "", that value
    otherwise) and, with sglang=True, any that look like an sglang server process.
    Zombies are not counted: they hold no memory and no port."""
    skip = _mine_to_skip()
    found = []
    attrs = ["pid", "ppid", "name", "cmdline", "create_time", "username", "status"]
    every = list(psutil.process_iter(attrs))
    by_pid = {p.info["pid"]: p.info for p in every}
    for proc in _in_scope(every):
        info = proc.info
        if info["pid"] in skip or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline, name = info["cmdline"] or [], info["name"] or ""
        named = sglang and _is_sglang(cmdline, name)
        value = _marker_of(proc) if named or marker is not None else None
        if named or (value is not None and marker is not None and marker in ("", value)):
            # under a live sm120kit (a fleet member's supervisor over its router, a serve over its
            # launcher and schedulers, the subreaper that adopted what a launcher left): supervised
            supervisor = _sm120kit_above(info, by_pid)
            orphan = named and supervisor is None and _orphaned(info, by_pid.get(info["ppid"]))
            found.append(
                Proc(
                    info["pid"],
                    _title(cmdline, name),
                    info["ppid"] or 0,
                    info["create_time"] or 0.0,
                    info["username"] or "?",
                    value,
                    orphan,
                    supervisor,
                )
            )
    return found


def _orphaned(child: dict, parent: dict | None) -> bool:
    """Whether an sglang child (`sglang::scheduler_TP0`, its setproctitle name) lost its
    launcher: it was re-parented to PID 1 or to a subreaper, which is neither an sglang
    process nor in the child's process group (the launcher's children share its group).
    A launcher itself is never orphaned, whoever its parent is."""
    if not (child["cmdline"] or [""])[0].startswith("sglang::") and not (child["name"] or "").startswith("sglang::"):
        return False
    if parent is None:
        return True
    if _is_sglang(parent["cmdline"] or [], parent["name"] or ""):
        return False  # its launcher (or sglang's data-parallel controller)
    try:
        return os.getpgid(child["pid"]) != os.getpgid(parent["pid"])
    except OSError:  # one of them is gone: look again next time
        return False


def _marker_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(MARKER)
    except (psutil.Error, OSError):
        return None


def ancestors(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).parents()}
    except psutil.Error:
        return set()


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) == pgid:
                members.append(proc.info["pid"])
        except (ProcessLookupError, PermissionError):
            pass
    return members


@dataclass
class StopReport:
    processes: int = 0  # how many there were when the stop began
    killed: list[int] = field(default_factory=list)  # needed SIGKILL
    left: list[Proc] = field(default_factory=list)  # still there after SIGKILL
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.left

    def as_json(self) -> dict:
        return {
            "processes": self.processes,
            "sigkilled": self.killed,
            "left": [p.as_json() for p in self.left],
            "seconds": round(self.seconds, 3),
        }


def _send(pgid: int | None, pids: set[int], sig: int) -> None:
    if pgid:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait(pids: set[int], until: float, hurry: Callable[[], bool], tick: float) -> set[int]:
    alive = _alive(pids)
    while alive and time.monotonic() < until and not hurry():
        time.sleep(tick)
        reap()
        alive = _alive(alive)
    return alive


class Tree:
    """The processes of this supervisor's runs: its descendants now (orphans of a run are
    re-parented to it, a subreaper) and every one seen in an earlier sample, by pid and
    start time (a pid reused since by another process is not ours)."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def sample(self) -> set[int]:
        """The live descendants, remembered."""
        now = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    self.seen[p.pid] = p.create_time()
                    now.add(p.pid)
            except psutil.Error:
                pass
        return now

    def alive(self) -> set[int]:
        """Every live process that is or was in the tree."""
        found = self.sample()
        for pid, started in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    found.add(pid)
            except psutil.Error:
                pass
        return found


def members(pgid: int | None, tree: Tree | None) -> set[int]:
    """The live processes of a run: its process group, and its tree as sampled."""
    pids = set(group_members(pgid)) if pgid else set()
    return pids | tree.alive() if tree else pids


def describe(pids: set[int]) -> list[Proc]:
    found = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                found.append(Proc(pid, _title(p.cmdline(), p.name()), p.ppid(), p.create_time(), p.username()))
        except psutil.Error:
            pass
    return found


def stop(
    pgid: int | None,
    tree: Tree | None,
    timeout: float,
    hurry: Callable[[], bool] = lambda: False,
    tick: float = 0.02,
    pids: Collection[int] = frozenset(),
    drain: bool = False,
) -> StopReport:
    """Stop a run: its process group, its tree (those that left the group) and `pids`.
    SIGTERM, up to `timeout` (or until hurry() says so), SIGKILL, then one more look for a
    process started or orphaned meanwhile. Reaps as it goes.

    With drain, the group leader (sglang's launcher) gets SIGTERM alone first: it drains
    in-flight requests and then kills its own tree. Its schedulers have no SIGTERM handler,
    so signalling them at once would cut the drain short. If the leader is not done by the
    deadline, the rest get SIGTERM; they get at least GROUP_GRACE_S after the leader before SIGKILL."""
    began = time.monotonic()
    pids = members(pgid, tree) | set(pids)
    report = StopReport(processes=len(pids))
    deadline = began + timeout
    if drain and pgid:
        _send(None, {pgid}, signal.SIGTERM)
        _wait({pgid}, deadline, hurry, tick)
        # The rest get their grace after the leader, done or not: a leader that drained up
        # to the deadline has just SIGKILLed its tree, which takes a moment to go.
        deadline = max(deadline, time.monotonic() + GROUP_GRACE_S)
    alive = _alive(pids)
    if alive and not hurry():
        _send(pgid, alive, signal.SIGTERM)
        alive = _wait(alive, deadline, hurry, tick)
    if alive:
        report.killed = sorted(alive)
        _send(pgid, alive, signal.SIGKILL)
        alive = _wait(alive, time.monotonic() + 5, lambda: False, tick)
    late = members(pgid, tree) - alive
    if late:
        _send(None, late, signal.SIGKILL)
        report.killed += sorted(late)
        alive |= _wait(late, time.monotonic() + 5, lambda: False, tick)
    reap()
    report.left = describe(alive)
    report.seconds = time.monotonic() - began
    return report


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind host:port now (as sglang's own check binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def port_holder(port: int) -> str:
    """ "pid 123 'python ...'" of the process listening on the port, where we may see it."""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    proc = psutil.Process(conn.pid)
                    return f"pid {conn.pid} {_title(proc.cmdline(), proc.name())!r}"
                except psutil.Error:
                    return f"pid {conn.pid}"
    except (psutil.AccessDenied, OSError):
        pass
    return "another process"
