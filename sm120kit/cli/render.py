"""`render`: a profile as a systemd unit, a container (docker run + compose) or Kubernetes
manifests."""

from __future__ import annotations

import argparse
import os
import shlex
from typing import TYPE_CHECKING

from sm120kit.cli.args import (
    allow_known_failure_arg,
    command_parser,
    common_args,
    patch_dir_arg,
    profile_args,
    target_args,
)
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from pathlib import Path

    from sm120kit.deploy.docker import Container

TARGETS = ("systemd", "docker", "k8s")
# The options that mean something to some targets only: any other target refuses them.
ONLY_FOR = {
    "image": ("--image", ("docker", "k8s")),
    "dockerfile": ("--dockerfile", ("docker",)),
    "out": ("--out", ("docker",)),
    "namespace": ("--namespace", ("k8s",)),
    "user_unit": ("--user", ("systemd",)),
    "unit_user": ("--unit-user", ("systemd",)),
    "sm120kit": ("--sm120kit", ("systemd",)),
    "env_file": ("--env-file", ("systemd", "docker")),
    "state_dir": ("--state-dir", ("systemd", "docker")),
    "node_rank": ("--node-rank", ("systemd", "docker")),
    "site": ("--site", ("docker", "k8s")),
    # --python: this node's serving environment (systemd runs it; docker and k8s judge the launch
    # and k8s reads the flags against its sglang, which should be the image's release);
    # --image-python: the interpreter inside the image (a container or a pod runs it)
    "python": ("--python", ("systemd", "docker", "k8s")),
    "image_python": ("--image-python", ("docker", "k8s")),
    "secret": ("--secret", ("k8s",)),
    "hf_cache_claim": ("--hf-cache-claim", ("k8s",)),
    "hf_cache_host_path": ("--hf-cache-host-path", ("k8s",)),
    "shm_size": ("--shm-size", ("k8s",)),
}


def register(sub) -> None:
    """render."""
    p = command_parser(
        sub,
        "render",
        "the profile as a systemd unit, a docker run line + compose file, or Kubernetes manifests",
        "Print what runs the profile NAME as operators run servers. systemd: a unit whose "
        "ExecStart is `sm120kit serve NAME` after `sm120kit patch --verify` of its patches. docker: "
        "the same commands as a container's, as a compose file headed by the equal `docker run` line, "
        "whose image a Dockerfile builds FROM --image with sm120kit's own wheel installed and the patches "
        "applied and proven (--dockerfile prints it alone; --out DIR writes the build's context: the "
        "Dockerfile, compose.yaml and the wheel). "
        "k8s: manifests whose pods run the sglang argv that `serve --dry-run` renders (Kubernetes "
        "supervises there); needs sglang in the target environment. Every target first judges the "
        "launch as `profile check` does, against the target environment's sglang (systemd: the "
        "unit's; docker, k8s: --python / --site, else this interpreter's; docker without sglang there: "
        "a warning), and refuses one that runs into a known SM120 failure of that release; "
        "--allow-known-failure ID renders it anyway, and the unit and the container pass it on to "
        "`serve`. Writes nothing but docker's --out DIR: redirect it.",
        {
            ExitCode.OK: "printed (docker --out: written)",
            ExitCode.ERROR: "bad input: an unknown or invalid profile, one that cannot serve, a launch that "
            "runs into a known SM120 failure of the release (--allow-known-failure ID), a multi-node "
            "profile without --node-rank or a rendezvous port, docker or k8s without --image, an option "
            "that is not the target's, an --out DIR that holds other files or sm120kit's wheel that cannot be "
            "found or built; nothing was printed or written",
        },
        func=cmd_render,
    )
    p.add_argument("target", metavar="TARGET", choices=TARGETS, help=f"what to render: {', '.join(TARGETS)}")
    p.add_argument("name", metavar="NAME", help="the launch profile (`sm120kit profiles` lists them)")
    p.add_argument("--image", metavar="IMAGE", help="docker, k8s: the image (sglang and sm120kit installed)")
    p.add_argument(
        "--dockerfile",
        action="store_true",
        help="docker: print the Dockerfile of the image alone (FROM --image, sm120kit installed, the patches "
        "applied and proven at build time), which the compose file builds",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="docker: write the build's context into DIR (new, empty, or an earlier --out): the Dockerfile, "
        "compose.yaml and sm120kit's own wheel, which the Dockerfile installs (the wheel this sm120kit was "
        "installed from, or one built from its source with `pip wheel --no-deps`, cached)",
    )
    p.add_argument("--namespace", metavar="NS", help="k8s: the namespace of every object (default: none set)")
    p.add_argument("--user", dest="user_unit", action="store_true", help="systemd: a unit of the user's manager")
    p.add_argument("--unit-user", metavar="USER", help="systemd: the account a system unit runs as (User=)")
    p.add_argument(
        "--sm120kit",
        metavar="EXE",
        help="systemd: the sm120kit the unit runs (default: this one's absolute path)",
    )
    p.add_argument(
        "--env-file",
        metavar="PATH",
        help="systemd, docker: the file of NAME=value lines with the API key (systemd's default: "
        "/etc/sm120kit/NAME.env, with --user ~/.config/sm120kit/NAME.env; docker's: the key is passed "
        "by name from the environment docker runs in)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="systemd, docker: $SM120KIT_STATE_DIR of the server, where its run records and logs go "
        "(docker's default: the volume sm120kit-state)",
    )
    p.add_argument("--node-rank", type=int, metavar="N", help="systemd, docker: this node's rank, multi-node")
    p.add_argument(
        "--image-python",
        metavar="EXE",
        help="docker, k8s: the serving environment's interpreter inside the image (default: k8s python3; "
        "docker: the one of the image's sm120kit)",
    )
    p.add_argument("--secret", metavar="NAME", help="k8s: the Secret with the API key (default: NAME-api-key)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--hf-cache-claim",
        metavar="CLAIM",
        help="k8s: the PersistentVolumeClaim of the model cache (default: hf-cache)",
    )
    cache.add_argument("--hf-cache-host-path", metavar="DIR", help="k8s: the node's directory as the model cache")
    p.add_argument("--shm-size", metavar="SIZE", help="k8s: /dev/shm's size, a quantity (default: 32Gi)")
    patch_dir_arg(p)
    profile_args(p)
    target_args(
        p,
        python_is="the serving environment (systemd: the unit's; docker, k8s: one with the image's sglang "
        "release, whose flags and known failures the launch is judged against)",
    )
    allow_known_failure_arg(p)
    common_args(p, prints="the files")


