"""`ps` and `diagnose`: the runs `serve` recorded, and a server log's known failures."""

from __future__ import annotations

import sys

from sm120kit.cli.args import check_range, command_parser, common_args
from sm120kit.exit_codes import ExitCode


def register(sub) -> None:
    """ps, diagnose."""
    p = command_parser(
        sub,
        "ps",
        "what `sm120kit serve` runs here: status, since when, restarts, last health",
        "One line per profile that `sm120kit serve` ran on this machine, from the records under "
        "$SM120KIT_STATE_DIR/serve (default: the platform's user state dir): its status, the "
        "supervisor's and the server's pids, since when, restarts, the last health probe, the port.",
        {
            ExitCode.OK: "listed (or nothing served here yet)",
            ExitCode.ERROR: "a run record cannot be read (it is listed as damaged)",
        },
        func=cmd_ps,
    )
    common_args(p, wide=True)

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
    common_args(p, wide=True)


def cmd_ps(args) -> int:
    from sm120kit import report
    from sm120kit.serve.rundir import runs, serve_root
    from sm120kit.serve.status import RunStatus

    found = runs()
    damaged = [r["error"] for r in found if r["status"] == RunStatus.DAMAGED]
    code = ExitCode.ERROR if damaged else ExitCode.OK  # a record that cannot be read is not "nothing served"
    if args.json:
        report.emit_json({"runs": found, "exit_code": code})
        return code
    width = report.output_width(args.wide)
    if not found:
        print(report.wrap(f"nothing served here yet (no run under {serve_root()})", width))
        return code
    print(report.ps_table(found, width))
    for error in damaged:
        print(
            f"sm120kit: error: damaged run record {error}; `sm120kit serve` of that profile writes a new one",
            file=sys.stderr,
        )
    return code


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
    found = diagnose(text, args.tail)
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
