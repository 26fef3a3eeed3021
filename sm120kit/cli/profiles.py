"""`profiles` and `profile show|check|schema`: launch profiles."""

from __future__ import annotations

import sys
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
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.serve.options import ServeOptions
    from sm120kit.serve.preflight import Preflight
    from sm120kit.target import Target

NAME_HELP = "a profile name (`sm120kit profiles` lists them) or the path of a .toml file"


def register(sub) -> None:
    """profiles, profile show|check|schema."""
    p = command_parser(
        sub,
        "profiles",
        "the shipped and user launch profiles, one line each",
        "List the launch profiles: those of --profile-dir and $SM120KIT_PROFILE_PATH first, then "
        "the shipped ones; a file that does not parse is listed with the reason.",
        {ExitCode.OK: "listed", ExitCode.ERROR: "bad input, e.g. a --profile-dir that does not exist"},
        func=cmd_profiles,
    )
    profile_args(p, sets=False)
    common_args(p, wide=True)

    p = command_parser(
        sub,
        "profile",
        "show, check or export the schema of launch profiles",
        "A launch profile says what the operator means (model, parallelism, backends, limits, "
        "health budgets, the patches it needs); `sm120kit serve` renders it into the flags the "
        "installed sglang accepts. `sm120kit profile VERB --help` says more.",
        {
            ExitCode.OK: "shown, renders for the installed sglang, or the schema printed",
            ExitCode.ERROR: "an unknown or invalid profile, one that does not render for the installed sglang, "
            "or no sglang there",
        },
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    v = command_parser(
        verbs,
        "show",
        "the resolved profile (after extends and --set)",
        "Print the profile as sm120kit reads it, as TOML (a profile file's format; --json for JSON): "
        "its `extends` chain resolved, the --set overrides applied, validated, every field with its value "
        "(defaults included; a field not set is a comment).",
        {ExitCode.OK: "shown", ExitCode.ERROR: "an unknown or invalid profile, or a bad --set"},
        func=cmd_profile_show,
    )
    v.add_argument("name", metavar="PROFILE", help=NAME_HELP)
    profile_args(v)
    common_args(v, prints="the TOML")
    v = command_parser(
        verbs,
        "check",
        "render the profile for the installed sglang and judge it as serve would; exit 0, 1 or 2",
        "Render the profile into the sglang command line for the release installed in the target "
        "environment (flags read from its source, nothing imported), as `sm120kit serve` would; refuse a "
        "profile that cannot serve, or that runs into a known SM120 failure of the release (the shipped "
        "survey and the known-failures.toml of each --patch-dir and $SM120KIT_PATCH_PATH, as serve reads "
        "them); then run the checks of serve's preflight that do not look at this node: the packages the "
        "server imports are installed (not with --site: it names no interpreter to ask), the profile's "
        "patches are in place, no two of its ports are the same. Starts nothing.",
        {
            ExitCode.OK: "it renders and serve's checks pass (warnings, if any, on stderr)",
            ExitCode.FINDINGS: "it renders, but serve would refuse to start it: a check failed (its patches "
            "not in place, a package the server imports missing, two of its ports the same), each said on "
            "stderr with its fix",
            ExitCode.ERROR: "it does not: an unknown or invalid profile, a flag or value the release lacks, "
            "a profile that cannot serve, a known SM120 failure of the release that no applied patch covers, "
            "or no sglang in the target",
        },
        func=cmd_profile_check,
    )
    v.add_argument("name", metavar="PROFILE", help=NAME_HELP)
    profile_args(v)
    target_args(v, python_is="the serving environment, whose sglang the profile is rendered for")
    patch_dir_arg(v, "the profile's patches, and the known failures of their known-failures.toml")
    v.add_argument(
        "--no-patch-check",
        action="store_true",
        help="do not judge the profile's patches (as `serve --no-patch-check` starts without them)",
    )
    allow_missing_arg(v)
    allow_known_failure_arg(v)
    common_args(v, prints="the text")
    v = command_parser(
        verbs,
        "schema",
        "the JSON Schema of profile files, for editor completion",
        "Print the JSON Schema of a profile file (every key, its type and allowed range). Save it "
        "and add `#:schema ./profile.schema.json` atop a profile for completion in taplo-based editors.",
        {ExitCode.OK: "printed", ExitCode.ERROR: "bad input (an unknown option)"},
        func=cmd_profile_schema,
    )
    common_args(v, prints=None)


def cmd_profiles(args) -> int:
    from sm120kit import report
    from sm120kit.profiles.loader import list_profiles

    found = list_profiles(args.profile_dir)
    if args.json:
        report.emit_json({"profiles": [{"name": n, "path": str(p), "description": d} for n, p, d in found]})
    else:
        rows = [[n, d] for n, _, d in found]
        print(report.table(["PROFILE", "DESCRIPTION"], rows, report.output_width(args.wide), narrow=(1,)))
    return ExitCode.OK


def cmd_profile_show(args) -> int:
    import json

    from sm120kit.profiles.loader import load_profile

    profile = load_profile(args.name, args.profile_dir, args.sets)
    doc = profile.model_dump(mode="json", exclude={"name", "source"})
    if args.json:
        print(json.dumps({"name": profile.name, "source": profile.source, "profile": doc}, indent=2))
    else:
        from sm120kit import report
        from sm120kit.profiles import toml_text

        width = report.output_width(getattr(args, "wide", False))
        comment = report.wrap(f"{profile.name}  ({profile.source})", width and width - 2, hanging="")
        print("\n".join(f"# {line}" for line in comment.splitlines()))  # a comment on every line of it
        print("# resolved: extends and --set applied; a key not set is a comment; --json for JSON")
        print(toml_text.dumps(doc), end="")  # the format of a profile file, to copy from
    return ExitCode.OK


def render_launch(args, router_optional: bool = False):
    """(profile, its launch rendered for the target's sglang, the target)."""
    profile, target = load_for(args)
    return profile, render_for(args, profile, target, router_optional), target


def load_for(args):
    """(the profile NAME with --set applied, the target) for a command that serves it."""
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import require_servable
    from sm120kit.target import resolve_target

    sets = list(args.sets or [])
    if getattr(args, "node_rank", None) is not None:
        sets.append(f"parallel.node_rank={args.node_rank}")
    profile = load_profile(args.name, args.profile_dir, sets)
    require_servable(profile)  # before the target: a base profile is refused anywhere
    require_known_patches(profile, getattr(args, "patch_dir", None))
    return profile, resolve_target(args.python, args.site)


def require_known_patches(profile: Profile, patch_dirs: list[str] | None) -> None:
    """Every id of the profile's `patches` is a patch's (--patch-dir, $SM120KIT_PATCH_PATH,
    the shipped ones): a UserError (exit 2) for one that is not, whether or not a check of
    the patches runs later (`profile check`, `serve --dry-run`, `--no-patch-check`)."""
    if not profile.patches:
        return
    from sm120kit.patching.registry import load_patches, select

    select(
        load_patches(patch_dirs or None), list(profile.patches), f"profile {profile.name} ({profile.source}): patches"
    )


def render_for(args, profile: Profile, target: Target, router_optional: bool = False) -> Launch | FleetLaunch:
    """The profile's launch rendered for the sglang installed in the target (--python /
    --site): what `profile check`, `serve` and `bench --serve` run. A fleet profile: its
    FleetLaunch (the replicas' launches and the router's argv; serve's --router-only and
    --replicas-only choose the part)."""
    from sm120kit.profiles.flags import installed_schema
    from sm120kit.profiles.render import render

    python = args.python or ("python3" if args.site else sys.executable)
    launch: Launch | FleetLaunch
    if profile.fleet is not None:
        from sm120kit.fleet.launch import Mode, render_fleet

        part = Mode.ROUTER_ONLY if getattr(args, "router_only", False) else Mode.ALL
        part = Mode.REPLICAS_ONLY if getattr(args, "replicas_only", False) else part
        fleet = render_fleet(profile, target, python, part, router_optional)
        launch, launches = fleet, list(fleet.replicas.values())
    else:
        launch = render(profile, installed_schema(target), python)
        launches = [launch]
    refuse_known_failures(args, profile, launches, target)
    return launch


def refuse_known_failures(args, profile: Profile, launches: list[Launch], target: Target) -> None:
    """The launch judged before anything loads (sm120kit.resolution.verdict): the survey's
    launch rules, and each kernel that sglang's own resolution of it dispatches on the node's
    capability. A known SM120 failure of the installed release that no applied patch covers,
    or a kernel with no SM12x build, is a UserError (exit 2); allowed and undecided ones
    become warnings, and each launch carries what will run (`what_runs`)."""
    from sm120kit.node.capability import presented_node
    from sm120kit.resolution import verdict

    if not launches:  # a fleet's router alone runs no sglang server
        return
    node = presented_node(profile, getattr(args, "capability", None))
    judged = verdict.judge(
        profile,
        launches[0],  # replicas differ in ports only
        target,
        node,
        getattr(args, "patch_dir", None) or (),
        getattr(args, "allow_known_failure", ()),
        _renderer(args, target) if profile.fleet is None else None,
    )
    if error := judged.refusal(f"profile {profile.name}", launches[0].sglang):
        raise error
    for launch in launches:
        launch.warnings.extend(judged.warnings())
        launch.what_runs = judged.as_json()


def _renderer(args, target: Target):
    """The profile NAME rendered again with more --set assignments: a way out's argv."""
    from sm120kit.profiles.flags import installed_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render

    python = args.python or ("python3" if args.site else sys.executable)

    def render_with(sets: list[str]) -> list:
        profile = load_profile(args.name, args.profile_dir, [*(args.sets or []), *sets])
        return render(profile, installed_schema(target), python).argv

    return render_with


def judged_anywhere(
    args, profile: Profile, launch: Launch | FleetLaunch, target: Target, options: ServeOptions
) -> Preflight:
    """serve's preflight of the launch less the checks of this node (sm120kit.serve.preflight,
    registry.ANYWHERE: what the server imports, its patches, its ports each its own): what a
    dry run and `profile check` say the start would refuse. --site names no interpreter to
    ask what the server imports: that check is skipped, saying so."""
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.serve import preflight

    off = {"imports": "--site names no interpreter to ask; give --python EXE"} if args.site else {}
    if isinstance(launch, FleetLaunch):
        from sm120kit.fleet.command import run_preflight

        return run_preflight(launch, target, options, on_this_node=False, off=off)
    return preflight.run(profile, launch, target, options, on_this_node=False, off=off)


def what_runs_lines(doc: dict | None, width: int | None) -> list[str]:
    """What will run, as `profile check` and `serve --dry-run` print it, fitted to `width`."""
    from sm120kit import report

    selection = (doc or {}).get("selection")
    if not selection:
        return []
    verdicts = {c.partition("=")[0]: k for k in selection["kernels"] for c in k["choices"]}
    lines = report.wrap(f"what will run, {selection['basis']}:", width).splitlines()
    lines.append(f"  {'capability from':<18} {selection['capability_from']}")
    wide = max((len(v) for v in selection["slots"].values()), default=0)
    for slot, value in selection["slots"].items():
        kernel = verdicts.get(slot)
        judged = f"  [{kernel['kernel']}: {kernel['verdict']}]" if kernel else ""
        lines += report.wrap(f"  {slot:<18} {value:<{wide}}{judged}".rstrip(), width, hanging=" " * 21).splitlines()
    return lines


def cmd_profile_check(args) -> int:
    from sm120kit import report
    from sm120kit.fleet.launch import FleetLaunch
    from sm120kit.serve import preflight

    profile, launch, target = render_launch(args, router_optional=True)  # a fleet's replicas: without a router
    checked = judged_anywhere(args, profile, launch, target, check_options(args, profile))
    if args.json:
        report.emit_json({"profile": args.name, "ok": not checked.failed, **launch.as_json(), **checked.verdict_json()})
        return checked.exit_code
    wide = getattr(args, "wide", False)
    report.print_warnings(launch.warnings, wide)
    shown = launch if not isinstance(launch, FleetLaunch) else next(iter(launch.replicas.values()), None)
    for line in what_runs_lines(shown.what_runs if shown else None, report.output_width(wide)):
        print(line)
    if isinstance(launch, FleetLaunch):
        one = next(iter(launch.replicas.values()))
        router = f"sglang-router {launch.router_version}" if launch.router else "a router not checked here"
        rendered = (
            f"a fleet of {len(launch.plan.replicas)} replica(s) for sglang {one.sglang} "
            f"({len(one.argv) - 3} arguments each) behind {router}"
        )
        verdict = f"ok, {rendered}"
    else:
        rendered = f"for sglang {launch.sglang} ({len(launch.argv) - 3} arguments)"
        verdict = f"ok {rendered}"
    if checked.failed:  # renders, and yet no start: said as the start would say it
        verdict = f"renders {rendered}, but serve would refuse to start it"
    print(f"profile {args.name}: {verdict}", flush=True)
    preflight.would_refuse(checked, report.error_width(wide), wide)
    return checked.exit_code


def check_options(args, profile: Profile) -> ServeOptions:
    """What `profile check` judges the launch with, as serve takes it: the patch directories,
    the patch check on or off, the anchors allowed missing, the profile's metrics port."""
    from sm120kit.serve.options import ServeOptions

    if args.allow_missing:  # known ids only, as serve takes them
        from sm120kit.patching.registry import load_patches, select

        select(load_patches(args.patch_dir or None), sorted(set(args.allow_missing)), "--allow-missing")
    return ServeOptions(
        patch_dirs=tuple(args.patch_dir or ()),
        allow_missing=frozenset(args.allow_missing),
        patch_check=not args.no_patch_check,
        metrics_port=profile.server.metrics_port,
    )


def cmd_profile_schema(args) -> int:
    import json

    from sm120kit.profiles.loader import profile_schema

    print(json.dumps(profile_schema(), indent=2))
    return ExitCode.OK
