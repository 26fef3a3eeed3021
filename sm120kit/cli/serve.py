"""`serve`: preflight, launch and supervise a profile's server."""

from __future__ import annotations

import sys

from sm120kit.cli.args import allow_missing_arg, common_args, profile_args, target_args
from sm120kit.cli.profiles import render_launch


def register(sub) -> None:
    """serve."""
    p = sub.add_parser(
        "serve",
        help="preflight, launch and supervise sglang with a profile until stopped",
        description="Preflight the node, start sglang with the profile, wait until it generates, probe it, "
        "restart it with backoff on death or hang, and stop it clean on Ctrl-C / SIGTERM.",
        epilog="exit codes: 0 stopped on request, clean; 1 gave up after the crash-loop limit; "
        "2 refused (preflight failed, bad input); 3 stopped, but a process or port was left",
    )
    p.add_argument("name")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the argv and environment; start nothing")
    mode.add_argument("--check", action="store_true", help="run the preflight only; exit 1 if a check fails")
    p.add_argument("--node-rank", type=int, metavar="N", help="this node's rank in a multi-node profile")
    p.add_argument("--kill-stale", action="store_true", help="stop stale sglang processes that the preflight finds")
    p.add_argument("--no-patch-check", action="store_true", help="start even if the profile's patches are not in place")
    allow_missing_arg(p)
    p.add_argument(
        "--no-gpu-check", action="store_true", help="skip the GPU count, compute capability and free-memory check"
    )
    p.add_argument(
        "--quiet", action="store_true", help="do not echo the server's log (it is still written to the log file)"
    )
    p.add_argument(
        "--patch-dir", action="append", metavar="DIR", help="also load patches from DIR (or $SM120KIT_PATCH_PATH)"
    )
    profile_args(p)
    target_args(p)
    common_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from sm120kit import report
    from sm120kit.errors import UserError

    if args.site and not args.dry_run:
        raise UserError(
            "--site names packages, not a python that can run the server",
            f"give the serving environment's interpreter: sm120kit serve {args.name} --python EXE (or --dry-run)",
        )
    profile, launch, target = render_launch(args)
    if args.dry_run:
        if args.json:
            report.emit_json(launch.as_json())
            return 0
        for warning in launch.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(launch.shell())
        return 0
    from sm120kit.serve import command

    if args.check:
        checks, _ = command.run_checks(profile, launch, target, args)
        code = int(any(c.ok is False for c in checks))
        if args.json:
            report.emit_json(
                {
                    "profile": profile.name,
                    "sglang": launch.sglang,
                    "checks": [c.as_json() for c in checks],
                    "warnings": launch.warnings,
                    "exit_code": code,
                }
            )
            return code
        for warning in launch.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"preflight for {profile.name} (sglang {launch.sglang}):")
        command.print_checks(checks)
        return code
    return command.serve(profile, launch, target, args)
