"""What serve's record (its events.jsonl) says about a variant's server: why a start
failed or the preflight refused it, whether it died during the sweep, and what its stop
proved. The search reads the events its variant added, from the offset it noted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.bench.search_state import REFUSED_WHY
from sm120kit.exit_codes import ExitCode
from sm120kit.serve.record_schema import event_line
from sm120kit.serve.status import EventKind

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile


def events_path(profile: Profile) -> Path:
    from sm120kit.serve.rundir import serve_root

    return serve_root() / profile.name / "events.jsonl"


def events_since(path: Path, offset: int) -> list[dict]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [doc for line in data.splitlines() if (doc := event_line(line)) is not None]


def _ends(events: list[dict]) -> tuple[list[str], list[str]]:
    """(what ended each failed start, the diagnoses' titles) from died/hung/start_timeout events."""
    what, diagnoses = [], []
    for e in events:
        if e["event"] in (EventKind.DIED, EventKind.HUNG, EventKind.START_TIMEOUT):
            phase = f" ({e['phase']})" if e.get("phase") and not e.get("ready") else ""
            what.append(f"{e['event'].replace('_', ' ')}{phase}: {e.get('detail', '')}")
            for d in e.get("diagnoses") or []:
                line = f"{d.get('title', d.get('id'))}: {d.get('advice', '')}".rstrip(": ")
                if line not in diagnoses:
                    diagnoses.append(line)
            if not e.get("diagnoses") and e.get("log_tail"):
                diagnoses.append("no known failure signature; the log ends: " + " | ".join(e["log_tail"][-3:]))
    return what, diagnoses


def crash_from_events(events: list[dict], message: str) -> tuple[str, list[str]]:
    refused = [e for e in events if e["event"] is EventKind.PREFLIGHT and not e.get("ok", True)]
    if refused:
        failed = [
            f"{c.get('check', '?')}: {c.get('detail', '')}"
            for c in refused[-1].get("checks", [])
            if c.get("status") == "fail"
        ]
        return REFUSED_WHY + (f": {'; '.join(failed)}" if failed else ""), failed
    what, diagnoses = _ends(events)
    if not what:
        return message, []
    gave_up = any(e["event"] is EventKind.GAVE_UP for e in events)
    return f"{'gave up after ' if gave_up else ''}{len(what)} failed start(s); last: {what[-1]}", diagnoses


def died_from_events(events: list[dict]) -> tuple[str, list[str]] | None:
    after_ready = False
    ends = []
    for e in events:
        if e["event"] is EventKind.READY:
            after_ready = True
        elif after_ready and e["event"] in (EventKind.DIED, EventKind.HUNG):
            ends.append(e)
    if not ends:
        return None
    what, diagnoses = _ends(ends)
    return f"the server failed during the sweep: {what[-1]}", diagnoses


def stopped_early_why(events: list[dict], exit_code: int) -> str:
    """A server whose `sm120kit serve` ended before the search stopped it: who stopped it."""
    stopping = [e for e in events if e["event"] is EventKind.STOPPING]
    by = f"{stopping[-1]['signal']} to its sm120kit serve" if stopping and stopping[-1].get("signal") else ""
    return (
        f"the server stopped during the sweep ({by or 'not by the search'}; sm120kit serve exit code "
        f"{exit_code}): its levels ran against no server"
    )


def stop_from_events(events: list[dict], exit_code: int | None) -> dict:
    stopped = [e for e in events if e["event"] is EventKind.STOPPED]
    doc: dict = {"exit_code": exit_code}
    if stopped:
        e = stopped[-1]
        doc.update(
            clean=e.get("clean"),
            ports_taken=e.get("ports_taken") or [],
            on_gpu=e.get("on_gpu"),
            gpu_released_after_s=e.get("gpu_released_after_s"),
            left=e.get("left") or [],
        )
    if exit_code == int(ExitCode.UNCLEAN):
        bits = [*(doc.get("ports_taken") or []), *(doc.get("on_gpu") or [])]
        bits += [str(p) for p in doc.get("left") or []]
        doc["said"] = "its stop left: " + ("; ".join(bits) or "something (see the serve record)")
    return doc
