"""`ps` and `diagnose`: the runs `serve` recorded, and a server log's known failures."""

from __future__ import annotations

import sys

from sm120kit.cli.args import check_range, common_args


def register(sub) -> None:
    """ps, diagnose."""
    p = sub.add_parser("ps", help="what `sm120kit serve` runs here: status, since when, restarts, last health")
    common_args(p)
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("diagnose", help="match a server log against known SM120 failure signatures")
    p.add_argument("log", help="an sglang server log file ('-' for standard input)")
    p.add_argument("--tail", type=int, default=400, metavar="N", help="look at the last N lines (default 400)")
    common_args(p)
    p.set_defaults(func=cmd_diagnose)


def cmd_ps(args) -> int:
    from sm120kit import report
    from sm120kit.serve.rundir import runs, serve_root

    found = runs()
    damaged = [r["error"] for r in found if r["status"] == "damaged"]
    code = 2 if damaged else 0  # a record that cannot be read is not "nothing served"
    if args.json:
        report.emit_json({"runs": found, "exit_code": code})
        return code
    if not found:
        print(f"nothing served here yet (no run under {serve_root()})")
        return 0
    print(
        report.table(
            ["PROFILE", "STATUS", "SUPERVISOR", "SERVER", "SINCE", "RESTARTS", "LAST HEALTH", "PORT"],
            [report.ps_row(r) for r in found],
        )
    )
    for error in damaged:
        print(
            f"sm120kit: error: damaged run record {error}; `sm120kit serve` of that profile writes a new one",
            file=sys.stderr,
        )
    return code


def cmd_diagnose(args) -> int:
    """Exit 0: no known signature; 1: one or more found; 2: bad input."""
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
    if args.json:
        report.emit_json({"log": args.log, "diagnoses": [d.as_json() for d in found], "exit_code": int(bool(found))})
        return int(bool(found))
    if not found:
        print(f"no known SM120 failure signature in the last {args.tail} lines of {args.log}")
    for d in found:
        print(f"{d.id}: {d.title}\n  log:    {d.line}\n  advice: {d.advice}")
    return int(bool(found))
