"""The command line. One module per command or group of commands, named after the command
(cli/patch.py also holds `status`, `unpatch`, `patches` and `known-failures`), each with
`register(sub)`, which declares its commands with their options, help and exit codes
(cli.args.command_parser), and one function per command, which takes the parsed options,
calls the library, prints the result (its package's render module, over sm120kit.report)
or its --json document and returns an ExitCode. Heavy imports happen inside those functions
so that `sm120kit --help` stays fast. `main` turns a user mistake into a message and exit 2
(a traceback only with --debug), Ctrl-C into 130 and a reader that went away (`| head`)
into 141.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from sm120kit import __version__
from sm120kit.cli import bench, diagnose, doctor, patch, profiles, ps, render, serve, smoke, tryout, tune
from sm120kit.cli.args import Parser
from sm120kit.exit_codes import ExitCode

EPILOG = """\
after every `pip install -U sglang`:   sm120kit patch --verify
read-only, for CI and Dockerfiles:     sm120kit patch --check
the exact server command:              sm120kit serve glm5-nvfp4 --dry-run
exit codes: 0 ok; 1 something to act on (a patch would change, a check failed, a known
  failure found, the server gave up); 2 an error or bad input; 3 the server left something
  behind; 4 the change was made, then a later step failed (the message says which); 130
  interrupted (Ctrl-C); 141 the reader of the output went away (`| head`).
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
    for group in (tryout, patch, profiles, serve, render, smoke, bench, tune, doctor, ps, diagnose):
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
    from sm120kit import followup, report
    from sm120kit.errors import UserError, changes_of_one_command, internal_error

    wide = getattr(args, "wide", False)
    invocation = followup.invocation_of(parser, args)  # what its `next:` commands repeat

    with changes_of_one_command() as changed, _checked_stdout(), followup.invoked(invocation):
        try:
            args.run_cli = main  # `try` runs the other commands in-process, through this same entry
            code = args.func(args)
            sys.stdout.flush()  # output that cannot be written fails here, not unseen at exit
            return code
        except UserError as exc:
            return _failed(args, exc.message, exc.hint, changed)
        except KeyboardInterrupt:
            print("sm120kit: interrupted" + _made(changed), file=sys.stderr)
            return ExitCode.INTERRUPTED
        except BrokenPipeError:  # the reader went away (`| head`): not our error, nothing to say
            _discard_stdout()
            return ExitCode.BROKEN_PIPE
        except OutputFailed as exc:
            _discard_stdout()
            hint = None if changed else "send the output where it can be written (a disk with room, a terminal)"
            return _failed(args, f"writing the output failed ({exc})", hint, changed)
        except Exception as exc:  # a bug: say so plainly; the traceback is for --debug
            if isinstance(exc, OSError) and (refused := _path_refusal(parser, args, exc)):
                return _failed(args, refused.message, refused.hint, changed)
            if args.debug:
                raise
            if changed:
                return _failed(args, internal_error(exc).removeprefix("sm120kit: "), None, changed)
            print(report.error_text(internal_error(exc), wide), file=sys.stderr)
            return ExitCode.ERROR


def _failed(args, message: str, hint: str | None, changed: list[str]) -> int:
    """A refusal or failure: exit 2, or 4 when the command had made its change before it
    failed (then the message says what was made); with --json, the error document too."""
    import json

    from sm120kit import followup, report
    from sm120kit.errors import UserError

    code = ExitCode.AFTER_CHANGE if changed else ExitCode.ERROR
    if changed:
        message = f"the change was made ({'; '.join(changed)}), then this failed: {message}"
        hint = hint or "run `sm120kit status` to see where things stand"
    message, hint = followup.complete(message), followup.complete(hint) if hint else hint  # for this target
    if args.json:
        with contextlib.suppress(OSError):  # stdout may be what failed
            doc = {"error": message, "hint": hint, "exit_code": int(code)}
            print(json.dumps({**doc, "changed": changed} if changed else doc), flush=True)
    with contextlib.suppress(OSError):
        error = UserError(message, hint)
        print(report.error_text(f"sm120kit: error: {error}", getattr(args, "wide", False)), file=sys.stderr)
    return code


def _path_refusal(parser: Parser, args, exc: OSError):
    """A path too long for the system (ENAMETOOLONG, from any option that takes one) as a
    refusal of that option; None for any other OSError."""
    from sm120kit import path_limits

    actions = parser.chosen(args)._actions
    given = [(a.option_strings[-1] if a.option_strings else "", getattr(args, a.dest, None)) for a in actions]
    return path_limits.refusal(exc, given)


def _made(changed: list[str]) -> str:
    return f" after the change was made ({'; '.join(changed)})" if changed else ""


class OutputFailed(OSError):
    """Writing to stdout failed (a full disk, /dev/full, an I/O error): not the command's fault."""


class _CheckedStdout:
    """sys.stdout, whose write failures are OutputFailed (a BrokenPipeError stays one)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._checked(self._stream.write, text)

    def flush(self) -> None:
        self._checked(self._stream.flush)

    @staticmethod
    def _checked(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.errno, exc.strerror or str(exc)) from exc

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _checked_stdout() -> Iterator[None]:
    """sys.stdout checked (see _CheckedStdout) while one command runs."""
    outer = sys.stdout
    if outer is not None and not isinstance(outer, _CheckedStdout):
        sys.stdout = _CheckedStdout(outer)
    try:
        yield
    finally:
        sys.stdout = outer


def _discard_stdout() -> None:
    """What is still buffered for a stdout that failed goes nowhere, so that the flush at
    exit neither fails again nor changes the exit code."""
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
