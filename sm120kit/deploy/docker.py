"""A container that runs `sm120kit serve PROFILE`: a `docker run` line and a compose file
that say the same (the compose file validates against the compose specification's JSON
Schema: tests/test_deploy_docker.py).

The container takes the host's network (`--network host`): the server binds where the
profile says (server.host: 127.0.0.1, the host's loopback, unless the profile binds
public), the argv is the one `serve --dry-run` prints on the host, and a fleet's replicas,
its router and a multi-node server's NCCL ports need no list of published ports. Publishing
with `-p 127.0.0.1:PORT:PORT` instead would make sglang bind the container's own address:
another argv, and a public bind the profile did not ask for.

The image it runs is built FROM the one given (`sh`, sglang, sglang-router for a fleet, in the
serving environment on PATH, or --image-python names that environment's python) by a
Dockerfile that installs sm120kit from its own wheel and runs `sm120kit patch --verify` for
the profile's patches: the image is patched and proven when it is built, before it ships (the
compose file builds it: `build.dockerfile_inline`; `render docker --dockerfile` prints it
alone). No package index serves sm120kit: the wheel travels in the build's context, the
directory `render docker --out DIR` writes (the Dockerfile, compose.yaml and the wheel;
write_context). Its container keeps FlashInfer's and Triton's JIT caches in a volume, as it
reads the Hugging Face cache from the host: the kernels built at a start are there at the
next. The host runs the NVIDIA Container Toolkit (`--gpus`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from sm120kit.deploy import START_BURST, Deployment, seconds, stop_budget_s
from sm120kit.deploy.own_wheel import wheel_name
from sm120kit.errors import UserError
from sm120kit.node.checks.system import NOFILE_GOOD

SHM_SIZE = "32g"  # doctor's advice: 16 GiB is fine for 8 ranks at high concurrency, 1 GiB is the floor
HF_CACHE_HOST = "$HOME/.cache/huggingface"  # the host's Hugging Face cache (its default HF_HOME)
HF_HOME = "/root/.cache/huggingface"  # where the container reads it, whatever user it runs as
STATE_DIR = "/var/lib/sm120kit"  # the container's $SM120KIT_STATE_DIR: run records, logs
STATE_VOLUME = "sm120kit-state"  # a named volume, unless --state-dir names a host directory
PROFILES_AT = "/etc/sm120kit/profiles"  # the host's profile directories, mounted read-only
PATCHES_AT = "/etc/sm120kit/patches"
JIT_CACHE = "/var/cache/sm120kit/jit"  # FlashInfer's ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) and Triton's
JIT_VOLUME = "sm120kit-jit"  # a named volume: the JIT caches outlive the container (and a rebuilt image)
WHEEL_AT = "/opt/sm120kit"  # where the Dockerfile copies sm120kit's wheel (kept: what the image was built with)
DOCKERFILE, COMPOSE = "Dockerfile", "compose.yaml"  # beside the wheel in the build's context (--out DIR)


@dataclass(frozen=True)
class ContainerOptions:
    image: str
    env_file: str | None = None  # docker's --env-file: the API key, NAME=value
    state_dir: str | None = None  # a host directory for the run records (default: a named volume)


@dataclass(frozen=True)
class Container:
    """The container both forms describe."""

    name: str
    image: str  # the image it runs: the one the Dockerfile builds
    gpus: int
    script: str  # sh -c SCRIPT: the patch step, then exec serve
    env: list[str]  # NAME=value, or NAME alone: passed from the invoking environment
    env_file: str | None
    volumes: list[str]  # HOST:CONTAINER[:ro]
    named_volume: str | None
    stop_s: int
    restarts: int
    base: str = ""  # --image: what the Dockerfile builds FROM
    dockerfile: str = ""


def container(d: Deployment, o: ContainerOptions) -> Container:
    p = d.profile
    profile_dirs = {host: f"{PROFILES_AT}/{k}" for k, host in enumerate(d.profile_dirs)}
    patch_dirs = {host: f"{PATCHES_AT}/{k}" for k, host in enumerate(d.patch_dirs)}
    ref = d.ref
    if ref.startswith("/"):  # a profile file: its directory is mounted too (its extends live there)
        parent, _, file = ref.rpartition("/")
        profile_dirs.setdefault(parent, f"{PROFILES_AT}/{len(profile_dirs)}")
        ref = f"{profile_dirs[parent]}/{file}"
    exe = ["sm120kit"]
    words = [d.serve_argv(exe, ref, tuple(profile_dirs[h] for h in d.profile_dirs), tuple(patch_dirs.values()))]
    patch = d.patch_argv(exe, tuple(patch_dirs.values()))
    script = " && exec ".join(shlex.join(w) for w in ([patch] if patch else []) + words)
    volumes = [f"{HF_CACHE_HOST}:{HF_HOME}"]
    if p.model.path and p.model.path.startswith("/"):
        volumes.append(f"{p.model.path}:{p.model.path}:ro")
    volumes += [f"{host}:{inside}:ro" for host, inside in {**profile_dirs, **patch_dirs}.items()]
    volumes.append(f"{o.state_dir or STATE_VOLUME}:{STATE_DIR}")
    volumes.append(f"{JIT_VOLUME}:{JIT_CACHE}")
    env = [f"HF_HOME={HF_HOME}", f"SM120KIT_STATE_DIR={STATE_DIR}"]
    env += [f"FLASHINFER_WORKSPACE_BASE={JIT_CACHE}", f"TRITON_CACHE_DIR={JIT_CACHE}/triton"]
    if p.server.api_key_env and not o.env_file:
        env.append(p.server.api_key_env)  # by name: its value comes from the environment docker runs in
    image = built_image(d.name, o.image)
    return Container(
        name=d.name,
        image=image,
        base=o.image,
        dockerfile=dockerfile(d, o.image, image),
        gpus=p.node.gpus,
        script=script,
        env=env,
        env_file=o.env_file,
        volumes=volumes,
        named_volume=None if o.state_dir else STATE_VOLUME,
        stop_s=stop_budget_s(p),
        restarts=START_BURST,
    )


def built_image(name: str, base: str) -> str:
    """The tag of the image the Dockerfile builds: the container's name, the base image's tag."""
    tag = base.rsplit("/", 1)[-1].split("@")[0].partition(":")[2] or "latest"
    return f"{name.lower()}:{tag}"


def dockerfile(d: Deployment, base: str, image: str) -> str:
    """FROM the given image: sm120kit installed, then `sm120kit patch --verify` for the
    profile's patches, so that a build that cannot apply and prove them fails. Patches of
    --patch-dir are not in the image's build context: they are applied when the container
    starts (its patch step, with those directories mounted), the shipped ones here."""
    from sm120kit import __version__
    from sm120kit.patching import registry

    shipped = str(registry.shipped_dir())
    patches = {p.id: p for p in registry.load_patches(list(d.patch_dirs))}
    baked = tuple(i for i in d.profile.patches if patches[i].source.startswith(shipped))
    later = [i for i in d.profile.patches if i not in baked]
    wheel = wheel_name()
    lines = [
        f"# {image}: {base} with sm120kit {__version__} and profile {d.profile.name}'s patches,",
        "# applied and proven when it is built. Its context is the directory that",
        "# `sm120kit render docker --out DIR` writes: this file, compose.yaml and sm120kit's wheel.",
        f"#   docker build -t {image} DIR",
        f"FROM {base}",
        f"COPY {wheel} {WHEEL_AT}/",
        f"RUN pip install --no-cache-dir {WHEEL_AT}/{wheel}",
    ]
    patch = replace(d, profile=d.profile.model_copy(update={"patches": list(baked)})).patch_argv(["sm120kit"], ())
    if patch:  # one --only a line
        words = [shlex.quote(w) for w in patch]
        at = words.index("--only")
        parts = [" ".join(words[:at]), *(" ".join(words[i : i + 2]) for i in range(at, len(words), 2))]
        lines.append("RUN " + " \\\n    ".join(parts))
    if later:
        lines.append(f"# applied when the container starts, from its --patch-dir: {', '.join(later)}")
    return "\n".join(lines) + "\n"


def run_argv(c: Container) -> list[str]:
    """`docker run`: its words; `$HOME` is for the shell to expand."""
    words = ["docker", "run", "--detach", "--name", c.name, "--gpus", str(c.gpus), "--network", "host"]
    words += ["--shm-size", SHM_SIZE, "--ulimit", f"nofile={NOFILE_GOOD}:{NOFILE_GOOD}", "--ulimit", "memlock=-1:-1"]
    words += ["--stop-timeout", str(c.stop_s), "--restart", f"on-failure:{c.restarts}"]
    for v in c.volumes:
        words += ["--volume", v]
    for e in c.env:
        words += ["--env", e]
    if c.env_file:
        words += ["--env-file", c.env_file]
    return [*words, "--entrypoint", "sh", c.image, "-c", c.script]


def run_line(c: Container) -> str:
    """The run line as a shell reads it, one option a line."""
    lines: list[str] = []
    for word in run_argv(c):
        text = f'"{word}"' if word.startswith("$HOME/") else shlex.quote(word)
        if (word.startswith("-") and word != "-c") or not lines:
            lines.append(text)
        elif lines[-1].startswith("-") and " " not in lines[-1] and lines[-1] != "--entrypoint":
            lines[-1] += " " + text
        elif lines[-1].startswith("--entrypoint") and word == c.image:
            lines.append(text)
        else:
            lines[-1] += " " + text
    return " \\\n  ".join(lines)


def compose(c: Container) -> dict:
    """The compose file's document: one service, the run line's equal."""
    service: dict = {
        "image": c.image,
        "build": {"context": ".", "dockerfile_inline": _literal(c.dockerfile)},  # the patched image
        "container_name": c.name,
        "entrypoint": ["sh", "-c", _literal(c.script)],
        "network_mode": "host",
        "shm_size": SHM_SIZE,
        "ulimits": {"nofile": {"soft": NOFILE_GOOD, "hard": NOFILE_GOOD}, "memlock": {"soft": -1, "hard": -1}},
        "stop_grace_period": f"{seconds(c.stop_s)}s",
        "restart": f"on-failure:{c.restarts}",
        "volumes": [_literal(v).replace("$$HOME/", "${HOME}/", 1) for v in c.volumes],
        "environment": [_literal(e) for e in c.env],
    }
    if c.env_file:
        service["env_file"] = [c.env_file]
    service["deploy"] = {
        "resources": {"reservations": {"devices": [{"driver": "nvidia", "count": c.gpus, "capabilities": ["gpu"]}]}}
    }
    doc: dict = {"name": c.name, "services": {c.name: service}}
    doc["volumes"] = {**({c.named_volume: {}} if c.named_volume else {}), JIT_VOLUME: {}}
    return doc


def _literal(text: str) -> str:
    """Compose interpolates $NAME in its values: `$$` is a `$`."""
    return text.replace("$", "$$")


def compose_text(c: Container) -> str:
    """The compose file, the `docker run` line that says the same in its leading comment."""
    import yaml

    head = [
        f"# {c.name}: `sm120kit serve` in a container (`sm120kit render docker`).",
        "# `sm120kit render docker --out DIR` writes it as DIR/compose.yaml beside the Dockerfile and",
        f"# sm120kit's wheel ({wheel_name()}), which the build copies; then, in DIR:",
        "#   docker compose up -d --build && docker compose logs -f",
        f"# Its image, {c.image}: {c.base} with sm120kit and the profile's patches,",
        "# applied and proven when it is built (the Dockerfile under build:, which",
        "# `sm120kit render docker --dockerfile` prints alone).",
        "# The same container with docker run, once the image is built (docker compose build):",
        *(f"#   {line}" for line in run_line(c).splitlines()),
    ]

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):  # the Dockerfile as a block, line for line
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    body = yaml.dump(compose(c), Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000)
    return "\n".join(head) + "\n" + body


def check_context_dir(out: Path, again: str) -> None:
    """--out DIR: a new directory, an empty one, or one that holds only what render writes
    there (a build's context is sent to docker whole); a UserError naming it otherwise,
    whose next step is `again` (the command with a new directory)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: not a directory", again)
    try:
        others = sorted(p.name for p in out.iterdir() if not _ours(p.name)) if out.is_dir() else []
    except OSError as exc:
        raise UserError(f"--out {out}: cannot read it ({exc.strerror or exc})", again) from None
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(
            f"--out {out} holds {shown}, which render does not write: the build would send it to docker, "
            "and render writes Dockerfile and compose.yaml there",
            again,
        )


def _ours(name: str) -> bool:
    return name in (DOCKERFILE, COMPOSE) or (name.startswith("sm120kit-") and name.endswith(".whl"))


def write_context(c: Container, out: Path, wheel: Path) -> list[Path]:
    """The build's context in `out` (checked by check_context_dir): the Dockerfile, the
    compose file and sm120kit's wheel, which the Dockerfile copies; a wheel of another
    version left there by an earlier render goes."""
    from sm120kit.atomic_write import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    written = [out / DOCKERFILE, out / COMPOSE, out / wheel_name()]
    write_atomic(written[0], c.dockerfile.encode())
    write_atomic(written[1], compose_text(c).encode())
    write_atomic(written[2], wheel.read_bytes())
    for stale in out.glob("sm120kit-*.whl"):
        if stale not in written:
            stale.unlink()
    return written
