"""What a server start needs from the node: its API key in the environment, no stale
sglang process holding the GPUs, and every port it will bind free. Nothing here changes
the node, except the stale-process check with kill_stale (--kill-stale), which stops the
stale processes it found and says which. The processes and the run records come from the
caller (CheckInputs.processes and .runs): serve's, which node does not import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.endpoint import bad_key_char
from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.registry import CheckInputs
    from sm120kit.profiles.model import Profile

ZMQ_TCP_PORT_DELTA = 233  # sglang server_args.py: dp-attention's ZMQ ports sit at --port + 233
DP_ATTENTION_PORTS = 6  # dist_init_port, port_base, detokenizer, rpc, metrics, scheduler input
STALE_STOP_TIMEOUT_S = 10.0
MIN_KEY_LENGTH = 8  # shorter is no secret, and its text would turn up all over the log that sm120kit redacts


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


def ports(inputs) -> Check:  # (inputs.processes is serve's procs module: typed in a later pass)
    procs = inputs.processes
    plan = port_plan(inputs.profile)
    taken = []
    for what, host, port in plan:
        try:
            if procs.port_in_use(host, port):
                taken.append(f"{port} ({what}) is held by {procs.port_holder(port)}")
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
            "stop that process, or pick another port: --set server.port=N",
        )
    return Check("ports", Status.OK, "free: " + ", ".join(str(port) for _, _, port in plan))


def stale_processes(inputs) -> Check:  # (as ports)
    """sglang processes left from an earlier run: ours (the marker) whose supervisor is
    gone, and orphans (a scheduler whose launcher died: re-parented to PID 1 or to some
    subreaper). A healthy server someone else started is named and left alone; so is one
    whose supervisor lives: a run recorded here, or a live sm120kit as its parent (a fleet's
    router under its member supervisor, served from another state directory)."""
    procs = inputs.processes
    records = inputs.runs()
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
    supervised = [p for p in unrecorded if getattr(p, "supervisor", None)]
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
