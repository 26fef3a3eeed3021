"""`ps`: the runs `serve` recorded on this machine."""

from __future__ import annotations

import sys

from sm120kit.cli.args import command_parser, common_args
from sm120kit.exit_codes import ExitCode


def register(sub) -> None:
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


def cmd_ps(args) -> int:
    from sm120kit import report
    from sm120kit.serve.render import ps_table
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
    print(ps_table(found, width))
    for error in damaged:
        print(
            f"sm120kit: error: damaged run record {error}; `sm120kit serve` of that profile writes a new one",
            file=sys.stderr,
        )
    return code
