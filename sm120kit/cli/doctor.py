"""`doctor`: can this node serve?"""

from __future__ import annotations

from sm120kit.cli.args import common_args, profile_args, target_args


def register(sub) -> None:
    """doctor."""
    p = sub.add_parser(
        "doctor", help="can this node serve? GPUs, P2P, topology, kernel, limits, software; each problem with its fix"
    )
    p.add_argument(
        "--profile",
        metavar="NAME",
        help="also check what this profile needs (GPU count, compute capability, memory, env)",
    )
    p.add_argument(
        "--nvml",
        metavar="FILE",
        help='replay NVML answers recorded by `doctor --json` (its "nvml" object) instead of asking the driver',
    )
    p.add_argument("--root", metavar="DIR", help="read /proc and /sys under DIR (a copy taken on another node)")
    profile_args(p)
    target_args(p)
    common_args(p)
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    from sm120kit.doctor.command import doctor
    from sm120kit.target import resolve_target

    profile = None
    if args.sets and not args.profile:
        from sm120kit.errors import UserError

        raise UserError(
            "--set changes a profile, and no --profile was given", "sm120kit doctor --profile NAME --set KEY=VALUE"
        )
    if args.profile:
        from sm120kit.profiles.loader import load_profile

        profile = load_profile(args.profile, args.profile_dir, args.sets)
    return doctor(args, profile, resolve_target(args.python, args.site))
