"""One member of a fleet (a replica, or the router), supervised exactly as `serve`
supervises one server, in a process of its own: `python -m sm120kit.fleet.member DIR`.

The fleet supervisor writes DIR/member.json (what to run: argv with the API key as a
{"env": NAME} reference, never the key), starts this in a session of its own (a Ctrl-C
in the terminal reaches the fleet alone, which stops the members in order), and reads the
member's state.json. A member is tied to the fleet supervisor: if that dies, the member
gets SIGTERM and stops its server as on any stop."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sm120kit.profiles.render import EnvRef

SPEC = "member.json"
ROUTER_KEY_ENV = "SM120KIT_ROUTER_KEY"
# The router takes its key only as --api-key (no key file): this appends it from the
# environment inside the router's own process, so that no process list ever shows it.
ROUTER_WITH_KEY = (
    "import os, runpy, sys; "
    f"sys.argv += ['--api-key', os.environ.pop('{ROUTER_KEY_ENV}')]; "
    "runpy.run_module('sglang_router.launch_router', run_name='__main__', alter_sys=True)"
)
OUTPUT = "supervisor.out"  # the member supervisor's own lines; the fleet shows them


def write_spec(directory: Path, **fields: object) -> None:
    """The member's spec (mode 0600: the environment may hold more than it should)."""
    path = directory / SPEC
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(fields, fh, indent=2)


def argv_refs(argv: list[str | EnvRef]) -> list[str | dict[str, str]]:
    """A launch's argv for member.json: an EnvRef as {"env": NAME}."""
    from sm120kit.profiles.render import EnvRef

    return [{"env": a.name} if isinstance(a, EnvRef) else a for a in argv]


def router_with_key(argv: list[str]) -> list[str]:
    """The router's argv (`PYTHON -m sglang_router.launch_router ...`) run through
    ROUTER_WITH_KEY: its key comes from $SM120KIT_ROUTER_KEY, in its own process."""
    module = argv.index("-m")
    return [*argv[:module], "-c", ROUTER_WITH_KEY, *argv[module + 2 :]]


def key_from_environment(argv: list[str], env: dict[str, str], key: str) -> list[str]:
    """The router's argv without `--api-key KEY`, run so that it reads the key from env."""
    i = argv.index("--api-key")
    env[ROUTER_KEY_ENV] = key
    return router_with_key([*argv[:i], *argv[i + 2 :]])


def main(directory: str) -> int:
    from sm120kit.profiles.render import EnvRef, Launch
    from sm120kit.serve import procs
    from sm120kit.serve.command import KEY_FILE, keep_secret, resolve_argv
    from sm120kit.serve.machine import Policy, ServerSpec
    from sm120kit.serve.rundir import RunRecord
    from sm120kit.serve.supervisor import Supervisor

    if not procs.tie_to_parent(int(os.environ.get("SM120KIT_FLEET_PID", os.getppid())), signal.SIGTERM):
        return 1  # the fleet supervisor is gone already
    record = RunRecord(Path(directory))
    spec = json.loads((record.dir / SPEC).read_text())
    refs: list[str | EnvRef] = [EnvRef(a["env"]) if isinstance(a, dict) else a for a in spec["argv"]]
    env = {**os.environ, **spec["env"]}
    env.pop("SM120KIT_FLEET_PID", None)
    key_file = record.dir / KEY_FILE
    try:
        argv, shown, key = resolve_argv(Launch(refs, {}, ""), env, key_file if spec["key_file"] else None)
        if spec["role"] == "router" and key:
            argv = key_from_environment(argv, env, key)
        server = ServerSpec(
            spec["name"],
            argv,
            shown,
            env,
            spec["host"],
            spec["port"],
            [tuple(p) for p in spec["ports"]],
            api_key=key,
            api_key_env=spec["api_key_env"],
            check_gpus=spec["check_gpus"],
            gpus=tuple(spec["gpus"]) if spec["role"] == "replica" else (),
            probe_path=spec["probe_path"],
        )
        # written with the supervisor's first record (a state.json of these alone would read as damaged)
        record.state.update(member=spec["member"], role=spec["role"], gpus=spec["gpus"], url=spec["url"])
        smoke = None
        if spec["smoke"] is not None:  # health.smoke: against this replica, with the fleet's key
            from sm120kit.quality.options import SmokeOptions

            smoke = SmokeOptions(**{**spec["smoke"], "model": tuple(spec["smoke"]["model"]), "api_key": key})
        with keep_secret(key, f"${spec['api_key_env']}"):
            policy = Policy(**spec["policy"])
            return Supervisor(
                server, policy, record, echo=False, smoke=smoke, patch_dirs=tuple(spec["patch_dirs"])
            ).run()
    finally:
        key_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