def cmd_render(args) -> int:
    from sm120kit import followup
    from sm120kit.errors import UserError

    for dest, (option, targets) in ONLY_FOR.items():
        if getattr(args, dest) not in (None, False) and args.target not in targets:
            raise UserError(
                f"render {args.target} does not take {option} (it is for {', '.join(targets)})",
                f"`{followup.command('render', args.target, args.name)}`, without {option}",
            )
    if args.target in ("docker", "k8s") and not args.image:
        raise UserError(
            f"render {args.target} needs the image that runs the server",
            f"`{followup.command('render', args.target, args.name, '--image', 'IMAGE')}`, an image with sglang and "
            "sm120kit installed",
        )
    if args.dockerfile and args.out:
        raise UserError(
            "render docker takes --dockerfile (print the Dockerfile) or --out DIR (write the build's context), "
            "not both",
            f"`{followup.command('render', 'docker', args.name, '--image', args.image or 'IMAGE', '--out', args.out)}`",
        )
    if args.node_rank is not None:
        from sm120kit.cli.args import check_range

        check_range("--node-rank", args.node_rank, 0, 1023, "a node's rank, 0 .. parallel.nnodes - 1")
    _check_values(args)
    return {"systemd": _systemd, "docker": _docker, "k8s": _k8s}[args.target](args)


def _check_values(args) -> None:
    """Every option whose value a unit, compose file or manifest carries (sm120kit.deploy.values):
    no control character; User= as systemd takes it; a Secret's and a claim's name as Kubernetes
    takes them; an image reference without a space."""
    from sm120kit.deploy import values
    from sm120kit.errors import UserError

    for option, dest in (
        ("NAME", "name"),
        ("--image", "image"),
        ("--namespace", "namespace"),
        ("--sm120kit", "sm120kit"),
        ("--env-file", "env_file"),
        ("--state-dir", "state_dir"),
        ("--python", "python"),
        ("--site", "site"),
        ("--image-python", "image_python"),
        ("--hf-cache-host-path", "hf_cache_host_path"),
        ("--shm-size", "shm_size"),
    ):
        values.plain(option, getattr(args, dest))
    for option, dest in (("--profile-dir", "profile_dir"), ("--patch-dir", "patch_dir")):
        for value in getattr(args, dest) or ():
            values.plain(option, value)
    if args.unit_user is not None:
        values.unit_user(args.unit_user)
    values.k8s_name("--secret", args.secret)
    values.k8s_name("--hf-cache-claim", args.hf_cache_claim)
    if args.image is not None and (not args.image or any(c.isspace() for c in args.image)):
        raise UserError(f"--image {args.image!r} is not an image reference", "give REGISTRY/NAME:TAG")


