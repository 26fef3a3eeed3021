"""`sm120kit serve NAME`: one supervisor per profile (a lock in its run directory), the
preflight, then the supervisor in the foreground until a stop signal or the crash-loop
limit."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.profiles.render import EnvRef, Launch
from sm120kit.serve import preflight
from sm120kit.serve.probe import probe_host
from sm120kit.serve.rundir import ENV_VAR, Record, serve_root

MARKS = {True: "ok  ", False: "FAIL", None: "skip"}
KEY_FILE = "api-key.yaml"  # the API key for sglang's --config, in the private run directory


def print_checks(checks: list[preflight.Check], out=sys.stdout) -> None:
    for c in checks:
        out.write(
            f"  {MARKS[c.ok]} {c.name}: {c.detail}\n" + (f"       -> {c.hint}\n" if c.hint and c.ok is not True else "")
        )
    out.flush()


def resolve_argv(
    launch: Launch, env: dict[str, str], key_file: Path | None = None
) -> tuple[list[str], list[str], str | None]:
    """(argv to run, argv to show, api key): the key comes from the environment at launch.
    With key_file, the key goes into that YAML file (mode 0600) and sglang reads it with
    `--config` (every release 0.5.9+), so the process list shows a path, not the key."""
    key, i = None, -1
    argv, shown = [], []
    for a in launch.argv:
        if isinstance(a, EnvRef):
            key, i = (
                env.get(a.name, ""),
                len(argv),
            )  # its place, not a search for its text: "127.0.0.1" may be --host's too
            argv.append(key)
            shown.append(f"${a.name}")
        else:
            argv.append(a)
            shown.append(a)
    if key and key_file is not None and "--config" not in argv:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"api-key: {json.dumps(key)}\n")  # a JSON string is a YAML string
        argv[i - 1 : i + 1] = shown[i - 1 : i + 1] = ["--config", str(key_file)]
    return argv, shown, key


class SecretScrubbed(RuntimeError):
    """An error whose text, or that of an error chained to it, held the API key."""


def _mentions(exc: BaseException | None, secret: str) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if secret in str(exc) or any(secret in str(a) for a in exc.args):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def keep_secret(secret: str | None, name: str):
    """Re-raise an error that mentions the key without it (and without its chain), so that
    neither the "internal error" line nor the traceback of --debug ever carries the key."""
    try:
        yield
    except Exception as exc:
        if secret and _mentions(exc, secret):
            text = str(exc).replace(secret, name) if secret in str(exc) else str(exc)
            raise SecretScrubbed(
                f"{type(exc).__name__}: {text} (the original traceback mentioned the API key: withheld)"
            ) from None
        raise


def run_checks(profile, launch: Launch, target, args) -> tuple[list[preflight.Check], dict[str, str]]:
    env = preflight.server_env(launch.env)
    checks = [
        preflight.Check(
            "profile",
            True,
            f"renders for sglang {launch.sglang}"
            + (f" ({len(launch.warnings)} warning(s) above)" if launch.warnings else ""),
        )
    ]
    checks += preflight.run(
        profile,
        target,
        env,
        patch_dirs=args.patch_dir,
        patch_check=not args.no_patch_check,
        gpu_check=not args.no_gpu_check,
        kill_stale=args.kill_stale,
        allow_missing=frozenset(args.allow_missing),
    )
    return checks, env


def serve(profile, launch: Launch, target, args) -> int:
    """Exit codes: 0 stopped on request and clean; 1 gave up (crash-loop limit); 2 refused
    (preflight, bad input); 3 stopped, but a process or port of the server was left."""
    from filelock import FileLock, Timeout

    from sm120kit.serve.supervisor import Policy, Server, Supervisor

    directory = serve_root() / profile.name
    try:
        record = Record(directory)
        lock = FileLock(str(record.dir / "supervisor.lock"))
        lock.acquire(timeout=0)
    except Timeout:
        pid = record_pid(record)
        raise UserError(
            f"profile {profile.name} is already being served" + (f" by supervisor pid {pid}" if pid else ""),
            "`sm120kit ps` shows it; stop it with `kill -TERM <pid>` (or Ctrl-C in its terminal)",
        ) from None
    except OSError as exc:  # a full or read-only disk under the state directory
        raise UserError(
            f"cannot set up the run directory {directory}: {exc.strerror or exc}; nothing was started",
            f"free space there, or point ${ENV_VAR} at another disk",
        ) from None
    key_file = record.dir / KEY_FILE
    try:
        if key_file.exists() or key_file.is_symlink():
            key_file.unlink()  # only a supervisor killed with SIGKILL (no finally) leaves one
            print(f"removed the API key file that a killed supervisor left behind: {key_file}")
        for warning in launch.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"preflight for {profile.name} (sglang {launch.sglang}):")
        checks, env = run_checks(profile, launch, target, args)
        print_checks(checks)
        failed = [c for c in checks if c.ok is False]
        record.event("preflight", ok=not failed, checks=[c.as_json() for c in checks])
        if failed:
            print(
                f"sm120kit: refusing to start {profile.name}: {len(failed)} preflight check(s) failed (see above)",
                file=sys.stderr,
            )
            return 2
        try:
            argv, shown, key = resolve_argv(launch, env, key_file if _has_config_flag(target) else None)
        except OSError as exc:
            raise UserError(
                f"cannot write the API key file {key_file}: {exc.strerror or exc}; nothing was started",
                f"free space under {record.dir}, or point ${ENV_VAR} at another disk",
            ) from None
        server = Server(
            profile.name,
            argv,
            shown,
            env,
            probe_host(profile.server.host),
            profile.server.port,
            preflight.port_plan(profile),
            api_key=key,
            api_key_env=profile.server.api_key_env,
            check_gpus=not args.no_gpu_check,
        )
        with keep_secret(key, f"${profile.server.api_key_env}"):
            return Supervisor(server, Policy.from_health(profile.health), record, echo=not args.quiet).run()
    finally:
        key_file.unlink(missing_ok=True)
        lock.release()


def _has_config_flag(target) -> bool:
    from sm120kit.profiles.flags import read_schema

    dist = target.find("sglang")
    return dist is not None and read_schema(dist).get("--config") is not None


def record_pid(record: Record) -> int | None:
    try:
        return json.loads(record.state_file.read_text()).get("supervisor_pid")
    except (OSError, ValueError):
        return None
