"""What a server start needs from the node: its API key in the environment, no stale
sglang process holding the GPUs, and every port it will bind free; and of the profile
alone, that no two of those ports are the same (port_clash). Nothing here changes
the node, except the stale-process check with kill_stale (--kill-stale), which stops the
stale processes it found and says which. The processes and the run records come from the
caller (CheckInputs.processes and .runs): serve's, which node does not import."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from sm120kit.endpoint import bad_key_char
from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs
    from sm120kit.profiles.model import Profile

ZMQ_TCP_PORT_DELTA = 233  # sglang server_args.py: dp-attention's ZMQ ports sit at --port + 233
DP_ATTENTION_PORTS = 6  # dist_init_port, port_base, detokenizer, rpc, metrics, scheduler input
STALE_STOP_TIMEOUT_S = 10.0
MIN_KEY_LENGTH = 8  # shorter is no secret, and its text would turn up all over the log that sm120kit redacts
METRICS_FIX = {  # how a command was told the metrics port, and how to give it another
    "--metrics-port": "give the metrics a port of their own: `sm120kit serve --metrics-port N`",
    "server.metrics_port": "give the metrics a port of their own (server.metrics_port in the profile); try one: "
    "`sm120kit profile check --set server.metrics_port=N`",
}
PORT_FIX = "give each a port of its own (in the profile); try one: `sm120kit profile check --set server.port=N`"

Given = TypeVar("Given")


def port_plan(profile: Profile) -> list[tuple[str, str, int]]:
    """(what, host, port) for every TCP port the server will bind, from --port as sglang
    derives them (PortArgs.init_new): the HTTP port; --nccl-port when the profile fixes it;
    with --enable-dp-attention on one node, port+233 and the five after it; on rank 0 of a
    multi-node server, the --dist-init-addr port."""
    s, p, extra = profile.server, profile.parallel, profile.extra_args
    plan = [("server.port", s.host, s.port)]
    if extra.get("--nccl-port") not in (None, False, True):
        plan.append(("--nccl-port", "127.0.0.1", _port(extra["--nccl-port"], 'extra_args."--nccl-port"', profile)))
    if extra.get("--enable-dp-attention") and p.nnodes == 1 and not p.dist_init_addr:
        base = s.port + ZMQ_TCP_PORT_DELTA
        base = base if base + DP_ATTENTION_PORTS <= 65535 else s.port - ZMQ_TCP_PORT_DELTA
        plan += [("dp-attention (--port + 233)", "127.0.0.1", base + i) for i in range(DP_ATTENTION_PORTS)]
    if p.nnodes > 1 and p.node_rank == 0 and p.dist_init_addr and ":" in p.dist_init_addr:
        rendezvous = _port(p.dist_init_addr.rsplit(":", 1)[1], "parallel.dist_init_addr", profile)
        plan.append(("parallel.dist_init_addr", "0.0.0.0", rendezvous))
    return plan


def _port(value: object, key: str, profile: Profile) -> int:
    text = str(value)
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UserError(
            f"profile {profile.name} ({profile.source}): {key} = {value!r} is not a port (1-65535)",
            f"fix {key} in the profile, or override it with --set",
        )
    return int(text)


def supervisor_ports(inputs: CheckInputs) -> list[tuple[str, str, int]]:
    """(what, host, port) of what the supervisor binds beside the server: its metrics."""
    if inputs.metrics_port is None or inputs.profile is None:
        return []
    return [(inputs.metrics_from, inputs.profile.server.host, inputs.metrics_port)]


def port_clash(inputs: CheckInputs) -> Check | None:
    """The ports the profile asks for, each its own (distinct_ports)."""
    if inputs.profile is None:
        return None
    return distinct_ports(inputs.profile, inputs.metrics_port, inputs.metrics_from)


def distinct_ports(
    profile: Profile, metrics_port: int | None, metrics_from: str = "server.metrics_port"
) -> Check | None:
    """The server's ports (port_plan) and the supervisor's metrics port, each its own. A
    property of the profile, not of the node: every command that judges a launch runs it
    (serve, its dry run, profile check, bench's plan, doctor, render), as a clash fails every
    start. None for a fleet (its plan checks its own ports), or where one port is all there is."""
    if profile.fleet is not None:
        return None
    metrics = [(metrics_from, profile.server.host, metrics_port)] if metrics_port is not None else []
    planned = [*port_plan(profile), *metrics]
    if len(planned) < 2:
        return None
    owner: dict[int, str] = {}
    clashes, of_metrics = [], False
    for what, _, port in planned:
        if port not in owner:
            owner[port] = what
        elif what == metrics_from:
            of_metrics = True
            clashes.append(f"{what} {port} is the server's too ({owner[port]})")
        else:
            clashes.append(f"{port} ({what}) is {owner[port]}'s too")
    if clashes:
        fix = METRICS_FIX.get(metrics_from, METRICS_FIX["--metrics-port"]) if of_metrics else PORT_FIX
        return Check("port plan", Status.FAIL, "; ".join(clashes), fix)
    return Check("port plan", Status.OK, "each its own: " + ", ".join(f"{p} ({what})" for what, _, p in planned))


def given(value: Given | None, field: str) -> Given:
    """What the command that runs a check must hand it (CheckInputs.processes, .runs): without
    it the check cannot look, and that is the command's bug, not a finding about the node."""
    if value is None:
        raise TypeError(f"CheckInputs.{field} was not given: the command that runs this check must pass it")
    return value


def ports(inputs: CheckInputs) -> Check | None:
    """None without a profile: no ports to look at (doctor without --profile)."""
    if inputs.profile is None:
        return None
    procs = given(inputs.processes, "processes")
    plan = [*port_plan(inputs.profile), *supervisor_ports(inputs)]
    taken, metrics = [], False
    for what, host, port in plan:
        try:
            if procs.port_in_use(host, port):
                taken.append(f"{port} ({what}) is held by {procs.port_holder(port)}")
                metrics = metrics or what == inputs.metrics_from
        except OSError as exc:
            return Check(
                "ports",
                Status.FAIL,
                f"cannot bind {host}:{port} ({what}): {exc.strerror}",
                "check server.host in the profile",
            )
    if taken:
        return Check(
            "ports",
            Status.FAIL,
            "in use: " + "; ".join(taken),
            "stop that process, or pick another port: --set server.port=N"
            + (f"; {METRICS_FIX.get(inputs.metrics_from, METRICS_FIX['--metrics-port'])}" if metrics else ""),
        )
    return Check("ports", Status.OK, "free: " + ", ".join(str(port) for _, _, port in plan))


def stale_processes(inputs: CheckInputs) -> Check:
    """sglang processes left from an earlier run: ours (the marker) whose supervisor is
    gone, and orphans (a scheduler whose launcher died: re-parented to PID 1 or to some
    subreaper). A healthy server someone else started is named and left alone; so is one
    whose supervisor lives: a run recorded here, or a live sm120kit as its parent (a fleet's
    router under its member supervisor, served from another state directory)."""
    procs = given(inputs.processes, "processes")
    records = given(inputs.runs, "runs")()
    serving = [r for r in records if r["running"]]  # profiles sm120kit serves right now
    live, supervisors = {r["marker"] for r in serving if r.get("marker")}, {r.get("supervisor_pid") for r in serving}
    # Ours and over: a run recorded here whose supervisor is gone. A marker this state
    # directory does not know (another user's, another SM120KIT_STATE_DIR) proves nothing:
    # such a process is judged like any other, by the orphan rule.
    ended = {r["marker"] for r in records if not r["running"] and r.get("marker")}
    unrecorded = [
        p
        for p in procs.scan(marker="", sglang=True)
        if (p.marker is None or p.marker not in live) and not procs.ancestors(p.pid) & supervisors
    ]
    supervised = [p for p in unrecorded if p.supervisor]
    found = [p for p in unrecorded if p not in supervised]
    stale = [p for p in found if p.marker in ended or p.orphan]
    others = [p for p in found if p not in stale]
    note = f"; another sglang server, not started by sm120kit, left alone: {'; '.join(p.line() for p in others)}"
    note = note if others else ""
    if supervised:  # another state directory's (another user's) serve or fleet
        note += f"; served by a live sm120kit, left alone: {'; '.join(p.line() for p in supervised)}"
    if not stale:
        return Check("stale processes", Status.INFO if others or supervised else Status.OK, "none" + note)
    listing = "; ".join(p.line() for p in stale)
    if not inputs.kill_stale:
        return Check(
            "stale processes",
            Status.FAIL,
            f"{len(stale)} found: {listing}{note}",
            "stop them yourself, or rerun with --kill-stale",
        )
    report = procs.stop(None, None, STALE_STOP_TIMEOUT_S, pids={p.pid for p in stale})
    if report.left:
        return Check(
            "stale processes",
            Status.FAIL,
            "could not stop: " + "; ".join(p.line() for p in report.left),
            "they may belong to another user: ask root to stop them",
        )
    return Check("stale processes", Status.OK, f"stopped {len(stale)}: {listing}{note}")


def api_key(inputs: CheckInputs) -> Check | None:
    """None when the profile names no key variable: nothing to check (serve's preflight, which
    always has a profile)."""
    name = inputs.profile.server.api_key_env if inputs.profile else None
    if not name:
        return None
    key = inputs.server_env.get(name)
    if not key:
        return Check(
            "api key",
            Status.FAIL,
            f"server.api_key_env = {name}, but ${name} is empty or not set",
            f"export {name}=<the key> before `sm120kit serve`",
        )
    if len(key) < MIN_KEY_LENGTH:
        return Check(
            "api key",
            Status.FAIL,
            f"${name} is {len(key)} character{'s' * (len(key) != 1)} long: "
            f"a key needs at least {MIN_KEY_LENGTH} to be a secret",
            f'use a long random key, e.g. export {name}="$(openssl rand -hex 24)"',
        )
    if bad := bad_key_char(key):
        return Check(
            "api key",
            Status.FAIL,
            f"${name} {bad}"
            + (" (a key file written on another OS?)" if "new" in bad or "return" in bad else "")
            + ": a key is one word of printable ASCII",
            f"set it to the key alone, e.g. export {name}=\"$(tr -d ' \\t\\r\\n' < KEYFILE)\"",
        )
    return Check("api key", Status.OK, f"taken from ${name} (never printed)")
