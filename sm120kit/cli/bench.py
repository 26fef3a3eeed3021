"""`bench`: concurrency sweeps and searches, and its verb `bench compare`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from sm120kit.cli.args import (
    OptionalVerbs,
    allow_known_failure_arg,
    check_range,
    command_parser,
    common_args,
    patch_dir_arg,
    profile_args,
    target_args,
)
from sm120kit.cli.profiles import render_for
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from sm120kit.bench.command import BenchOptions
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Target


def register(sub) -> None:
    """bench, bench compare."""
    p = command_parser(
        sub,
        "bench",
        "a concurrency sweep with sglang's own benchmark client; a search over variants; `bench compare`",
        "Run sglang's benchmark client once per concurrency level against a running server (the "
        "profile PROFILE's, or --url; --serve starts the profile's first and stops it after), then "
        "print the tables and the plateau verdict and write a results directory. The smoke (`sm120kit "
        "smoke`) runs first: a server that fails it is still swept, so that its figures stand next to "
        "the failure, but the run is marked (run.json, the tables) and exits 1.\n"
        "With --serve and --vary KEY=V1,V2 (repeatable: every combination) or --variants NAME|FILE, "
        "a search: each variant (the profile as written first) is started, smoked, swept and stopped "
        "in turn; one that fails the smoke is excluded (not swept: a configuration that answers "
        "wrong is never a winner), one that crashes is recorded with its diagnosis, and the report "
        "names the best variant per concurrency and overall (only where it beats the next by more "
        "than the spread of --repeat's runs) and how to adopt it. A rerun with the same --out skips "
        "the variants already done. A variant that serve's preflight would refuse on the profile and the "
        "environment (its patches, what the server imports, its ports) is refused in the plan, never "
        "started. --dry-run lists the variants and the estimated time.\n"
        "`sm120kit bench compare` reads results back (`sm120kit bench compare --help`).",
        {
            ExitCode.OK: "every level ran and every request completed (and the smoke passed); a search: every "
            "runnable variant passed its smoke and was swept",
            ExitCode.FINDINGS: "a level or a request failed, or the smoke failed (the finished levels are "
            "reported and kept); a search: a variant was excluded by its smoke, crashed, or refused by the "
            "preflight (a rerun tries it again); --dry-run: a variant the preflight would refuse (its patches "
            "not in place, a package the server imports missing, two of its ports the same), listed with why",
            ExitCode.ERROR: "bad input, no sglang in the client's environment, no server at the URL, or "
            "--serve's server did not get ready (nothing was benchmarked)",
            ExitCode.UNCLEAN: "a search stopped: a variant's server left a process, port or GPU memory behind",
            ExitCode.INTERRUPTED: "interrupted: the finished levels are kept (--serve: the server is stopped; "
            "a search: rerun with the same --out to go on)",
        },
        func=cmd_bench,
    )
    # nargs="*": one profile or none (--url), and bench's mistakes said as bench says them; the
    # words of `bench OPTIONS compare DIR...`, the spelling before compare was a verb, land here
    p.add_argument(
        "name", nargs="*", metavar="PROFILE", help="the launch profile whose server to benchmark (none with --url)"
    )
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
        help="start the profile's server first (its preflight, then the supervisor), stop it afterwards",
    )
    p.add_argument(
        "--no-gpu-check",
        action="store_true",
        help="with --serve: start the server without the preflight's GPU check",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run each level N times: the median of each figure, and the spread (lowest .. highest run) that "
        "the verdicts respect (default 1)",
    )
    p.add_argument(
        "--no-smoke",
        action="store_true",
        help="skip the smoke before the sweep (and, in a search, before each variant's)",
    )
    search = p.add_argument_group("search (with --serve)")
    search.add_argument(
        "--vary",
        action="append",
        metavar="KEY=V1,V2",
        help="a profile key and its values, each read as --set reads one (repeatable: every combination)",
    )
    search.add_argument(
        "--variants",
        metavar="NAME|FILE",
        help="named variants: a variants file, or NAME for variants/NAME.toml in a profile directory",
    )
    search.add_argument(
        "--dry-run",
        action="store_true",
        help="list the variants (runnable; or skipped, or refused by serve's preflight, and why) and the "
        "estimated time; start nothing",
    )
    patch_dir_arg(p, "for the patch status recorded with the results, and --serve's preflight")
    allow_known_failure_arg(p)
    profile_args(p)
    target_args(p, python_is="the environment that runs sglang's benchmark client, and with --serve the server")
    common_args(p, wide=True)

    verbs = p.add_subparsers(dest="verb", metavar="VERB", title="verb", prog=p.prog, action=OptionalVerbs)
    v = command_parser(
        verbs,
        "compare",
        "two results directories side by side, or a search's variants by concurrency",
        "Read results back, benchmarking nothing: `sm120kit bench compare BEFORE AFTER` shows two "
        "results directories (of `sm120kit bench`) side by side, level by level; `sm120kit bench compare "
        "SEARCH_DIR` a search's variants by concurrency and its verdicts, as the search printed them.",
        {
            ExitCode.OK: "compared (or the search's report printed, whatever the search found)",
            ExitCode.ERROR: "not a results directory (or not a search directory), or more than two",
        },
        func=cmd_bench_compare,
    )
    v.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="two results directories (BEFORE AFTER), or one search directory",
    )
    common_args(v, wide=True)


def _check_bench_numbers(args) -> None:
    from sm120kit.profiles.model import MAX_TOKENS

    for option, value in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        check_range(option, value, 1, MAX_TOKENS, f"tokens per request, e.g. {option} 256")
    check_range(
        "--prompts-per-level",
        args.prompts_per_level,
        0,
        1000,
        "requests per level as a multiple of the concurrency, e.g. --prompts-per-level 3",
        low_open=True,
    )
    check_range("--repeat", args.repeat, 1, 100, "runs per level, e.g. --repeat 3")
    check_range(
        "--threshold",
        args.threshold,
        0,
        1,
        "the smallest gain per doubling that is not a plateau, e.g. --threshold 0.1 (10%)",
        low_open=True,
    )


def _options(args):
    """The typed options, every value checked before anything runs."""
    from pathlib import Path

    from sm120kit.bench import analysis
    from sm120kit.bench.command import BenchOptions
    from sm120kit.errors import UserError
    from sm120kit.urls import url_option

    _check_bench_numbers(args)
    try:
        levels = analysis.parse_levels(args.concurrency)
    except analysis.BadLevels as exc:
        raise UserError(
            f"--concurrency {args.concurrency!r}: {exc}",
            "give a comma-separated list, e.g. --concurrency 64,128,256,512",
        ) from None
    return BenchOptions(
        levels=levels,
        input_len=args.input_len,
        output_len=args.output_len,
        prompts_per_level=args.prompts_per_level,
        threshold=args.threshold,
        tokenizer=args.tokenizer,
        model=args.model or None,
        out=Path(args.out) if args.out else None,
        url=url_option("--url", args.url) if args.url is not None else None,
        python=args.python,
        patch_dirs=tuple(args.patch_dir or ()),
        repeat=args.repeat,
        smoke=not args.no_smoke,
    )


def _server_words(args) -> list[str]:
    """What names the server a bench runs against: the profile, or --url."""
    return [*args.name, *(["--url", args.url] if args.url is not None else [])]


def cmd_bench_compare(args) -> int:
    return _compare(args.dirs, args.json, args.wide)


def _compare(dirs: list[str], json: bool, wide: bool) -> int:
    from sm120kit import report
    from sm120kit.bench import command, render
    from sm120kit.errors import UserError

    width = report.output_width(wide)
    if len(dirs) > 2:
        raise UserError(
            "bench compare takes two results directories, or one search directory",
            "sm120kit bench compare BEFORE_DIR AFTER_DIR, or sm120kit bench compare SEARCH_DIR",
        )
    if len(dirs) == 1:
        from sm120kit.bench.search_report import load_search

        found = load_search(dirs[0])
        if json:
            report.emit_json(found.as_json())
        else:
            print(render.search_text(found, width))
        return ExitCode.OK
    comparison = command.compare(dirs[0], dirs[1])
    if json:
        report.emit_json(comparison.as_json())
    else:
        print(render.comparison_text(comparison, width))
    return ExitCode.OK


def cmd_bench(args) -> int:
    from sm120kit import followup, report
    from sm120kit.bench import command, render
    from sm120kit.errors import UserError

    if args.name[:1] == ["compare"]:  # `bench --json compare A B`: compare's words after bench's options
        report.print_warnings(
            [
                "`sm120kit bench OPTIONS compare DIR...` is deprecated (compare is a verb now, and bench's own "
                "options are ignored there); write `sm120kit bench compare DIR... [--json] [--wide]`"
            ],
            args.wide,
        )
        return _compare(args.name[1:], args.json, args.wide)
    width = report.output_width(args.wide)
    if len(args.name) != (0 if args.url is not None else 1):
        got = " ".join(args.name) or "none"
        raise UserError(
            f"bench takes one profile, or --url without one (got: {got})",
            "sm120kit bench glm5-nvfp4 --concurrency 64,128, or sm120kit bench --url http://127.0.0.1:30000",
        )
    if args.site:
        raise UserError(
            "--site names packages, not a python that can run the benchmark client",
            f"give the serving environment's interpreter: `{followup.command('bench', *_server_words(args))}`",
        )
    options = _options(args)
    searching = bool(args.vary or args.variants)
    if args.vary and args.variants:
        raise UserError("--vary and --variants are two ways to name the variants", "give one of them")
    if searching and not args.serve:
        option = "--vary" if args.vary else "--variants"
        variants = [w for v in args.vary or () for w in ("--vary", v)] or ["--variants", args.variants]
        raise UserError(
            f"{option} starts a server per variant: it needs --serve",
            f"`{followup.command('bench', *(args.name or ['PROFILE']), '--serve', *variants)}`",
        )
    if args.dry_run and not searching:
        raise UserError(
            "--dry-run plans a search: give --vary or --variants",
            f"`{followup.command('bench', *(args.name or ['PROFILE']), '--serve', '--vary=KEY=V1,V2', '--dry-run')}`",
        )
    if args.serve and args.url:
        raise UserError(
            "--serve starts a profile's server; with --url the server is yours",
            f"`{followup.command('bench', 'PROFILE', '--serve')}`, or drop --serve to benchmark the server at --url",
        )
    from sm120kit.target import resolve_target

    target = resolve_target(args.python, None)
    profile = server = None
    out = sys.stderr if args.json else sys.stdout  # the JSON document alone on stdout
    if searching:
        return _search(args, options, target, width, out)
    if not args.url:
        from sm120kit.profiles.loader import load_profile
        from sm120kit.profiles.render import require_servable

        profile = load_profile(args.name[0], args.profile_dir, args.sets)
        require_servable(profile)
        if args.serve:
            server = _served(args, profile, target, width, out)
    result = command.sweep(options, profile, target, render.TextProgress(width, out), server)
    if args.json:
        report.emit_json(result.as_json())
    else:
        print(render.sweep_text(result, width), file=sys.stderr if result.interrupted else sys.stdout)
    return result.exit_code


def _serve_options(args):
    from sm120kit.serve.options import ServeOptions

    return ServeOptions(
        patch_dirs=tuple(args.patch_dir or ()), gpu_check=not args.no_gpu_check, echo=False, debug=args.debug
    )


def _served(args, profile: Profile, target: Target, width: int | None, out: TextIO):
    """The context that runs the profile's server for the sweep (bench --serve)."""
    from sm120kit.bench.serving import served

    launch = render_for(args, profile, target)  # args.site is None: bench refuses --site; a fleet: all of it
    return served(profile, launch, target, _serve_options(args), width, out, debug=args.debug)


