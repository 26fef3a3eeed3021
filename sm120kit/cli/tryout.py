"""`try`: the whole patch cycle on real sglang releases in a scratch directory."""

from __future__ import annotations

import sys

from sm120kit.cli.args import command_parser, common_args
from sm120kit.exit_codes import ExitCode

DESCRIPTION = (
    "Show the whole cycle on real sglang releases, on any machine: no GPU and no installed sglang needed. "
    "In a scratch directory, sm120kit installs the proven release before the one tried (default: the newest "
    "proven) with the flashinfer-python it pins, unpacked from the real wheels, and runs the real commands on it "
    "with --site: status, patch --diff, patch --verify. Then it upgrades to the release tried as pip does, which "
    "wipes the patched files: status names them, patch --verify restores them, unpatch gives back the vendor's "
    "bytes (checked against the wheel and its RECORD), and the glm5-nvfp4 profile renders its sglang command. "
    "It ends with a summary of what was proven; the scratch directory is removed unless --keep.\n"
    "\n"
    "The first run downloads four wheels (about 200 MB: two sglang releases and the flashinfer-python each pins) "
    "with pip from the package index into $SM120KIT_WHEEL_CACHE, else the user cache dir "
    "(~/.cache/sm120kit/wheels on Linux); later runs need no network.\n"
    "\n"
    "On the GPU node, and after every `pip install -U sglang` there: sm120kit patch --verify"
)


def register(sub) -> None:
    """try. sm120kit.tryout and the wheels are imported by cmd_try alone: --help stays fast."""
    p = command_parser(
        sub,
        "try",
        "the whole patch cycle on real sglang releases in a scratch dir (no GPU needed)",
        DESCRIPTION,
        {
            ExitCode.OK: "every step did what the cycle expects",
            ExitCode.FINDINGS: "a step did not (the summary says which; the rest is not run)",
            ExitCode.ERROR: "bad input, or a wheel could not be fetched (offline and not cached)",
        },
        func=cmd_try,
    )
    p.add_argument(
        "--release",
        metavar="X",
        help="the sglang release to upgrade to, from the proven one before it (default: the newest proven; "
        "one outside the proven window is refused with the window named)",
    )
    p.add_argument("--dir", metavar="DIR", help="make the scratch directory in DIR (default: the system's temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory and print its path")
    common_args(p, prints="the transcript")


def cmd_try(args) -> int:
    from pathlib import Path

    from sm120kit import report, tryout

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    width = report.output_width()
    cycle = tryout.run(
        args.run_cli,
        args.release,
        Path(args.dir) if args.dir else None,
        keep=args.keep,
        echo=None if args.json else lambda line: print(line, flush=True),
        note=note,
        debug=args.debug,
        width=width,
    )
    if args.json:
        report.emit_json(cycle.as_json())
    else:
        print()
        print(report.wrap(cycle.summary(), width))
    return cycle.exit_code
