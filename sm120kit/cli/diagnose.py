"""`diagnose`: a server log's known SM120 failures."""

from __future__ import annotations

import sys

from sm120kit.cli.args import check_range, command_parser, common_args, patch_dir_arg
from sm120kit.exit_codes import ExitCode


def register(sub) -> None:
    p = command_parser(
        sub,
        "diagnose",
        "match a server log against known SM120 failure signatures",
        "Match the end of an sglang server log against the known SM120 failure signatures "
        "(sm120kit/serve/signatures.toml) and print each match with its fix; `sm120kit serve` "
        "does the same on every death. Only the end of the file is read (at most 16 MiB).",
        {
            ExitCode.OK: "no known failure signature in those lines",
            ExitCode.FINDINGS: "one or more known failures found (each printed with its advice)",
            ExitCode.ERROR: "the log cannot be read, or bad input",
        },
        func=cmd_diagnose,
    )
    p.add_argument("log", help="the sglang server log to read ('-' for standard input)")
    p.add_argument("--tail", type=int, default=400, metavar="N", help="look at the last N lines (default 400)")
    patch_dir_arg(p, "the known failures of their known-failures.toml, matched before the shipped survey's")
    common_args(p, wide=True, prints="the text")


def cmd_diagnose(args) -> int:
    from sm120kit import report
    from sm120kit.errors import UserError
    from sm120kit.serve.diagnose import MAX_TAIL_LINES, diagnose, read_tail

    check_range("--tail", args.tail, 1, MAX_TAIL_LINES, "the number of last lines to look at, e.g. --tail 400")
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
    found = diagnose(text, args.tail, tuple(args.patch_dir or ()))
    code = ExitCode.FINDINGS if found else ExitCode.OK
    if args.json:
        report.emit_json({"log": args.log, "diagnoses": [d.as_json() for d in found], "exit_code": code})
        return code
    width = report.output_width(args.wide)
    if not found:
        source = "standard input" if args.log == "-" else args.log
        print(report.wrap(f"no known SM120 failure signature in the last {args.tail} lines of {source}", width))
    for d in found:
        print(report.wrap(f"{d.id}: {d.title}", width))
        print(report.wrap(f"  log:    {d.line}", width, hanging="        "))
        print(report.wrap(f"  advice: {d.advice}", width, hanging="        "))
    return code
