"""The command line. Thin: parse, call the engine, render. Heavy imports happen inside
the command functions so that `sm120kit --help` stays fast.

Exit codes (like Black): 0 nothing wrong; 1 something would change or is missing
(check mode, status); 2 an error: anchor-missing, foreign-edit, bad input.
"""

from __future__ import annotations

import argparse
import sys

from sm120kit import __version__

EPILOG = """\
after every `pip install -U sglang`:   sm120kit patch --verify
read-only, for CI and Dockerfiles:     sm120kit patch --check
the exact server command:              sm120kit serve glm5-nvfp4 --dry-run
exit codes: 0 ok, 1 something would change (check mode, status), 2 error"""


def _target_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target environment (default: this interpreter)")
    group.add_argument(
        "--python", metavar="EXE", help="the python of the environment to patch (sm120kit need not be installed there)"
    )
    group.add_argument("--site", metavar="DIR", help="a site-packages directory, e.g. an unpacked image layer")


def _patch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--patch-dir",
        action="append",
        metavar="DIR",
        help="also load patches from DIR (before the shipped ones; repeatable; or $SM120KIT_PATCH_PATH)",
    )
    parser.add_argument("--only", action="append", metavar="ID", help="just this patch (repeatable)")


def _allow_missing_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-missing",
        action="append",
        metavar="ID",
        default=[],
        help="go on although patch ID's anchor is missing on the installed release (repeatable); `patch` records it in the ledger for that release",
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    parser.add_argument("--debug", action="store_true", help="print tracebacks and full details")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm120kit",
        description="Patch and launch sglang on SM120 nodes (RTX PRO 6000 Blackwell, RTX 5090).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sm120kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("patches", help="list the known patches: id, releases, upstream fix")
    p.add_argument("--patch-dir", action="append", metavar="DIR", help="also list patches from DIR")
    _common(p)
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser("status", help="one row per patch: installed version, outcome, upstream fix")
    _target_args(p)
    _patch_args(p)
    _allow_missing_arg(p)
    _common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("patch", help="apply the patches that the installed releases need")
    _target_args(p)
    _patch_args(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything would change")
    mode.add_argument("--diff", action="store_true", help="write nothing; print the unified diff that would be written")
    mode.add_argument("--verify", action="store_true", help="apply, then prove from disk that every patch is in place")
    p.add_argument("--force", action="store_true", help="patch files that someone else edited")
    _allow_missing_arg(p)
    p.add_argument(
        "--keep-jit-cache", action="store_true", help="keep JIT caches (flashinfer) built from the old sources"
    )
    _common(p)
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("unpatch", help="restore the vendor's bytes, proven against the wheel's RECORD")
    _target_args(p)
    _patch_args(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be restored, write nothing")
    p.add_argument("--force", action="store_true", help="restore the originals even over later edits")
    p.add_argument(
        "--keep-jit-cache", action="store_true", help="keep JIT caches (flashinfer) built from the patched sources"
    )
    _common(p)
    p.set_defaults(func=cmd_unpatch)

    p = sub.add_parser("profiles", help="the shipped and user launch profiles, one line each")
    _profile_args(p, sets=False)
    _common(p)
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("profile", help="show, check or export the schema of launch profiles")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    v = verbs.add_parser("show", help="the resolved profile (after extends and --set)")
    v.add_argument("name")
    _profile_args(v)
    _common(v)
    v.set_defaults(func=cmd_profile_show)
    v = verbs.add_parser("check", help="render the profile for the installed sglang; exit 0 or 2")
    v.add_argument("name")
    _profile_args(v)
    _target_args(v)
    _common(v)
    v.set_defaults(func=cmd_profile_check)
    v = verbs.add_parser("schema", help="the JSON Schema of profile files, for editor completion")
    _common(v)
    v.set_defaults(func=cmd_profile_schema)

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
    _allow_missing_arg(p)
    p.add_argument(
        "--no-gpu-check", action="store_true", help="skip the GPU count, compute capability and free-memory check"
    )
    p.add_argument(
        "--quiet", action="store_true", help="do not echo the server's log (it is still written to the log file)"
    )
    p.add_argument(
        "--patch-dir", action="append", metavar="DIR", help="also load patches from DIR (or $SM120KIT_PATCH_PATH)"
    )
    _profile_args(p)
    _target_args(p)
    _common(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "bench",
        help="a concurrency sweep with sglang's own benchmark client; `bench compare A B`",
        description="Run sglang's benchmark client once per concurrency level against a running server "
        "(the profile's, or --url), then print the table and the plateau verdict and write a results directory. "
        "`sm120kit bench compare BEFORE AFTER` shows two results directories side by side.",
    )
    p.add_argument("name", nargs="*", metavar="PROFILE | compare BEFORE AFTER")
    p.add_argument("--url", help="benchmark this server instead of a profile's (e.g. http://127.0.0.1:30000)")
    p.add_argument(
        "--concurrency",
        default="32,64,128,256,512",
        metavar="LIST",
        help="levels, comma-separated (default 32,64,128,256,512)",
    )
    p.add_argument("--input-len", type=int, default=256, metavar="N", help="input tokens per request (default 256)")
    p.add_argument("--output-len", type=int, default=128, metavar="N", help="output tokens per request (default 128)")
    p.add_argument(
        "--prompts-per-level",
        type=float,
        default=3.0,
        metavar="K",
        help="requests per level: K x concurrency, at least 32 (default 3)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        metavar="F",
        help="a doubling that gains less than this is a plateau (default 0.10)",
    )
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer for the client (default: what the server reports)")
    p.add_argument("--model", metavar="NAME", help="model name for the client (default: what the server reports)")
    p.add_argument("--out", metavar="DIR", help="results directory (default ./sm120kit-bench/<profile>-<time>)")
    p.add_argument(
        "--serve",
        action="store_true",
        help="start the profile's server with `sm120kit serve` first, stop it afterwards",
    )
    p.add_argument(
        "--no-gpu-check",
        action="store_true",
        help="with --serve: passed on to `sm120kit serve` (start without its GPU check)",
    )
    _profile_args(p)
    _target_args(p)
    p.add_argument("--debug", action="store_true", help="print tracebacks and full details")
    p.set_defaults(func=cmd_bench, json=False)  # its record is the results directory

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
    _profile_args(p)
    _target_args(p)
    _common(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("ps", help="what `sm120kit serve` runs here: status, since when, restarts, last health")
    _common(p)
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("diagnose", help="match a server log against known SM120 failure signatures")
    p.add_argument("log", help="an sglang server log file ('-' for standard input)")
    p.add_argument("--tail", type=int, default=400, metavar="N", help="look at the last N lines (default 400)")
    _common(p)
    p.set_defaults(func=cmd_diagnose)
    return parser


def _profile_args(parser: argparse.ArgumentParser, sets: bool = True) -> None:
    parser.add_argument(
        "--profile-dir",
        action="append",
        metavar="DIR",
        help="also load profiles from DIR (before the shipped ones; repeatable; or $SM120KIT_PROFILE_PATH)",
    )
    if sets:
        parser.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            dest="sets",
            help="override a profile key, e.g. engine.max_running_requests=2048 (repeatable)",
        )


def _load(args, selected: bool = True):
    from sm120kit.patching.registry import load_patches, select
    from sm120kit.target import resolve_target

    patches = load_patches(args.patch_dir)
    chosen = select(patches, args.only, "--only")
    select(patches, getattr(args, "allow_missing", None), "--allow-missing")  # known ids only
    return resolve_target(args.python, args.site), chosen if selected else patches


def _allowed(args) -> frozenset[str]:
    return frozenset(getattr(args, "allow_missing", None) or ())


def cmd_patches(args) -> int:
    from sm120kit import report
    from sm120kit.patching.registry import load_patches, shipped_dir

    text, docs = report.patch_listing(load_patches(args.patch_dir), str(shipped_dir()))
    report.emit_json({"patches": docs}) if args.json else print(text)
    return 0


def cmd_status(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = _load(args)
    plan = engine.plan(target, patches, need_bytes=False, allow_missing=_allowed(args))
    code = plan.exit_code(check=True)
    if args.json:
        report.emit_json(report.plan_json("status", plan, code))
        return code
    report.print_plan(plan, args.debug)
    return code


def cmd_patch(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = _load(args)
    if args.check or args.diff:
        plan = engine.plan(target, patches, force=args.force, need_bytes=args.diff, allow_missing=_allowed(args))
        code = plan.exit_code(check=args.check)
        diffs = [c.diff() for c in plan.changes] if args.diff else []
        if args.json:
            report.emit_json(
                report.plan_json("patch", plan, code, {"mode": "diff" if args.diff else "check", "diffs": diffs})
            )
            return code
        if args.diff:
            sys.stdout.write("".join(diffs))
            for f in plan.errors:
                print(f"error: {f.patch.id}: {f.outcome.value}: {f.detail}", file=sys.stderr)
            return code
    else:
        plan = engine.apply(
            target, patches, force=args.force, keep_jit_cache=args.keep_jit_cache, allow_missing=_allowed(args)
        )
        code = plan.exit_code(check=False)
    problems = engine.verify(target, patches) if args.verify and code == 0 else []
    if problems:
        code = 2
    if args.json:
        mode = "verify" if args.verify else "check" if args.check else "apply"
        report.emit_json(
            report.plan_json(
                "patch",
                plan,
                code,
                {"mode": mode, "verify_problems": problems, "verified": bool(args.verify and code == 0)},
            )
        )
        return code
    report.print_plan(plan, args.debug)
    print(report.summary(plan.findings) + ("" if not plan.errors else "; nothing was written"))
    if args.check and code == 1:
        print("would change: run `sm120kit patch` to apply")
    if args.verify:
        if problems:
            print("verify FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        elif code == 0:
            caveat = "; unproven on this release: see above" if plan.unproven else ""
            print(
                f"verified: every patch is in place, fixed upstream or not applicable, and matches the ledger{caveat}"
            )
    return code


def cmd_unpatch(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = _load(args, selected=False)
    only = set(args.only) if args.only else None
    result = engine.unpatch(
        target, patches, only, force=args.force, dry_run=args.dry_run, keep_jit_cache=args.keep_jit_cache
    )
    rows = result.rows
    code = 2 if any(r.is_error for r in rows) else 0
    if args.json:
        report.emit_json(
            {
                "command": "unpatch",
                "target": target.as_json(),
                "results": [r.as_json() for r in rows],
                "warnings": result.warnings,
                "jit_cache_removed": [str(p) for p in result.jit_cache_removed],
                "exit_code": code,
            }
        )
        return code
    print(f"target: {target.description}")
    report.print_cache_notes(result)
    if not rows:
        print("nothing to restore: no file carries an sm120kit patch")
        return code
    print(report.restore_table(rows))
    if code:
        print("nothing was written", file=sys.stderr)
    return code


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


def _launch(args):
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

    _, launch, _ = _launch(args)
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


def cmd_serve(args) -> int:
    from sm120kit import report
    from sm120kit.errors import UserError

    if args.site and not args.dry_run:
        raise UserError(
            "--site names packages, not a python that can run the server",
            f"give the serving environment's interpreter: sm120kit serve {args.name} --python EXE (or --dry-run)",
        )
    profile, launch, target = _launch(args)
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


def _check_range(option: str, value: float, low: float, high: float, hint: str, low_open: bool = False) -> None:
    """A numeric option must be finite and within its range (nan, inf, 0 or -1 passed
    argparse and misbehaved later): else a UserError naming the option and the range."""
    import math

    from sm120kit.errors import UserError

    if math.isfinite(value) and (value > low if low_open else value >= low) and value <= high:
        return

    def plain(x: float) -> str:
        return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"

    kind = "an integer" if isinstance(value, int) else "a number"
    allowed = (
        f"{kind} above {plain(low)} and at most {plain(high)}"
        if low_open
        else f"{kind} from {plain(low)} to {plain(high)}"
    )
    raise UserError(f"{option} {plain(value) if isinstance(value, int) else f'{value:g}'}: allowed: {allowed}", hint)


def _check_bench_numbers(args) -> None:
    from sm120kit.profiles.model import MAX_TOKENS

    for option, value in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        _check_range(option, value, 1, MAX_TOKENS, f"tokens per request, e.g. {option} 256")
    _check_range(
        "--prompts-per-level",
        args.prompts_per_level,
        0,
        1000,
        "requests per level as a multiple of the concurrency, e.g. --prompts-per-level 3",
        low_open=True,
    )
    _check_range(
        "--threshold",
        args.threshold,
        0,
        1,
        "the smallest gain per doubling that is not a plateau, e.g. --threshold 0.1 (10%)",
        low_open=True,
    )


def cmd_bench(args) -> int:
    from sm120kit.bench import command
    from sm120kit.errors import UserError

    if args.name[:1] == ["compare"]:
        if len(args.name) != 3:
            raise UserError(
                "bench compare takes two results directories", "sm120kit bench compare BEFORE_DIR AFTER_DIR"
            )
        return command.compare(args.name[1], args.name[2])
    if len(args.name) != (0 if args.url else 1):
        got = " ".join(args.name) or "none"
        raise UserError(
            f"bench takes one profile, or --url without one (got: {got})",
            "sm120kit bench glm5-nvfp4 --concurrency 64,128, or sm120kit bench --url http://127.0.0.1:30000",
        )
    if args.site:
        raise UserError(
            "--site names packages, not a python that can run the benchmark client",
            "give the serving environment's interpreter: --python EXE",
        )
    _check_bench_numbers(args)
    from sm120kit.target import resolve_target

    profile = None
    if not args.url:
        from sm120kit.profiles.loader import load_profile
        from sm120kit.profiles.render import require_servable

        profile = load_profile(args.name[0], args.profile_dir, args.sets)
        require_servable(profile)
    return command.bench(args, profile, resolve_target(args.python, None))


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


def cmd_ps(args) -> int:
    from sm120kit import report
    from sm120kit.serve.rundir import runs, serve_root

    found = runs()
    damaged = [r["error"] for r in found if r["status"] == "damaged"]
    code = 2 if damaged else 0  # a record that cannot be read is not "nothing served"
    if args.json:
        report.emit_json({"runs": found, "exit_code": code})
        return code
    if not found:
        print(f"nothing served here yet (no run under {serve_root()})")
        return 0
    print(
        report.table(
            ["PROFILE", "STATUS", "SUPERVISOR", "SERVER", "SINCE", "RESTARTS", "LAST HEALTH", "PORT"],
            [report.ps_row(r) for r in found],
        )
    )
    for error in damaged:
        print(
            f"sm120kit: error: damaged run record {error}; `sm120kit serve` of that profile writes a new one",
            file=sys.stderr,
        )
    return code


def cmd_diagnose(args) -> int:
    """Exit 0: no known signature; 1: one or more found; 2: bad input."""
    from sm120kit import report
    from sm120kit.errors import UserError
    from sm120kit.serve.diagnose import MAX_TAIL_LINES, diagnose, read_tail

    _check_range("--tail", args.tail, 1, MAX_TAIL_LINES, "the number of last lines to look at, e.g. --tail 400")
    try:
        if args.log == "-":
            text = read_tail(sys.stdin.buffer, args.tail)
        else:
            with open(args.log, "rb") as fh:
                text = read_tail(fh, args.tail)  # only the end: a log can be gigabytes
    except OSError as exc:
        raise UserError(
            f"cannot read the log {args.log}: {exc.strerror}", "pass the server's log file, or - for standard input"
        ) from None
    found = diagnose(text, args.tail)
    if args.json:
        report.emit_json({"log": args.log, "diagnoses": [d.as_json() for d in found], "exit_code": int(bool(found))})
        return int(bool(found))
    if not found:
        print(f"no known SM120 failure signature in the last {args.tail} lines of {args.log}")
    for d in found:
        print(f"{d.id}: {d.title}\n  log:    {d.line}\n  advice: {d.advice}")
    return int(bool(found))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from sm120kit.errors import UserError

    try:
        return args.func(args)
    except UserError as exc:
        if args.json:
            import json

            print(json.dumps({"error": exc.message, "hint": exc.hint, "exit_code": 2}))
        print(f"sm120kit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sm120kit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): not our error, nothing to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    except Exception as exc:  # a bug: say so plainly; the traceback is for --debug
        if args.debug:
            raise
        print(
            f"sm120kit: internal error: {type(exc).__name__}: {exc}\n  rerun with --debug for the traceback and report it",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
