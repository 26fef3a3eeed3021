"""What the command modules share: the options several commands take, spelled the same
everywhere (--python/--site, --patch-dir, --only, --allow-missing, --json/--wide/--debug,
--profile-dir/--set); command_parser and the help formatter it declares each command with;
the loading of the target and patches those options name; and the range check of numeric
options."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from sm120kit.exit_codes import ExitCode


class Parser(argparse.ArgumentParser):
    """A parser whose errors read as every other error does: the usage of the command that
    was given (its subcommands are Parsers too: add_subparsers makes them of this class),
    the error, and the next step; exit 2."""

    def error(self, message: str):
        from sm120kit import report

        self.print_usage(sys.stderr)
        print(report.error_text(f"{self.prog}: error: {message}\n  next: {self.prog} --help"), file=sys.stderr)
        sys.exit(ExitCode.ERROR)

    def parse_known_args(self, args=None, namespace=None):
        """A command with OptionalVerbs (`bench compare`): a first word that names a verb is
        that verb's, parsed by its parser as argparse parses a subcommand; any other first
        word is the command's own (`bench PROFILE`)."""
        args = list(sys.argv[1:] if args is None else args)
        verbs = next((a for a in self._actions if isinstance(a, OptionalVerbs)), None)
        if verbs is None or not args or args[0] not in verbs.choices:
            return super().parse_known_args(args, namespace)
        namespace = argparse.Namespace() if namespace is None else namespace
        setattr(namespace, verbs.dest, args[0])
        parsed, extras = verbs.choices[args[0]].parse_known_args(args[1:], None)
        for key, value in vars(parsed).items():
            setattr(namespace, key, value)
        return namespace, extras

    def chosen(self, args: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)command the parsed args name, `profile show` included: the parser whose
        usage an error in them belongs to."""
        parser: argparse.ArgumentParser = self
        while True:
            verbs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if verbs is None or verbs.dest == argparse.SUPPRESS:
                return parser
            name = getattr(args, verbs.dest, None)
            if not isinstance(name, str) or name not in verbs.choices:
                return parser
            parser = verbs.choices[name]


class OptionalVerbs(argparse._SubParsersAction):
    """The verbs of a command that also runs without one: `bench PROFILE` and `bench compare
    A B`. argparse's subcommands take the first word for a verb and refuse any other, a
    profile's name included; these take no word in the command's own parse (nargs SUPPRESS),
    and Parser.parse_known_args hands a first word that names one to its parser. They are
    subcommands still: their own --help, options and exit codes, listed in the command's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nargs = argparse.SUPPRESS


class HelpFormatter(argparse.HelpFormatter):
    """Help whose description and epilog keep their lines (a paragraph is one line, a list
    one item a line) and wrap each to the terminal, continuing under its text: under the
    meaning of an exit code, not under the code."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import re
        import textwrap

        lines = []
        for line in text.splitlines():
            match = re.match(r"\s*(\d+\s+)?", line)  # matches every line: all of it is optional
            lead = match.group(0) if match else ""  # "  130  ": an exit code's meaning starts after it
            lines += textwrap.wrap(
                line,
                width,
                initial_indent=indent,
                subsequent_indent=indent + " " * len(lead),
                break_on_hyphens=False,
            ) or [""]
        return "\n".join(lines)


def command_parser(sub, name: str, summary: str, description: str, exits: Mapping[ExitCode, str], *, func=None):
    """A subcommand with its one-line summary (the list in `sm120kit --help`), a description
    and what it exits with (`sm120kit NAME --help`); `func` is the command function it runs
    (none for a group of verbs, such as `profile`)."""
    epilog = "exit codes:\n" + "\n".join(f"  {int(code):3d}  {meaning}" for code, meaning in exits.items())
    parser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    if func is not None:
        parser.set_defaults(func=func)
    return parser


def target_args(parser: argparse.ArgumentParser, python_is: str) -> None:
    """--python / --site; python_is says what the interpreter is for in this command."""
    group = parser.add_argument_group("target environment (default: this interpreter)")
    group.add_argument(
        "--python", metavar="EXE", help=f"the python of {python_is} (sm120kit need not be installed there)"
    )
    group.add_argument("--site", metavar="DIR", help="a site-packages directory, e.g. an unpacked image layer")


def patch_dir_arg(parser: argparse.ArgumentParser, used_for: str = "") -> None:
    """--patch-dir; used_for says what the command loads patches for, where that is not plain."""
    parser.add_argument(
        "--patch-dir",
        action="append",
        metavar="DIR",
        help="also load patches from DIR (before the shipped ones; repeatable; or $SM120KIT_PATCH_PATH)"
        + (f": {used_for}" if used_for else ""),
    )


def patch_args(parser: argparse.ArgumentParser) -> None:
    patch_dir_arg(parser)
    parser.add_argument(
        "--only",
        action="append",
        metavar="ID",
        help="just this patch (repeatable; an unknown id is refused with the nearest known one)",
    )


def allow_missing_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-missing",
        action="append",
        metavar="ID",
        default=[],
        help="go on although patch ID's anchor is missing on the installed release (repeatable); "
        "`patch` records it in the ledger for that release",
    )


def allow_known_failure_arg(parser: argparse.ArgumentParser) -> None:
    """--allow-known-failure and --capability: how a launch is judged before a load."""
    parser.add_argument(
        "--allow-known-failure",
        action="append",
        metavar="ID",
        default=[],
        help="judge the launch allowed although it runs into known SM120 failure ID of the installed release, "
        "or dispatches kernel ID with no SM12x build (`sm120kit known-failures` lists them; repeatable)",
    )
    parser.add_argument(
        "--capability",
        choices=("12.0", "12.1"),
        help="the compute capability to judge the launch for (default: the profile's node.compute_capability, "
        "else the GPUs NVML sees)",
    )


def common_args(parser: argparse.ArgumentParser, wide: bool = False, prints: str | None = "a table") -> None:
    """--json and --debug; with `wide`, also --wide, for a command that prints a table.
    `prints`: what the command prints without --json, which the JSON document replaces (None:
    a JSON document either way)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print a JSON document instead of {prints}" if prints else "accepted: the output is JSON either way",
    )
    if wide:
        parser.add_argument(
            "--wide",
            action="store_true",
            help="every row and message on one line, nothing wrapped (default: fit the terminal, or 100 "
            "columns when the output is not one)",
        )
    parser.add_argument("--debug", action="store_true", help="print tracebacks and full details")


def profile_args(parser: argparse.ArgumentParser, sets: bool = True) -> None:
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


def load_target_and_patches(args, selected: bool = True):
    from sm120kit.patching.registry import load_patches, select
    from sm120kit.target import resolve_target

    patches = load_patches(args.patch_dir)
    chosen = select(patches, args.only, "--only")
    select(patches, getattr(args, "allow_missing", None), "--allow-missing")  # known ids only
    return resolve_target(args.python, args.site), chosen if selected else patches


def allowed_missing(args) -> frozenset[str]:
    return frozenset(args.allow_missing)


def check_range(option: str, value: float, low: float, high: float, hint: str, low_open: bool = False) -> None:
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
