"""The schema of a run's record, as sm120kit.patching.ledger_schema is the ledger's:
state.json (what `ps`, the metrics and the preflight read) and the lines of events.jsonl.
Readers get a RunStatus and an EventKind, never a bare string to compare; a damaged
state.json is one error (DamagedRecord: the file, and what is wrong with it), never a run
half-read.

pydantic is imported only when a state.json is read (`sm120kit ps` over no run starts
without it); an event line is read with json alone."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit import shallow_json
from sm120kit.errors import problems
from sm120kit.serve.status import EventKind, RunStatus

if TYPE_CHECKING:
    from pydantic import BaseModel

# A pid as Linux gives them (pid_max is at most 2**22), and a time as the supervisor writes
# one (time.time(): seconds since 1970, before the year 5000): a record with anything else is
# damaged, not a run that `ps` would show with a made-up age or ask psutil about.
MAX_PID = 2**22
MAX_TIME = 95_000_000_000.0

_STATUSES = {s.value: s for s in RunStatus}
_KINDS = {k.value: k for k in EventKind}


class DamagedRecord(ValueError):
    """A state.json that is not one as the supervisor writes it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


@functools.cache
def _run_state() -> type[BaseModel]:
    """The fields of state.json that `ps`, the metrics and the preflight read, with their
    types and ranges; the others are kept as they are."""
    from typing import Annotated, TypeAlias

    from pydantic import BaseModel, ConfigDict, Field

    pid: TypeAlias = Annotated[int, Field(ge=1, le=MAX_PID)]
    moment: TypeAlias = Annotated[float, Field(ge=0, le=MAX_TIME, allow_inf_nan=False)]

    class Health(BaseModel):  # what sm120kit.serve.machine's _health writes
        model_config = ConfigDict(strict=True, extra="allow")

        at: moment | None = None
        ok: bool | None = None
        detail: str = ""
        seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None

    class RunState(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")

        profile: str
        status: str  # a RunStatus; a word a newer sm120kit writes is shown as it is
        supervisor_pid: pid
        supervisor_started: moment | None = None
        since: moment | None = None
        server_pid: pid | None = None
        restarts: Annotated[int, Field(ge=0)] = 0
        host: str = "?"
        port: Annotated[int, Field(ge=1, le=65535)] | None = None
        marker: str | None = None
        last_health: Health | None = None

    return RunState


def run_state(doc: object) -> dict:
    """A parsed state.json, validated: its fields as written, "status" a RunStatus (a word
    this sm120kit does not know stays the word). ValueError (pydantic's ValidationError is
    one) where it is not a record the supervisor writes."""
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    _run_state().model_validate(doc)
    return {**doc, "status": run_status(doc["status"])}


def read_run_state(path: Path) -> dict:
    """path (a state.json) as run_state() reads it. OSError where it cannot be read (none
    there, or its permissions: the file may be sound); DamagedRecord where its bytes are not
    a record the supervisor writes."""
    data = path.read_bytes()
    try:
        return run_state(shallow_json.loads(data))
    except ValueError as exc:  # not UTF-8, not JSON, not the schema
        raise DamagedRecord(path, problems(exc)) from exc


def run_status(word: object) -> RunStatus | object:
    """A status as written -> its RunStatus; anything else as it is."""
    return _STATUSES.get(word, word) if isinstance(word, str) else word


def event_line(line: str) -> dict | None:
    """One line of events.jsonl: its fields, "event" an EventKind; None for a line that is
    not an event this sm120kit knows (a line torn by a full disk, another version's kind)."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(kind := doc.get("event"), str) or kind not in _KINDS:
        return None
    return {**doc, "event": _KINDS[kind]}