def _deployment(args, python: str | None):
    from sm120kit.deploy import deployment

    for option in ("env_file", "state_dir"):  # the unit runs in /, the container elsewhere: absolute paths
        if getattr(args, option, None):
            setattr(args, option, os.path.abspath(os.path.expanduser(getattr(args, option))))
    allowed = getattr(args, "allow_known_failure", None) or ()
    d = deployment(args.name, args.profile_dir, args.sets, python, args.node_rank, args.patch_dir, allowed)
    _check_deployment(d, args)
    return d


def _check_deployment(d, args) -> None:
    """What the unit or the container carries from the profile and the search paths
    ($SM120KIT_PROFILE_PATH, $SM120KIT_PATCH_PATH too): no control character; for docker,
    no ':' in a directory it mounts (it would split HOST:CONTAINER)."""
    from sm120kit.deploy import values

    values.profile_values(d.profile)
    dirs = [("--profile-dir (or $SM120KIT_PROFILE_PATH)", p) for p in d.profile_dirs]
    dirs += [("--patch-dir (or $SM120KIT_PATCH_PATH)", p) for p in d.patch_dirs]
    for option, path in dirs:
        values.plain(option, path)
    if args.target == "docker":
        model = d.profile.model.path
        dirs += [("--state-dir", args.state_dir), ("model.path", model if model and model.startswith("/") else None)]
        if d.ref.startswith("/"):
            dirs.append(("NAME", d.ref.rpartition("/")[0]))  # the profile file's directory is mounted too
        for option, path in dirs:
            values.volume_path(option, path)


def _systemd(args) -> int:
    import sys
    from pathlib import Path

    from sm120kit import report
    from sm120kit.deploy.systemd import UnitOptions, render_unit, unit_name

    python = args.python and (os.path.abspath(os.path.expanduser(args.python)) if "/" in args.python else args.python)
    d = _deployment(args, python)
    exe: tuple[str, ...]
    if args.sm120kit:
        exe = (os.path.abspath(os.path.expanduser(args.sm120kit)),)
    else:
        here = Path(os.path.abspath(sys.executable)).parent / "sm120kit"
        exe = (str(here),) if os.access(here, os.X_OK) else (os.path.abspath(sys.executable), "-m", "sm120kit")
    options = UnitOptions(exe, args.user_unit, args.unit_user, args.env_file, args.state_dir)
    text = render_unit(d, options)
    from sm120kit.cli.profiles import render_for
    from sm120kit.deploy.unit_environment import check_unit_environment

    def judge(unit_python: str, target):  # `profile check`'s judgement, in the unit's interpreter
        return render_for(argparse.Namespace(**{**vars(args), "python": unit_python, "site": None}), d.profile, target)

    # what `serve --dry-run` checks, in the unit's interpreter
    check_unit_environment(d, exe, args.sm120kit is not None, judge, report.print_warnings)
    if args.json:
        report.emit_json({"target": "systemd", "unit": unit_name(d), "text": text}, follow_ups=False)
    else:
        print(text, end="")
    return ExitCode.OK


def _judged(args, profile, target) -> None:
    """The launch judged as `profile check` judges it (the same render_for, hence the same
    refuse_known_failures): a UserError (exit 2, nothing printed) for a known SM120 failure of
    the target's release that no patch covers and no --allow-known-failure allows; its
    warnings on stderr."""
    from sm120kit import report
    from sm120kit.cli.profiles import render_for
    from sm120kit.profiles.render import Launch

    launch = render_for(args, profile, target, router_optional=True)  # a container or a pod runs the router
    one = launch if isinstance(launch, Launch) else next(iter(launch.replicas.values()), None)
    report.print_warnings(list(dict.fromkeys([*launch.warnings, *(one.warnings if one else [])])))


