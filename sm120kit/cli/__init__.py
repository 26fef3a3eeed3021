"""The command line. One module per group of commands, each with `register(sub)`, which
declares its commands with their options, help and exit codes (cli.args.command_parser),
and one function per command, which takes the parsed options, calls the library, prints
the result (sm120kit.report) or its --json document and returns an ExitCode. Heavy imports
happen inside those functions so that `sm120kit --help` stays fast. `main` turns a user
mistake into a message and exit 2 (a traceback only with --debug), Ctrl-C into 130 and a
reader that went away (`| head`) into 141.
"""

from __future__ import annotations

import argparse
import sys

from sm120kit import __version__
from sm120kit.cli import bench, deploy, doctor, patching, profiles, runs, serve, smoke, tryout, tune
from sm120kit.cli.args import Parser
from sm120kit.exit_codes import ExitCode

EPILOG = """\
after every `pip install -U sglang`:   sm120kit patch --verify
read-only, for CI and Dockerfiles:     sm120kit patch --check
the exact server command:              sm120kit serve glm5-nvfp4 --dry-run
exit codes: 0 ok; 1 something to act on (a patch would change, a check failed, a known
  failure found, the server gave up); 2 an error or bad input; 3 the server left something
  behind; 130 interrupted (Ctrl-C); 141 the reader of the output went away (`| head`).
  `sm120kit COMMAND --help` says what each means there."""


def build_parser() -> Parser:
    parser = Parser(
        prog="sm120kit",
        description="Patch and launch sglang on SM120 nodes (RTX PRO 6000 Blackwell, RTX 5090).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sm120kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in (tryout, patching, profiles, serve, deploy, smoke, bench, tune, doctor, runs):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # the command's own parser says so, with its usage (parse_args would give the top one's)
        parser.chosen(args).error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.ERROR
    from sm120kit import report
    from sm120kit.errors import UserError, internal_error

    wide = getattr(args, "wide", False)

    try:
        return args.func(args)
    except UserError as exc:
        if args.json:
            import json

            print(json.dumps({"error": exc.message, "hint": exc.hint, "exit_code": int(ExitCode.ERROR)}))
        print(report.error_text(f"sm120kit: error: {exc}", wide), file=sys.stderr)
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
        print(report.error_text(internal_error(exc), wide), file=sys.stderr)
        return ExitCode.ERROR
