"""`smoke`: is a running server answering right?"""

from __future__ import annotations

import sys

from sm120kit.cli.args import check_range, command_parser, common_args, profile_args
from sm120kit.exit_codes import ExitCode

RECORDED = (
    "$SM120KIT_STATE_DIR/smoke/<profile>.json, or <host>-<port>.json with --url (the state dir's default: "
    "~/.local/state/sm120kit on Linux)"
)


def register(sub) -> None:
    """smoke."""
    p = command_parser(
        sub,
        "smoke",
        "is a running sglang server answering right? tasks, garbage, load, logprob drift",
        "Send generated tasks with one checkable answer to the profile PROFILE's server (or --url) "
        "through sglang's /generate, greedy with a fixed seed: at least 90 % must be answered right; no "
        'output may be garbage (empty, one token repeated, "!!!!", U+FFFD, a stop at once); the same '
        "tasks inside a burst of concurrent requests (the profile's max running requests, 64 to 512) must "
        "be right on at least 90 % of the requests and give the same answer line as alone on at least 90 %; the prompt "
        "logprobs of a fixed text must be finite, and with --baseline within 0.05 nats of the recorded "
        "ones on average and 1.0 on any token. --record-baseline keeps this server's answers and logprobs "
        "as the reference (only when the smoke passed).",
        {
            ExitCode.OK: "every check passed (and the baseline, if asked for, was recorded)",
            ExitCode.FINDINGS: "a check failed: each is named with what failed and examples",
            ExitCode.ERROR: "bad input, no server at the URL, the API key refused, a baseline that is "
            "corrupt or from another model or tokenizer, another model on the profile's port "
            "(nothing was checked or compared)",
        },
        func=cmd_smoke,
    )
    p.add_argument(
        "name", nargs="?", metavar="PROFILE", help="the launch profile whose server to check (none with --url)"
    )
    p.add_argument("--url", help="check this server instead of a profile's (e.g. http://127.0.0.1:30000)")
    p.add_argument(
        "--record-baseline",
        nargs="?",
        const="",
        metavar="FILE",
        help=f"write this server's answers and prompt logprobs to FILE; without FILE: {RECORDED}",
    )
    p.add_argument(
        "--baseline",
        nargs="?",
        const="",
        metavar="FILE",
        help=f"compare with a recorded FILE; without FILE: {RECORDED}",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="requests in the burst, 64 to 512 (default: the profile's engine.max_running_requests within that; 64)",
    )
    profile_args(p)
    common_args(p, wide=True)


def default_baseline(name: str):
    """Where a baseline is recorded when --record-baseline names no file: the user's state
    dir, one file per profile (or host-port of --url)."""
    from sm120kit.serve.rundir import state_root

    return state_root() / "smoke" / f"{name}.json"


def _options(args):
    import re
    from pathlib import Path

    from sm120kit.endpoint import api_key
    from sm120kit.errors import UserError
    from sm120kit.quality.options import MAX_BURST, MIN_BURST, SmokeOptions, options_for
    from sm120kit.urls import url_option

    if (args.name is None) == (args.url is None):
        taken = [(o, v) for o, v in (("--baseline", args.baseline), ("--record-baseline", args.record_baseline)) if v]
        why = f" ({taken[0][0]} took {taken[0][1]!r} as its FILE: put PROFILE first)" if taken and not args.name else ""
        raise UserError(
            f"smoke takes one profile, or --url without one{why}",
            "sm120kit smoke glm5-nvfp4, or sm120kit smoke --url http://127.0.0.1:30000",
        )
    if args.concurrency is not None:
        check_range(
            "--concurrency",
            args.concurrency,
            MIN_BURST,
            MAX_BURST,
            f"requests in the burst, e.g. --concurrency {MIN_BURST}",
        )
    overrides = {"concurrency": args.concurrency} if args.concurrency is not None else {}
    if args.url is not None:  # an empty --url is a malformed one, not none
        url = url_option("--url", args.url)
        options = SmokeOptions(url=url, api_key=api_key(None), **overrides)
        stem = re.sub(r"[^A-Za-z0-9.-]+", "-", url.split("//")[-1]).strip("-")  # 127.0.0.1-30000
    else:
        from sm120kit.profiles.loader import load_profile

        profile = load_profile(args.name, args.profile_dir, args.sets)
        options = options_for(profile, **overrides)
        stem = profile.name
    paths = {}
    for option, value in (("baseline", args.baseline), ("record_baseline", args.record_baseline)):
        if value is not None:
            paths[option] = Path(value).expanduser() if value else default_baseline(stem)
    if "baseline" in paths and not paths["baseline"].exists() and args.baseline == "":
        from sm120kit import followup

        server = [args.name] if args.name else ["--url", options.url]
        raise UserError(
            f"no baseline recorded for {args.name or options.url} yet ({paths['baseline']})",
            f"record one from a server you trust: `{followup.command('smoke', *server, '--record-baseline')}`",
        )
    from dataclasses import replace

    return replace(options, **paths)


def cmd_smoke(args) -> int:
    from sm120kit import report
    from sm120kit.quality import command, render

    options = _options(args)
    width = report.output_width(args.wide)
    out = sys.stderr if args.json else sys.stdout  # the JSON document alone on stdout
    result = command.smoke(options, render.TextProgress(width, out))
    if args.json:
        report.emit_json(result.as_json())
    else:
        print(render.smoke_text(result, width))
    return result.exit_code
