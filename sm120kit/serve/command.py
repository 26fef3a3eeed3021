"""`sm120kit serve NAME`: one supervisor per profile (a lock in its run directory), the
preflight, then the supervisor in the foreground until a stop signal or the crash-loop
limit."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit import shallow_json
from sm120kit.endpoint import probe_host
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode
from sm120kit.profiles.render import EnvRef, Launch
from sm120kit.serve import preflight
from sm120kit.serve.options import ServeOptions
from sm120kit.serve.rundir import ENV_VAR, RunRecord, serve_root

if TYPE_CHECKING:
    from filelock import BaseFileLock

    from sm120kit.node.nvml_schema import Gpu
    from sm120kit.profiles.model import Profile
    from sm120kit.serve.metrics import Member, MetricsServer
    from sm120kit.target import Target

KEY_FILE = "api-key.yaml"  # the API key for sglang's --config, in the private run directory


def resolve_argv(
    launch: Launch, env: dict[str, str], key_file: Path | None = None
) -> tuple[list[str], list[str], str | None]:
    """(argv to run, argv to show, api key): the key comes from the environment at launch.
    With key_file, the key goes into that YAML file (mode 0600) and sglang reads it with
    `--config` (every release 0.5.9+), so the process list shows a path, not the key."""
    key, i = None, -1
    argv: list[str] = []
    shown: list[str] = []
    for a in launch.argv:
        if isinstance(a, EnvRef):
            key = env.get(a.name, "")
            i = len(argv)  # its place, not a search for its text: "127.0.0.1" may be --host's too
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
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if secret in str(exc) or any(secret in str(a) for a in exc.args):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def keep_secret(secret: str | None, name: str) -> Iterator[None]:
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


def serve(profile: Profile, launch: Launch, target: Target, options: ServeOptions, width: int | None) -> ExitCode:
    """OK: stopped on request and clean; FINDINGS: gave up (crash-loop limit); ERROR:
    refused (the preflight); UNCLEAN: stopped, but a process or port of the server was
    left. The preflight is shown fitted to width (None: one line per check)."""
    from sm120kit.node.checks.serving import port_plan
    from sm120kit.serve.machine import Policy, ServerSpec
    from sm120kit.serve.metrics import Member
    from sm120kit.serve.supervisor import Supervisor

    record, lock = lock_run(profile.name)
    key_file = record.dir / KEY_FILE
    try:
        if key_file.exists() or key_file.is_symlink():
            key_file.unlink()  # only a supervisor killed with SIGKILL (no finally) leaves one
            print(f"removed the API key file that a killed supervisor left behind: {key_file}")
        preflight.header(profile.name, launch)
        checked = preflight.run(profile, launch, target, options)
        if preflight.refused(checked, record, width):
            return ExitCode.ERROR
        env = checked.env
        try:
            argv, shown, key = resolve_argv(launch, env, key_file if launch.config_flag else None)
        except OSError as exc:
            raise UserError(
                f"cannot write the API key file {key_file}: {exc.strerror or exc}; nothing was started",
                f"free space under {record.dir}, or point ${ENV_VAR} at another disk",
            ) from None
        server = ServerSpec(
            profile.name,
            argv,
            shown,
            env,
            probe_host(profile.server.host),
            profile.server.port,
            port_plan(profile),
            api_key=key,
            api_key_env=profile.server.api_key_env,
            check_gpus=options.gpu_check,
        )
        smoke = None
        if profile.health.smoke:  # the smoke decides "ready": against this server, with its key
            from sm120kit.quality.options import options_for

            smoke = options_for(profile, api_key=key)
        record.state.update(role="server", gpus=visible_gpus(env, profile.node.gpus))
        with (
            keep_secret(key, f"${profile.server.api_key_env}"),
            metrics_served(options, profile, lambda: [Member(profile.name, "server", record.dir)]),
        ):
            policy = Policy.from_health(profile.health)
            return Supervisor(
                server, policy, record, echo=options.echo, smoke=smoke, patch_dirs=options.patch_dirs
            ).run()
    finally:
        key_file.unlink(missing_ok=True)
        lock.release()


def visible_gpus(env: dict[str, str], count: int) -> list[int]:
    """The NVML indices the server may use: CUDA_VISIBLE_DEVICES's when it lists indices
    (UUIDs say nothing here), else the first `count`."""
    cvd = env.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    if cvd and all(part.isdigit() for part in cvd.split(",")):
        return [int(part) for part in cvd.split(",")]
    return list(range(count))


@contextlib.contextmanager
def metrics_served(
    options: ServeOptions, profile: Profile, members: Callable[[], list[Member]]
) -> Iterator[MetricsServer | None]:
    """`--metrics-port`: the supervisor's state on server.host:PORT/metrics while it runs
    (where the server is reachable, its metrics are; a port in use: a UserError before
    anything starts)."""
    if options.metrics_port is None:
        yield None
        return
    from sm120kit.serve.metrics import start_metrics_server

    read_gpus: Callable[[], list[Gpu]] | None = None
    if options.gpu_check:
        from sm120kit.node import nvml

        read_gpus = nvml.read_gpus
    host = profile.server.host
    server = start_metrics_server(host, options.metrics_port, profile.name, members, read_gpus=read_gpus)
    print(f"metrics: {server.url}", flush=True)
    try:
        yield server
    finally:
        server.close()


def lock_run(name: str) -> tuple[RunRecord, BaseFileLock]:
    """(the run record of profile `name`, its supervisor lock, held): one supervisor per
    profile, be it one server or a fleet. A UserError when another holds it, or the run
    directory cannot be made."""
    from filelock import FileLock, Timeout

    directory = serve_root() / name
    try:
        record = RunRecord(directory)
        lock = FileLock(str(record.dir / "supervisor.lock"))
        lock.acquire(timeout=0)
    except Timeout:
        pid = record_pid(record)
        raise UserError(
            f"profile {name} is already being served" + (f" by supervisor pid {pid}" if pid else ""),
            "`sm120kit ps` shows it; stop it with `kill -TERM <pid>` (or Ctrl-C in its terminal)",
        ) from None
    except OSError as exc:  # a full or read-only disk under the state directory
        raise UserError(
            f"cannot set up the run directory {directory}: {exc.strerror or exc}; nothing was started",
            f"free space there, or point ${ENV_VAR} at another disk",
        ) from None
    return record, lock


def record_pid(record: RunRecord) -> int | None:
    try:
        state = shallow_json.loads(record.state_file.read_text())
        return state.get("supervisor_pid") if isinstance(state, dict) else None
    except (OSError, ValueError):
        return None
