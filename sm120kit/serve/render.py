"""`sm120kit ps` as text: one row per run that `serve` recorded, fitted to a width."""

from __future__ import annotations

import time

from sm120kit.report import table
from sm120kit.serve.clock import age
from sm120kit.serve.status import TERMINAL, RunStatus


def _ago(then: float | None) -> str:
    """How long ago, at a glance ("45s ago", "12m ago"); from 2 hours on, the date and time."""
    if not then:
        return "-"
    seconds = time.time() - then
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(then)) if seconds >= 7200 else f"{age(seconds)} ago"


def ps_row(run: dict) -> list[str]:
    """One line of `sm120kit ps` from a run's state.json."""
    health = run.get("last_health") or {}
    last = (
        f"{'ok' if health.get('ok') else 'FAILED'} {health.get('detail', '')} ({_ago(health.get('at'))})"
        if health
        else "-"
    )
    pid = run.get("supervisor_pid")
    if pid is None or (run.get("status") in TERMINAL and not run.get("running")):
        supervisor = "-"
    else:
        supervisor = str(pid) if run.get("running") else f"{pid} (gone)"
    restarts, host, port = run.get("restarts"), run.get("host"), run.get("port")
    status = str(run.get("status") or "-")
    if run.get("status") == RunStatus.STARTING and run.get("phase") == "smoke":  # health.smoke decides "ready"
        status = "starting (smoke)"
    return [  # "-" for what the record does not hold (a damaged one holds little): never an invented value
        str(run.get("profile") or "-"),
        status,
        supervisor,
        str(run.get("server_pid") or "-"),
        _ago(run.get("since")),
        "-" if restarts is None else str(restarts),
        last,
        "-" if port is None else f"{host or '-'}:{port}",
    ]


def ps_table(runs: list[dict], width: int | None = None) -> str:
    """`sm120kit ps`: one row per run. Fitted to a width, the pids and the last health probe
    go on a line of their own under the row; with --wide, one line per run."""
    headers = ["PROFILE", "STATUS", "SUPERVISOR", "SERVER", "SINCE", "RESTARTS", "LAST HEALTH", "PORT"]
    rows = [dict(zip(headers, ps_row(run))) for run in runs]
    if width is None:
        return table(headers, [list(row.values()) for row in rows])
    columns = ["PROFILE", "STATUS", "SINCE", "RESTARTS", "PORT"]
    return table(
        columns,
        [[row[c] for c in columns] for row in rows],
        width,
        narrow=(0, 1, 2),
        notes=[f"supervisor {r['SUPERVISOR']}, server {r['SERVER']}, last health {r['LAST HEALTH']}" for r in rows],
    )
