"""`ps`: the runs `serve` recorded on this machine."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

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
            ExitCode.ERROR: "a run record cannot be read (listed as unreadable: its permissions, an I/O error) "
            "or is not one a supervisor writes (listed as damaged)",
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
    damaged = [r for r in found if r["status"] == RunStatus.DAMAGED]
    unreadable = [r for r in found if r["status"] == RunStatus.UNREADABLE]
    # a record that cannot be read is not "nothing served"
    code = ExitCode.ERROR if damaged or unreadable else ExitCode.OK
    if args.json:
        report.emit_json({"runs": found, "exit_code": code})
        return code
    width = report.output_width(args.wide)
    if not found:
        print(report.wrap(f"nothing served here yet (no run under {serve_root()})", width))
        return code
    print(ps_table(found, width))
    for run in damaged:
        said = f"sm120kit: error: damaged run record {run['error']}; `sm120kit serve` of that profile writes a new one"
        print(report.error_text(said, args.wide), file=sys.stderr)
    for run in unreadable:  # not damaged: the file may be sound, and serving again would not help
        record = shlex.quote(str(Path(run["dir"]) / "state.json"))
        said = (
            f"sm120kit: error: cannot read the run record {run['error']}\n"
            f"  next: ls -l {record}  # its owner: run `sm120kit ps` as that user"
        )
        print(report.error_text(said, args.wide), file=sys.stderr)
    return code
