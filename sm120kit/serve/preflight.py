"""Before a start: is this node ready for the profile? Each check returns a Check; the
caller refuses to start while any check failed. Nothing here changes the node, except
--kill-stale, which stops the stale sglang processes it found (and says which)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sm120kit.profiles.model import Profile
from sm120kit.serve import gpus as gpu_info
from sm120kit.serve import procs

ZMQ_TCP_PORT_DELTA = 233  # sglang server_args.py: dp-attention's ZMQ ports sit at --port + 233
DP_ATTENTION_PORTS = 6  # dist_init_port, port_base, detokenizer, rpc, metrics, scheduler input
STALE_STOP_TIMEOUT_S = 10.0


@dataclass
class Check:
    name: str
    ok: bool | None  # None: could not check (a warning, not a refusal)
    detail: str
    hint: str = ""

    def as_json(self) -> dict:
        return {"check": self.name, "ok": self.ok, "detail": self.detail, "hint": self.hint}


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
        plan.append(
            (
                "parallel.dist_init_addr",
                "0.0.0.0",
                _port(p.dist_init_addr.rsplit(":", 1)[1], "parallel.dist_init_addr", profile),
            )
        )
    return plan


def _port(value, key: str, profile: Profile) -> int:
    from sm120kit.errors import UserError

    text = str(value)
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UserError(
            f"profile {profile.name} ({profile.source}): {key} = {value!r} is not a port (1-65535)",
            f"fix {key} in the profile, or override it with --set",
        )
    return int(text)


def check_ports(plan: list[tuple[str, str, int]]) -> Check:
    taken = []
    for what, host, port in plan:
        try:
            if procs.port_in_use(host, port):
                taken.append(f"{port} ({what}) is held by {procs.port_holder(port)}")
        except OSError as exc:
            return Check(
                "ports",
                False,
                f"cannot bind {host}:{port} ({what}): {exc.strerror}",
                "check server.host in the profile",
            )
    if taken:
        return Check(
            "ports",
            False,
            "in use: " + "; ".join(taken),
            "stop that process, or pick another port: --set server.port=N",
        )
    return Check("ports", True, "free: " + ", ".join(str(port) for _, _, port in plan))


def check_patches(
    profile: Profile, target, patch_dirs: list[str] | None, allow_missing: frozenset[str] = frozenset()
) -> Check:
    from sm120kit.patching import engine
    from sm120kit.patching.registry import load_patches, select

    if not profile.patches:
        return Check("patches", True, "the profile needs none")
    patches = load_patches(patch_dirs)
    select(patches, sorted(allow_missing), "--allow-missing")
    plan = engine.plan(target, select(patches, profile.patches), need_bytes=False, allow_missing=allow_missing)
    code = plan.exit_code(check=True)
    notes = [f"{f.patch.id}: {f.unproven}" for f in plan.unproven]
    notes += [
        f"{f.patch.id}: anchor-missing on {f.patch.package} {f.version}, allowed (--allow-missing)"
        for f in plan.findings
        if f.allowed
    ]
    note = "".join(f"; {n}" for n in dict.fromkeys(notes))
    if code == 0:
        return Check("patches", True, f"{len(profile.patches)} in place, fixed upstream or not needed{note}")
    drift = sorted(
        {
            f"{f.patch.id}: {f.outcome.value}" + (f" ({f.detail})" if f.detail and code == 2 else "")
            for f in plan.errors + plan.pending
        }
    )
    drift += [problem.splitlines()[0] for problem in plan.blockers]
    hints = list(dict.fromkeys(f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint))
    hint = (
        "; ".join(hints)
        if hints
        else "run `sm120kit patch --verify`"
        if code == 1
        else "run `sm120kit status` for the details"
    )
    return Check(
        "patches", False, "not in place: " + "; ".join(drift), hint + " (or start anyway with --no-patch-check)"
    )


def check_gpus(profile: Profile, env: dict[str, str]) -> Check:
    """Count, compute capability and free memory of the GPUs the server will see."""
    need = profile.node.gpus
    try:
        found = gpu_info.visible(gpu_info.read_gpus(), env)
    except gpu_info.NvmlUnavailable as exc:  # doctor fails the node for the same reason: so does the preflight
        return Check(
            "gpus",
            False,
            f"cannot tell whether the {need} GPU{'s' * (need != 1)} the profile needs {'are' if need != 1 else 'is'} here: {exc}",
            "install the NVIDIA driver (570 or newer for Blackwell) and check `nvidia-smi`; or --no-gpu-check to start anyway",
        )
    problems = []
    if len(found) < need:
        problems.append(f"the profile needs {need} GPUs; {len(found)} visible")
    want_cc = profile.node.compute_capability
    wrong = [g for g in found[:need] if want_cc and g.capability != want_cc]
    if wrong:
        problems.append(
            f"the profile is for compute capability {want_cc}; "
            + ", ".join(f"GPU {g.index} ({g.name}) is {g.capability}" for g in wrong)
        )
    fraction = profile.engine.mem_fraction_static or 0.8
    for g in found[:need]:
        if g.free < fraction * g.total:
            holders = (
                ", ".join(f"pid {pid} ({used // gpu_info.MIB} MiB)" for pid, used in g.processes.items())
                or "no process NVML can name"
            )
            problems.append(
                f"GPU {g.index} has {g.free // gpu_info.MIB} of {g.total // gpu_info.MIB} MiB free, below {fraction:g} of it; held by {holders}"
            )
    if problems:
        return Check(
            "gpus",
            False,
            "; ".join(problems),
            "free the GPUs (stale processes: --kill-stale), or --no-gpu-check to start anyway",
        )
    names = sorted({g.name for g in found[:need]})
    return Check(
        "gpus",
        True,
        f"{need} x {', '.join(names)} (compute capability {found[0].capability if found else '?'}), memory free",
    )


def check_stale(kill: bool, timeout: float = STALE_STOP_TIMEOUT_S) -> Check:
    """sglang processes left from an earlier run: ours (the marker) whose supervisor is
    gone, and orphans (a scheduler whose launcher died: re-parented to PID 1 or to some
    subreaper). A healthy server someone else started is named and left alone."""
    from sm120kit.serve.rundir import runs

    records = runs()
    serving = [r for r in records if r["running"]]  # profiles sm120kit serves right now
    live, supervisors = {r["marker"] for r in serving if r.get("marker")}, {r.get("supervisor_pid") for r in serving}
    # Ours and over: a run recorded here whose supervisor is gone. A marker this state
    # directory does not know (another user's, another SM120KIT_STATE_DIR) proves nothing:
    # such a process is judged like any other, by the orphan rule.
    ended = {r["marker"] for r in records if not r["running"] and r.get("marker")}
    found = [
        p
        for p in procs.scan(marker="", sglang=True)
        if (p.marker is None or p.marker not in live) and not procs.ancestors(p.pid) & supervisors
    ]
    stale = [p for p in found if p.marker in ended or p.orphan]
    others = [p for p in found if p not in stale]
    note = (
        f"; another sglang server, not started by sm120kit, left alone: {'; '.join(p.line() for p in others)}"
        if others
        else ""
    )
    if not stale:
        return Check("stale processes", None if others else True, "none" + note)
    listing = "; ".join(p.line() for p in stale)
    if not kill:
        return Check(
            "stale processes",
            False,
            f"{len(stale)} found: {listing}{note}",
            "stop them yourself, or rerun with --kill-stale",
        )
    report = procs.stop(None, None, timeout, pids={p.pid for p in stale})
    if report.left:
        return Check(
            "stale processes",
            False,
            "could not stop: " + "; ".join(p.line() for p in report.left),
            "they may belong to another user: ask root to stop them",
        )
    return Check("stale processes", True, f"stopped {len(stale)}: {listing}{note}")


MIN_KEY_LENGTH = 8  # shorter is no secret, and its text would turn up all over the log that sm120kit redacts
KEY_CHAR_NAMES = {"\r": "a carriage return", "\n": "a newline", " ": "a space", "\t": "a tab"}


def bad_key_char(key: str) -> str | None:
    """Where and what the first character is that has no place in a bearer token (one word
    of printable ASCII): "ends with a carriage return". A key file written on another OS
    ends in \\r\\n, and a header with it made the probe raise, the key in its message."""
    for i, char in enumerate(key):
        if "!" <= char <= "~":
            continue
        what = KEY_CHAR_NAMES.get(char) or ("a non-ASCII character" if ord(char) > 0x7F else "a control character")
        where = "starts with" if i == 0 else "ends with" if i == len(key) - 1 or key[i:].strip() == "" else "contains"
        return f"{where} {what}"
    return None


def check_api_key(profile: Profile, env: dict[str, str]) -> Check | None:
    name = profile.server.api_key_env
    if not name:
        return None
    key = env.get(name)
    if not key:
        return Check(
            "api key",
            False,
            f"server.api_key_env = {name}, but ${name} is empty or not set",
            f"export {name}=<the key> before `sm120kit serve`",
        )
    if len(key) < MIN_KEY_LENGTH:
        return Check(
            "api key",
            False,
            f"${name} is {len(key)} character{'s' * (len(key) != 1)} long: a key needs at least {MIN_KEY_LENGTH} to be a secret",
            f'use a long random key, e.g. export {name}="$(openssl rand -hex 24)"',
        )
    if bad := bad_key_char(key):
        return Check(
            "api key",
            False,
            f"${name} {bad}"
            + (" (a key file written on another OS?)" if "new" in bad or "return" in bad else "")
            + ": a key is one word of printable ASCII",
            f"set it to the key alone, e.g. export {name}=\"$(tr -d ' \\t\\r\\n' < KEYFILE)\"",
        )
    return Check("api key", True, f"taken from ${name} (never printed)")


def run(
    profile: Profile,
    target,
    env: dict[str, str],
    *,
    patch_dirs=None,
    patch_check=True,
    gpu_check=True,
    kill_stale=False,
    allow_missing=frozenset(),
) -> list[Check]:
    checks = []
    if api := check_api_key(profile, env):
        checks.append(api)
    if patch_check:
        checks.append(check_patches(profile, target, patch_dirs, allow_missing))
    else:
        checks.append(Check("patches", None, "not checked (--no-patch-check)"))
    checks.append(check_stale(kill_stale))
    if gpu_check:
        checks.append(check_gpus(profile, env))
    else:
        checks.append(Check("gpus", None, "not checked (--no-gpu-check)"))
    checks.append(check_ports(port_plan(profile)))
    return checks


def server_env(profile_env: dict[str, str]) -> dict[str, str]:
    """The server's environment: ours, with the profile's on top."""
    return {**os.environ, **profile_env}
