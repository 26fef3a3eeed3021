"""`profiles` and `profile show|check|schema`: launch profiles."""

from __future__ import annotations

import sys

from sm120kit.cli.args import common_args, profile_args, target_args


def register(sub) -> None:
    """profiles, profile show|check|schema."""
    p = sub.add_parser("profiles", help="the shipped and user launch profiles, one line each")
    profile_args(p, sets=False)
    common_args(p)
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("profile", help="show, check or export the schema of launch profiles")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    v = verbs.add_parser("show", help="the resolved profile (after extends and --set)")
    v.add_argument("name")
    profile_args(v)
    common_args(v)
    v.set_defaults(func=cmd_profile_show)
    v = verbs.add_parser("check", help="render the profile for the installed sglang; exit 0 or 2")
    v.add_argument("name")
    profile_args(v)
    target_args(v)
    common_args(v)
    v.set_defaults(func=cmd_profile_check)
    v = verbs.add_parser("schema", help="the JSON Schema of profile files, for editor completion")
    common_args(v)
    v.set_defaults(func=cmd_profile_schema)


def cmd_profiles(args) -> int:
    from sm120kit import report
    from sm120kit.profiles.loader import list_profiles

    found = list_profiles(args.profile_dir)
    if args.json:
        report.emit_json({"profiles": [{"name": n, "path": str(p), "description": d} for n, p, d in found]})
    else:
        print(report.table(["PROFILE", "DESCRIPTION"], [[n, d] for n, _, d in found]))
    return 0


def cmd_profile_show(args) -> int:
    import json

    from sm120kit.profiles.loader import load_profile

    profile = load_profile(args.name, args.profile_dir, args.sets)
    doc = profile.model_dump(mode="json", exclude={"name", "source"})
    if args.json:
        print(json.dumps({"name": profile.name, "source": profile.source, "profile": doc}, indent=2))
    else:
        print(f"# {profile.name}  ({profile.source})")
        print(json.dumps(doc, indent=2))
    return 0


def render_launch(args):
    """(profile, its launch rendered for the target's sglang, the target)."""
    from sm120kit.errors import UserError
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render, require_servable
    from sm120kit.target import resolve_target

    sets = list(args.sets or [])
    if getattr(args, "node_rank", None) is not None:
        sets.append(f"parallel.node_rank={args.node_rank}")
    profile = load_profile(args.name, args.profile_dir, sets)
    require_servable(profile)  # before the target: a base profile is refused anywhere
    target = resolve_target(args.python, args.site)
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: a profile renders for the installed release",
            "point sm120kit at the serving environment with --python EXE or --site DIR",
        )
    python = args.python or ("python3" if args.site else sys.executable)
    return profile, render(profile, read_schema(dist), python), target


def cmd_profile_check(args) -> int:
    from sm120kit import report

    _, launch, _ = render_launch(args)
    if args.json:
        report.emit_json({"profile": args.name, "ok": True, **launch.as_json()})
        return 0
    for warning in launch.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"profile {args.name}: ok for sglang {launch.sglang} ({len(launch.argv) - 3} arguments)")
    return 0


def cmd_profile_schema(args) -> int:
    import json

    from sm120kit.profiles.loader import profile_schema

    print(json.dumps(profile_schema(), indent=2))
    return 0
