"""The schema of a run's record, as sm120kit.patching.ledger_schema is the ledger's:
state.json (what `ps`, the metrics and the preflight read) and the lines of events.jsonl.
Readers get a RunStatus and an EventKind, never a bare string to compare; a damaged
state.json is one error (DamagedRecord: the file, and what is wrong with it), never a run
half-read.

pydantic is imported only for a state.json that is not plainly a record as the supervisor
writes it (_plainly_valid): there the model says what is wrong. `sm120kit ps` over sound
records starts without it (its import and the model cost a tenth of a second, most of what
`ps` took); an event line is read with json alone."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
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
    if not _plainly_valid(doc):
        _run_state().model_validate(doc)
    return {**doc, "status": run_status(doc["status"])}


def _is_int(value: object, low: int, high: float = math.inf) -> bool:
    return type(value) is int and low <= value <= high  # strict: no bool, no float


def _is_seconds(value: object, high: float = math.inf) -> bool:
    """A float in strict mode takes an int too, never a bool; finite, in the range."""
    return isinstance(value, int | float) and type(value) is not bool and math.isfinite(value) and 0 <= value <= high


def _is_moment(value: object) -> bool:
    return _is_seconds(value, MAX_TIME)


def _absent_or(doc: dict, key: str, check: Callable[[object], bool]) -> bool:
    return doc.get(key) is None or check(doc[key])


def _plainly_valid(doc: dict) -> bool:
    """Whether every field _run_state's model declares is plainly of its type and in its
    range (or absent where it has a default). Never more lenient than the model
    (tests/test_truth_cheap_reads.py); where it says no, the model decides and says why."""
    health = doc.get("last_health")
    return (
        type(doc.get("profile")) is str
        and type(doc.get("status")) is str
        and _is_int(doc.get("supervisor_pid"), 1, MAX_PID)
        and _absent_or(doc, "supervisor_started", _is_moment)
        and _absent_or(doc, "since", _is_moment)
        and _absent_or(doc, "server_pid", lambda v: _is_int(v, 1, MAX_PID))
        and _is_int(doc.get("restarts", 0), 0)
        and type(doc.get("host", "?")) is str
        and _absent_or(doc, "port", lambda v: _is_int(v, 1, 65535))
        and _absent_or(doc, "marker", lambda v: type(v) is str)
        and (
            health is None
            or (
                type(health) is dict
                and _absent_or(health, "at", _is_moment)
                and _absent_or(health, "ok", lambda v: type(v) is bool)
                and type(health.get("detail", "")) is str
                and _absent_or(health, "seconds", _is_seconds)
            )
        )
    )


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
