"""A systemd unit that runs `sm120kit serve PROFILE`: the patch step before it, a stop that
lets serve drain sglang and prove the stop, restarts of the supervisor bounded above its
own crash-loop limit, the limits `doctor` wants, the API key from an EnvironmentFile.

`systemd-analyze verify` passes every unit rendered from a shipped profile
(tests/test_deploy_systemd.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sm120kit.deploy import START_BURST, Deployment, give_up_floor_s, seconds, stop_budget_s
from sm120kit.deploy.values import plain, unit_user
from sm120kit.errors import UserError
from sm120kit.node.checks.system import NOFILE_GOOD

# Type=exec: the unit has started once serve runs; TimeoutStartSec bounds what comes before
# (the patch step: a transaction over a few files of sglang and flashinfer, seconds) and the
# exec. The load, up to health.startup_timeout_s, is serve's to watch, not systemd's.
START_TIMEOUT_S = 300
SAFE_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


@dataclass(frozen=True)
class UnitOptions:
    exe: tuple[str, ...]  # how the unit runs sm120kit: its absolute path (or python -m sm120kit)
    user_unit: bool = False  # --user: a unit of the user's own manager
    unit_user: str | None = None  # User= of a system unit
    env_file: str | None = None  # EnvironmentFile=: the API key (and anything else secret)
    state_dir: str | None = None  # Environment=SM120KIT_STATE_DIR


def unit_name(d: Deployment) -> str:
    return f"{d.name}.service"


def default_env_file(d: Deployment, user_unit: bool) -> str:
    return f"%h/.config/sm120kit/{d.profile.name}.env" if user_unit else f"/etc/sm120kit/{d.profile.name}.env"


def render_unit(d: Deployment, o: UnitOptions) -> str:
    """The unit's text."""
    if o.user_unit and o.unit_user:
        raise UserError(
            "--unit-user sets User= of a system unit; a --user unit runs as the user whose manager runs it",
            "drop --unit-user, or render a system unit (without --user)",
        )
    if o.unit_user is not None:
        unit_user(o.unit_user)  # User=root;rm -rf / is not a user: systemd refuses the unit
    plain("--env-file", o.env_file)  # written as it is: a newline would start a directive
    p, h, s = d.profile, d.profile.health, d.profile.server
    exe = list(o.exe)
    name = unit_name(d)
    key = s.api_key_env
    env_file = o.env_file or (default_env_file(d, o.user_unit) if key else None)
    restart_s = h.backoff_max_s
    # systemd refuses a start when START_BURST came within the window before it: the window
    # must hold START_BURST + 1 of serve's fastest crash loops, or the last start always falls out
    window_s = (START_BURST + 1) * (give_up_floor_s(p) + restart_s)
    manager, scope, target = ("systemctl --user", "~/.config/systemd/user", "default.target")
    if not o.user_unit:
        manager, scope, target = ("sudo systemctl", "/etc/systemd/system", "multi-user.target")
    what = p.description or (p.model.served_name or p.model.path or p.name)
    what = " ".join(what.split()).replace("%", "%%")  # one line (a newline would start a directive), no specifier

    lines = [
        f"# {name}: `sm120kit serve {d.ref}` under systemd (`sm120kit render systemd`).",
        f"# Install it as {scope}/{name}, then:",
        f"#   {manager} daemon-reload && {manager} enable --now {name}",
        f"#   journalctl {'--user ' if o.user_unit else ''}-u {name} -f   # serve's output and the server's log",
    ]
    if o.user_unit:
        lines.append("# At boot without a login session: loginctl enable-linger $USER")
    lines += [
        "",
        "[Unit]",
        f"Description=sm120kit serve {p.name}: {what}",
        *([] if o.user_unit else ["Wants=network-online.target", "After=network-online.target"]),
        f"# serve restarts sglang itself (health.max_restarts = {h.max_restarts} in a row, then it exits 1);",
        f"# systemd restarts serve: at most {START_BURST} starts in {seconds(window_s)} s, room for "
        f"{START_BURST + 1} of its fastest crash loops",
        f"# back to back ({seconds(give_up_floor_s(p))} s of backoff each + RestartSec); a slower loop (a long load "
        "before each death) restarts on.",
        f"StartLimitIntervalSec={seconds(window_s)}",
        f"StartLimitBurst={START_BURST}",
        "",
        "[Service]",
        "Type=exec",
    ]
    if o.unit_user:
        lines += [
            "# It owns the serving environment: the patch step writes to its site-packages.",
            f"User={o.unit_user}",
        ]
    if o.state_dir:
        lines.append(f"Environment={_word('SM120KIT_STATE_DIR=' + o.state_dir, dollar=False)}")
    if env_file:
        holds = f"{key}=... (the API key, server.api_key_env)" if key else "NAME=value lines"
        path = env_file if env_file == default_env_file(d, o.user_unit) else env_file.replace("%", "%%")
        lines += [f"# {holds}; mode 0600: never in this file", f"EnvironmentFile={path}"]
    patch = d.patch_argv(exe)
    if patch is None:
        lines.append(f"# profile {p.name} needs no patches: no patch step")
    else:
        lines += [
            "# Re-apply the profile's patches if an upgrade lost them, and prove them (else: no start).",
            f"ExecStartPre={_command(patch)}",
        ]
    lines += [
        f"ExecStart={_command(d.serve_argv(exe))}",
        "# The start ends when serve runs; the load (health.startup_timeout_s = "
        f"{seconds(h.startup_timeout_s)} s) is serve's to watch.",
        f"TimeoutStartSec={START_TIMEOUT_S}",
        "# SIGTERM to serve alone, which drains sglang, stops it and proves the stop; SIGKILL to what is",
        f"# left after health.stop_timeout_s = {seconds(h.stop_timeout_s)} s + 45 s"
        + (" (router, then replicas)." if p.fleet is not None else "."),
        "KillMode=mixed",
        f"TimeoutStopSec={stop_budget_s(p)}",
        "Restart=on-failure",
        f"RestartSec={seconds(restart_s)}",
        "# exit 2: serve refused (bad input, a failed preflight such as a missing key): no restart mends that",
        "RestartPreventExitStatus=2",
        "# As `sm120kit doctor` wants them"
        + (" (a user manager raises them as far as its own hard limits allow)." if o.user_unit else "."),
        f"LimitNOFILE={NOFILE_GOOD}",
        "LimitMEMLOCK=infinity",
        "# serve echoes the server's log: the journal; the run directory keeps server.log and events.",
        "StandardOutput=journal",
        "StandardError=journal",
        f"SyslogIdentifier={d.name}",
        "",
        "[Install]",
        f"WantedBy={target}",
    ]
    return "\n".join(lines) + "\n"


def _word(word: str, dollar: bool = True) -> str:
    """One word of a unit's command line: `%` and `$` escaped (no specifier or variable is
    meant), quoted when it holds anything but the plain characters. dollar=False for
    Environment=, where `$` means nothing (systemd.exec) and `$$` would stay two."""
    word = word.replace("%", "%%").replace("$", "$$") if dollar else word.replace("%", "%%")
    if SAFE_WORD.fullmatch(word.replace("%%", "").replace("$$", "")):
        return word
    quoted = word.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    # any other control character as \xNN: a bare carriage return ends the line for systemd
    quoted = re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", quoted)
    return f'"{quoted}"'  # systemd reads C escapes inside quotes: a newline stays in the word


def _command(argv: list[str]) -> str:
    """A command line, one option (with its value) a line: a backslash continues it."""
    lines: list[str] = []
    for word in map(_word, argv):
        if word.startswith("--") or not lines:
            lines.append(word)
        elif lines[-1].startswith("--") and " " not in lines[-1]:
            lines[-1] += " " + word
        elif len(lines) == 1 and not lines[0].startswith("--"):
            lines[0] += " " + word
        else:
            lines.append(word)
    return " \\\n    ".join(lines)
