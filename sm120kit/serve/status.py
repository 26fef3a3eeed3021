"""The words of a run's record: the statuses of state.json and the kinds of events.jsonl.
Each value is the string written to the file, so the JSON reads as it always has."""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    """state.json's "status": where the run is."""

    LAUNCHING = "launching"  # the supervisor is up; the server is not started yet
    STARTING = "starting"  # started, not generating yet
    READY = "ready"  # it generates; probes pass
    UNHEALTHY = "unhealthy"  # ready once, now failing probes
    BACKOFF = "backoff"  # between a failed run and its restart
    STOPPING = "stopping"  # a stop signal came: stopping the process tree
    STOPPED = "stopped"
    GAVE_UP = "gave-up"  # the crash-loop limit
    # Said by `sm120kit ps`, never written by a supervisor:
    SUPERVISOR_GONE = "supervisor gone"  # killed without a chance to stop the server
    DAMAGED = "damaged"  # state.json is not a record as a supervisor writes it
    UNREADABLE = "unreadable"  # state.json cannot be read: its permissions, an I/O error

    def __str__(self) -> str:  # a table cell or an f-string shows the word, not the member's name
        return self.value


# Where a run ends: a supervisor that is gone left one of these behind on purpose.
TERMINAL = frozenset({RunStatus.STOPPED, RunStatus.GAVE_UP})


class EventKind(str, Enum):
    """events.jsonl's "event"."""

    PREFLIGHT = "preflight"
    STARTED = "started"
    PROGRESS = "progress"
    READY = "ready"
    SMOKE = "smoke"  # health.smoke's verdict on a start, before it is called ready
    PROBE_FAILED = "probe_failed"
    DIED = "died"
    HUNG = "hung"
    START_TIMEOUT = "start_timeout"
    RESTARTING = "restarting"
    GAVE_UP = "gave_up"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SUPERVISOR_ERROR = "supervisor_error"
    # A fleet's own record:
    MEMBER_STARTED = "member_started"  # a member's supervisor (a replica or the router)
    MEMBER_EXITED = "member_exited"  # ... and its end, with its exit code
    ROUTED = "routed"  # a replica added to the router
    UNROUTED = "unrouted"  # ... and taken out of it

    def __str__(self) -> str:
        return self.value
