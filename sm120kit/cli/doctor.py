"""`doctor`: can this node serve?"""

from __future__ import annotations

from sm120kit.cli.args import (
    allow_known_failure_arg,
    command_parser,
    common_args,
    patch_dir_arg,
    profile_args,
    target_args,
)
from sm120kit.exit_codes import ExitCode


def register(sub) -> None:
    """doctor."""
    p = command_parser(
        sub,
        "doctor",
        "can this node serve? GPUs, P2P, topology, kernel, limits, software; each problem with its fix",
        "Check this node for serving with sglang on SM120: the driver and CUDA version; the GPUs "
        "(with --profile: against what the profile needs, free memory included); persistence mode; "
        "PCIe links; processes holding GPU memory; peer-to-peer and the topology matrix; iommu=pt; "
        "nvidia_uvm's HMM; VM or container; /dev/shm; open-file and locked-memory limits; CUDA and "
        "NCCL variables; the packages of the target environment (no sglang: nothing to serve); the "
        "patches (with --profile: the profile's, which must be in place); flashinfer's JIT cache; the "
        "model on disk; and every check of serve's preflight, with serve's verdict: the packages the "
        "server imports (not with --site: it names no interpreter to ask), no stale sglang process, and "
        "with --profile its API key, its ports each its own and free, and the known SM120 failures of the "
        "release. Each problem is printed with its fix. --nvml and --root read a copy of another node "
        "(this machine's processes, ports and API key are then not checked).",
        {
            ExitCode.OK: "nothing failed (warnings allowed)",
            ExitCode.FINDINGS: "a check failed: the node cannot serve (the profile) as it is; serve would refuse "
            "to start",
            ExitCode.ERROR: "bad input: an unknown profile, an unreadable --nvml document, a --root that is no "
            "copy of a node",
        },
        func=cmd_doctor,
    )
    p.add_argument(
        "--profile",
        metavar="NAME",
        help="also check what this profile needs (GPU count, compute capability, memory, patches, env, "
        "API key, ports, known failures): what serve's preflight checks before it starts it",
    )
    p.add_argument(
        "--nvml",
        metavar="FILE",
        help='replay NVML answers recorded by `doctor --json` (its "nvml" object) instead of asking the driver',
    )
    p.add_argument("--root", metavar="DIR", help="read /proc and /sys under DIR (a copy taken on another node)")
    p.add_argument(
        "--nccl",
        action="store_true",
        help="also run a two-rank NCCL all-reduce (64 MiB) with the target's torch, with P2P and with "
        "NCCL_P2P_DISABLE=1, each bounded in time: does P2P hang on this node? The two GPUs must be idle",
    )
    p.add_argument(
        "--nccl-gpus",
        metavar="A,B",
        help="the two GPUs for --nccl (implies it; default: the pair NVML ranks farthest apart)",
    )
    patch_dir_arg(p)
    allow_known_failure_arg(p)
    profile_args(p)
    target_args(p, python_is="the environment whose packages and patches are checked")
    common_args(p, wide=True)


def cmd_doctor(args) -> int:
    import sys
    from pathlib import Path

    from sm120kit import report
    from sm120kit.doctor import render
    from sm120kit.doctor.command import DoctorOptions, doctor
    from sm120kit.errors import UserError
    from sm120kit.target import resolve_target

    if args.sets and not args.profile:
        raise UserError(
            "--set changes a profile, and no --profile was given", "`sm120kit doctor --profile NAME --set KEY=VALUE`"
        )
    if args.allow_known_failure:  # unknown ids are bad input, with or without a profile
        from sm120kit.catalogue.survey import load_survey

        load_survey(args.patch_dir).select(args.allow_known_failure)
    from sm120kit.node.checks.nccl import request as nccl_request

    elsewhere = "--nvml" if args.nvml else "--root" if args.root else None
    profile = None
    if args.profile:
        from sm120kit.profiles.loader import load_profile

        profile = load_profile(args.profile, args.profile_dir, args.sets)
    options = DoctorOptions(
        root=Path(args.root) if args.root else None,
        nvml_file=Path(args.nvml) if args.nvml else None,
        patch_dirs=tuple(args.patch_dir or ()),
        allowed_failures=frozenset(args.allow_known_failure),
        capability=args.capability,
        debug=args.debug,
        nccl=nccl_request(args.python, args.site, args.nccl_gpus, elsewhere, sys.executable)
        if args.nccl or args.nccl_gpus
        else None,
        python=None if args.site else args.python or sys.executable,
        elsewhere=elsewhere,
    )
    result = doctor(options, profile, resolve_target(args.python, args.site))
    if args.json:
        report.emit_json(result.as_json())
    else:
        print(render.text(result, report.output_width(args.wide)))
    return result.exit_code