def _judge_container(args, profile) -> None:
    """docker: the launch judged against --python / --site (an environment with the image's
    sglang release), else against this interpreter's sglang; where neither is given and this
    interpreter has none, a warning: the container's serve judges it at its start."""
    from sm120kit import report
    from sm120kit.target import resolve_target

    target = resolve_target(args.python, args.site)
    if args.python is None and args.site is None and target.find("sglang") is None:
        report.print_warnings(
            [
                "the launch was not judged against the known SM120 failures: this interpreter has no sglang "
                "(the container's `sm120kit serve` judges it at its start; next: --python EXE or --site DIR of "
                "an environment with the image's sglang release)"
            ]
        )
        return
    _judged(args, profile, target)


def _docker(args) -> int:
    from pathlib import Path

    from sm120kit import report
    from sm120kit.deploy.docker import ContainerOptions, compose, compose_text, container, run_argv

    d = _deployment(args, args.image_python)
    _judge_container(args, d.profile)
    c = container(d, ContainerOptions(args.image, args.env_file, args.state_dir))
    written = _write_context(c, Path(args.out).expanduser(), args) if args.out else None
    if args.json:
        doc: dict = {"target": "docker", "image": c.image, "dockerfile": c.dockerfile, "run": run_argv(c)}
        doc["compose"] = compose(c)
        if written:
            doc["context"] = {"dir": str(written[0].parent), "files": [p.name for p in written]}
        report.emit_json(doc, follow_ups=False)
    elif written:
        where = written[0].parent
        print(f"wrote the build's context of {c.image} to {where}: {', '.join(p.name for p in written)}")
        print(f"next: cd {shlex.quote(str(where))} && docker compose up -d --build && docker compose logs -f")
    else:
        print(c.dockerfile if args.dockerfile else compose_text(c), end="")
    return ExitCode.OK


def _write_context(c: Container, out: Path, args) -> list[Path]:
    """--out DIR: checked before sm120kit's wheel is found or built, then written."""
    from sm120kit.deploy.docker import check_context_dir, write_context
    from sm120kit.deploy.own_wheel import own_wheel
    from sm120kit.errors import UserError

    check_context_dir(out, _docker_again(args, out))
    wheel = own_wheel()
    try:
        return write_context(c, out, wheel)
    except OSError as exc:
        raise UserError(
            f"--out {out}: cannot write the build's context ({exc.strerror or exc})", _docker_again(args, out)
        ) from None


def _docker_again(args, out: Path) -> str:
    """This render docker with --out a directory that is not there yet (the target, the
    profile's directories and --set are added where a follow-up is printed)."""
    fresh = next(c for n in range(2, 1000) if not (c := out.with_name(f"{out.name}-{n}")).exists())
    words = ["sm120kit", "render", "docker", args.name, "--image", args.image]
    for option, value in (("--image-python", args.image_python), ("--env-file", args.env_file)):
        words += [option, value] if value else []
    words += ["--state-dir", args.state_dir] if args.state_dir else []
    words += ["--node-rank", str(args.node_rank)] if args.node_rank is not None else []
    words += [w for f in getattr(args, "allow_known_failure", None) or () for w in ("--allow-known-failure", f)]
    return f"`{shlex.join([*words, '--out', str(fresh)])}` (a new directory)"


def _k8s(args) -> int:
    from sm120kit import report
    from sm120kit.cli.profiles import load_for
    from sm120kit.deploy import values
    from sm120kit.deploy.k8s import render_k8s, to_yaml

    profile, target = load_for(args)
    values.profile_values(profile)
    _judged(args, profile, target)  # the pods run sglang itself: nothing else judges the launch
    chosen = {
        k: v
        for k, v in (
            ("secret", args.secret),
            ("hf_cache_claim", args.hf_cache_claim),
            ("hf_cache_host_path", args.hf_cache_host_path),
            ("shm_size", args.shm_size),
        )
        if v is not None
    }
    docs = render_k8s(profile, target, args.image_python or "python3", args.image, args.namespace, **chosen)
    if args.json:  # a kubectl List: `kubectl apply -f` takes it as it is
        report.emit_json({"apiVersion": "v1", "kind": "List", "items": docs}, follow_ups=False)
    else:
        print(to_yaml(docs), end="")
    return ExitCode.OK
