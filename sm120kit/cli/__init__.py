"""The command line: one module per group of commands, each with `register(sub)` (its
options) and its command functions (parse, call the library, render). Heavy imports happen
inside the command functions so that `sm120kit --help` stays fast. Exit codes:
sm120kit.exit_codes.ExitCode.
"""

from __future__ import annotations

import argparse
import sys

from sm120kit import __version__
from sm120kit.cli import bench, doctor, patching, profiles, runs, serve
from sm120kit.exit_codes import ExitCode

EPILOG = """\
after every `pip install -U sglang`:   sm120kit patch --verify
read-only, for CI and Dockerfiles:     sm120kit patch --check
the exact server command:              sm120kit serve glm5-nvfp4 --dry-run
exit codes: 0 ok, 1 something would change (check mode, status), 2 error"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm120kit",
        description="Patch and launch sglang on SM120 nodes (RTX PRO 6000 Blackwell, RTX 5090).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sm120kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in (patching, profiles, serve, bench, doctor, runs):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.ERROR
    from sm120kit.errors import UserError

    try:
        return args.func(args)
    except UserError as exc:
        if args.json:
            import json

            print(json.dumps({"error": exc.message, "hint": exc.hint, "exit_code": int(ExitCode.ERROR)}))
        print(f"sm120kit: error: {exc}", file=sys.stderr)
        return ExitCode.ERROR
    except KeyboardInterrupt:
        print("sm120kit: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): not our error, nothing to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE
    except Exception as exc:  # a bug: say so plainly; the traceback is for --debug
        if args.debug:
            raise
        print(
            f"sm120kit: internal error: {type(exc).__name__}: {exc}\n"
            "  rerun with --debug for the traceback and report it",
            file=sys.stderr,
        )
        return ExitCode.ERROR
