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
from sm120kit.cli import bench, doctor, patching, profiles, runs, serve, tryout
from sm120kit.exit_codes import ExitCode

EPILOG = """\
after every `pip install -U sglang`:   sm120kit patch --verify
read-only, for CI and Dockerfiles:     sm120kit patch --check
the exact server command:              sm120kit serve glm5-nvfp4 --dry-run
exit codes: 0 ok; 1 something to act on (a patch would change, a check failed, a known
  failure found, the server gave up); 2 an error or bad input; 3 the server left something
  behind; 130 interrupted. `sm120kit COMMAND --help` says what each means there."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm120kit",
        description="Patch and launch sglang on SM120 nodes (RTX PRO 6000 Blackwell, RTX 5090).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sm120kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in (tryout, patching, profiles, serve, bench, doctor, runs):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.ERROR
    from sm120kit.errors import UserError, internal_error

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
        print(internal_error(exc), file=sys.stderr)
        return ExitCode.ERROR
