"""`bench`: concurrency sweeps, and `bench compare`."""

from __future__ import annotations

from sm120kit.cli.args import check_range, profile_args, target_args


def register(sub) -> None:
    """bench."""
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
    profile_args(p)
    target_args(p)
    p.add_argument("--debug", action="store_true", help="print tracebacks and full details")
    p.set_defaults(func=cmd_bench, json=False)  # its record is the results directory


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
    check_range(
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