def _search(args, options: BenchOptions, target: Target, width: int | None, out: TextIO) -> int:
    """bench --serve --vary / --variants: plan every variant (bad input raises before
    anything starts), then the dry run or the search."""
    from sm120kit import endpoint, report
    from sm120kit.bench import render, search, variant_plan, variant_reading

    found, source, written_for = variant_reading.load_variants(args.vary, args.variants, args.profile_dir)
    base_sets = list(args.sets or [])
    plan = variant_plan.plan(
        args.name[0],
        args.profile_dir,
        base_sets,
        found,
        target,
        args.python or sys.executable,
        source,
        written_for,
        args.patch_dir or (),
        args.allow_known_failure,
        args.capability,
        _serve_options(args),  # a variant serve's preflight would refuse is refused in the plan
    ).with_serve_args(args.profile_dir, args.python)
    endpoint.api_key(plan.variants[0].profile.server.api_key_env)  # a missing key: before anything starts
    if args.dry_run:
        result = search.dry_run(plan, options, options.out or search.default_directory(plan.profile), base_sets)
    else:
        opts = search.SearchOptions(options, _serve_options(args), args.debug)
        result = search.search(opts, plan, base_sets, target, render.SearchProgress(width, out), width, out)
    if args.json:
        report.emit_json(result.as_json())
    else:
        print(render.search_text(result, width), file=sys.stderr if result.interrupted else sys.stdout)
    return result.exit_code
