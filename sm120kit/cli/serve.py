"""`serve`: preflight, launch and supervise a profile's server, or its fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.cli.args import (
    allow_known_failure_arg,
    allow_missing_arg,
    command_parser,
    common_args,
    patch_dir_arg,
    profile_args,
    target_args,
)
from sm120kit.cli.profiles import judged_anywhere, load_for, render_for, what_runs_lines
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.profiles.model import Profile
    from sm120kit.serve.options import ServeOptions
    from sm120kit.target import Target


def register(sub) -> None:
    """serve."""
    p = command_parser(
        sub,
        "serve",
        "preflight, launch and supervise sglang with a profile until stopped",
        "Preflight the node for the profile NAME (the profile renders for the installed sglang; the "
        "serving environment has every package the server imports; its patches are in place; no stale "
        "sglang process; the GPUs are there and free; every port is free; the API key is set), start "
        "sglang with it, wait until it generates, probe it, restart it with backoff on death or hang, "
        "and stop it clean on Ctrl-C / SIGTERM. --check runs the preflight alone; --dry-run prints the "
        "command line, then runs the preflight's checks that do not read this node (imports, patches, "
        "ports each its own) and says on stderr what the start would refuse.",
        {
            ExitCode.OK: "stopped on request, nothing left behind; --check: every check passed; --dry-run: printed, "
            "and its checks passed",
            ExitCode.FINDINGS: "gave up after the crash-loop limit, or health.smoke's smoke failed (the server is "
            "stopped, not restarted); --check: a preflight check failed; --dry-run: printed, but a check the "
            "start would refuse on failed (its patches not in place, a package the server imports missing, two "
            "of its ports the same)",
            ExitCode.ERROR: "refused: a preflight check failed, or the profile is already being served; the "
            "server died at its start for want of a module (no restart mends that); bad input: an unknown "
            "profile, no sglang in the target environment (the profile renders for the installed release), an "
            "unknown --allow-missing id, a --metrics-port out of range",
            ExitCode.UNCLEAN: "stopped, but a process, port or GPU context of the server was left",
            ExitCode.INTERRUPTED: "interrupted before the supervisor took over (it stops on Ctrl-C with 0)",
        },
        func=cmd_serve,
    )
    p.add_argument("name", metavar="NAME", help="the launch profile to serve (`sm120kit profiles` lists them)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the argv and environment; start nothing")
    mode.add_argument("--check", action="store_true", help="run the preflight only; exit 1 if a check fails")
    p.add_argument("--node-rank", type=int, metavar="N", help="this node's rank in a multi-node profile")
    part = p.add_mutually_exclusive_group()
    part.add_argument(
        "--router-only",
        action="store_true",
        help="a fleet profile: only the router, in front of replicas served elsewhere",
    )
    part.add_argument(
        "--replicas-only",
        action="store_true",
        help="a fleet profile: only this node's replicas, for a router on another node",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve the supervisor's state in the Prometheus text format on server.host:N/metrics "
        "(default: server.metrics_port)",
    )
    p.add_argument("--kill-stale", action="store_true", help="stop stale sglang processes that the preflight finds")
    p.add_argument("--no-patch-check", action="store_true", help="start even if the profile's patches are not in place")
    allow_missing_arg(p)
    allow_known_failure_arg(p)
    p.add_argument(
        "--no-gpu-check", action="store_true", help="skip the GPU count, compute capability and free-memory check"
    )
    p.add_argument(
        "--quiet", action="store_true", help="do not echo the server's log (it is still written to the log file)"
    )
    patch_dir_arg(p)
    profile_args(p)
    target_args(p, python_is="the environment that runs the server")
    common_args(p, wide=True, prints="the text")


def cmd_serve(args) -> int:
    from sm120kit import followup, report
    from sm120kit.profiles.render import Launch
    from sm120kit.serve import command, preflight

    if args.site and not args.dry_run:
        raise UserError(
            "--site names packages, not a python that can run the server",
            f"give the serving environment's interpreter: `{followup.command('serve', args.name, '--python', 'EXE')}`, "
            "or add --dry-run",
        )
    profile, target = load_for(args)
    if profile.fleet is None and (args.router_only or args.replicas_only):
        raise UserError(
            f"profile {profile.name} is one server: --router-only and --replicas-only need a [fleet] table",
            f"serve it as one: `{followup.command('serve', args.name)}`",
        )
    launch = render_for(args, profile, target)
    options = _options(args, profile)  # checked as a start checks them, --dry-run too
    if args.dry_run:  # one server's command, or each of a fleet's; and what the start would refuse
        checked = judged_anywhere(args, profile, launch, target, options)
        if args.json:
            report.emit_json({**launch.as_json(), **checked.verdict_json()})
            return checked.exit_code
        report.print_warnings(launch.warnings, args.wide)
        shown = launch if isinstance(launch, Launch) else next(iter(launch.replicas.values()), None)
        width = report.output_width(args.wide)
        for line in what_runs_lines(shown.what_runs if shown else None, width and width - 2):
            print(f"# {line}")  # the command below stays one a shell runs as printed
        print(launch.shell(), flush=True)
        preflight.would_refuse(checked, report.error_width(args.wide), args.wide)
        return checked.exit_code
    if not isinstance(launch, Launch):  # a fleet profile's: render_for gave its FleetLaunch
        return _serve_fleet(args, profile, launch, target, options)
    width = report.output_width(args.wide)
    if not args.check:
        return command.serve(profile, launch, target, options, width)
    if not args.json:
        preflight.header(profile.name, launch)
    checked = preflight.run(profile, launch, target, options)
    if args.json:
        report.emit_json(checked.as_json())
    else:
        preflight.show(checked, width)
    return checked.exit_code


def _options(args, profile: Profile) -> ServeOptions:
    from sm120kit.cli.args import check_range
    from sm120kit.serve.options import ServeOptions

    if args.metrics_port is not None:
        check_range("--metrics-port", args.metrics_port, 1, 65535, "a free TCP port, e.g. --metrics-port 9400")
    if args.allow_missing:  # known ids only, whether or not the patch check runs
        from sm120kit.patching.registry import load_patches, select

        select(load_patches(args.patch_dir or None), sorted(set(args.allow_missing)), "--allow-missing")

    return ServeOptions(
        patch_dirs=tuple(args.patch_dir or ()),
        allow_missing=frozenset(args.allow_missing),
        patch_check=not args.no_patch_check,
        gpu_check=not args.no_gpu_check,
        kill_stale=args.kill_stale,
        echo=not args.quiet,
        debug=args.debug,
        metrics_port=args.metrics_port if args.metrics_port is not None else profile.server.metrics_port,
    )


def _serve_fleet(args, profile: Profile, fleet: FleetLaunch, target: Target, options: ServeOptions) -> int:
    """serve on a profile with a [fleet] table: the replicas here and the router."""
    from sm120kit import report
    from sm120kit.fleet import command
    from sm120kit.serve import preflight

    width = report.output_width(args.wide)
    if not args.check:
        return command.serve_fleet(fleet, target, options, width)
    checked = command.run_preflight(fleet, target, options)
    if args.json:
        report.emit_json(checked.as_json())
    else:
        command.show_plan(fleet)
        preflight.show(checked, width)
    return checked.exit_code
