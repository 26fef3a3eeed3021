"""`render`: a profile as a systemd unit, a container (docker run + compose) or Kubernetes
manifests."""

from __future__ import annotations

import os

from sm120kit.cli.args import command_parser, common_args, patch_dir_arg, profile_args, target_args
from sm120kit.exit_codes import ExitCode

TARGETS = ("systemd", "docker", "k8s")
# The options that mean something to some targets only: any other target refuses them.
ONLY_FOR = {
    "image": ("--image", ("docker", "k8s")),
    "namespace": ("--namespace", ("k8s",)),
    "user_unit": ("--user", ("systemd",)),
    "unit_user": ("--unit-user", ("systemd",)),
    "sm120kit": ("--sm120kit", ("systemd",)),
    "env_file": ("--env-file", ("systemd", "docker")),
    "state_dir": ("--state-dir", ("systemd", "docker")),
    "node_rank": ("--node-rank", ("systemd", "docker")),
    "site": ("--site", ("k8s",)),
    # --python: this node's serving environment (systemd runs it; k8s reads its sglang's flags);
    # --image-python: the interpreter inside the image (a container or a pod runs it)
    "python": ("--python", ("systemd", "k8s")),
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
        "the same commands as a container's, as a compose file headed by the equal `docker run` line. "
        "k8s: manifests whose pods run the sglang argv that `serve --dry-run` renders (Kubernetes "
        "supervises there); needs sglang in the target environment. Writes nothing: redirect it.",
        {
            ExitCode.OK: "printed",
            ExitCode.ERROR: "bad input: an unknown or invalid profile, one that cannot serve, a multi-node "
            "profile without --node-rank or a rendezvous port, docker or k8s without --image, an option "
            "that is not the target's; nothing was printed",
        },
        func=cmd_render,
    )
    p.add_argument("target", metavar="TARGET", choices=TARGETS, help=f"what to render: {', '.join(TARGETS)}")
    p.add_argument("name", metavar="NAME", help="the launch profile (`sm120kit profiles` lists them)")
    p.add_argument("--image", metavar="IMAGE", help="docker, k8s: the image (sglang and sm120kit installed)")
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
    target_args(p, python_is="the serving environment (k8s: in the image; default python3)")
    common_args(p)


def cmd_render(args) -> int:
    from sm120kit.errors import UserError

    for dest, (option, targets) in ONLY_FOR.items():
        if getattr(args, dest) not in (None, False) and args.target not in targets:
            raise UserError(
                f"render {args.target} does not take {option} (it is for {', '.join(targets)})",
                f"sm120kit render {args.target} {args.name} without {option}",
            )
    if args.target in ("docker", "k8s") and not args.image:
        raise UserError(
            f"render {args.target} needs the image that runs the server",
            f"sm120kit render {args.target} {args.name} --image IMAGE (sglang and sm120kit installed in it)",
        )
    if args.node_rank is not None:
        from sm120kit.cli.args import check_range

        check_range("--node-rank", args.node_rank, 0, 1023, "a node's rank, 0 .. parallel.nnodes - 1")
    return {"systemd": _systemd, "docker": _docker, "k8s": _k8s}[args.target](args)


def _deployment(args, python: str | None):
    from sm120kit.deploy import deployment

    for option in ("env_file", "state_dir"):  # the unit runs in /, the container elsewhere: absolute paths
        if getattr(args, option, None):
            setattr(args, option, os.path.abspath(os.path.expanduser(getattr(args, option))))
    return deployment(args.name, args.profile_dir, args.sets, python, args.node_rank, args.patch_dir)


def _systemd(args) -> int:
    import sys
    from pathlib import Path

    from sm120kit import report
    from sm120kit.deploy.systemd import UnitOptions, render_unit, unit_name

    python = args.python and (os.path.abspath(os.path.expanduser(args.python)) if "/" in args.python else args.python)
    d = _deployment(args, python)
    if args.sm120kit:
        exe = (os.path.abspath(os.path.expanduser(args.sm120kit)),)
    else:
        here = Path(os.path.abspath(sys.executable)).parent / "sm120kit"
        exe = (str(here),) if os.access(here, os.X_OK) else (os.path.abspath(sys.executable), "-m", "sm120kit")
    options = UnitOptions(exe, args.user_unit, args.unit_user, args.env_file, args.state_dir)
    text = render_unit(d, options)
    if args.json:
        report.emit_json({"target": "systemd", "unit": unit_name(d), "text": text})
    else:
        print(text, end="")
    return ExitCode.OK


def _docker(args) -> int:
    from sm120kit import report
    from sm120kit.deploy.docker import ContainerOptions, compose, compose_text, container, run_argv

    c = container(_deployment(args, args.image_python), ContainerOptions(args.image, args.env_file, args.state_dir))
    if args.json:
        report.emit_json({"target": "docker", "run": run_argv(c), "compose": compose(c)})
    else:
        print(compose_text(c), end="")
    return ExitCode.OK


def _k8s(args) -> int:
    from sm120kit import report
    from sm120kit.cli.profiles import load_for
    from sm120kit.deploy.k8s import render_k8s, to_yaml

    profile, target = load_for(args)
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
        report.emit_json({"apiVersion": "v1", "kind": "List", "items": docs})
    else:
        print(to_yaml(docs), end="")
    return ExitCode.OK
