"""A user mistake: printed as a message with the next step, never as a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sm120kit.followup import complete


class UserError(Exception):
    """Bad input or a state the user must resolve. The CLI prints it and exits 2."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        message = complete(self.message)  # a command it names is spelled for the running invocation
        return message if not self.hint else f"{message}\n  next: {complete(self.hint)}"


def problems(exc: Exception, limit: int = 3) -> str:
    """A validation error on one line: where and what, for the first few (pydantic's
    ValidationError, read by duck typing so this module imports nothing heavy); any other
    exception as its message."""
    read_errors = getattr(exc, "errors", None)
    errors = read_errors() if callable(read_errors) else None
    if not errors:
        return str(exc)
    found = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the document'}: {e['msg']}" for e in errors[:limit])
    return found + (f"; and {len(errors) - limit} more" if len(errors) > limit else "")


def internal_error(exc: Exception) -> str:
    """What a bug says instead of its traceback (that one is for --debug)."""
    return (
        f"sm120kit: internal error: {type(exc).__name__}: {exc}\n  rerun with --debug for the traceback and report it"
    )


# What the running command changed for good (a transaction that committed): an error after
# that is reported with it and exits 4 (ExitCode.AFTER_CHANGE), never as "nothing was written".
_changes: list[str] = []


def record_change(what: str) -> None:
    """A change is durable now (the commit point of a transaction): `what` says which."""
    _changes.append(what)


@contextlib.contextmanager
def changes_of_one_command() -> Iterator[list[str]]:
    """The changes recorded while one command runs (a command run inside another, as `try`
    runs its steps, keeps its own)."""
    global _changes
    outer, _changes = _changes, []
    try:
        yield _changes
    finally:
        _changes = outer
