"""A user mistake: printed as a message with the next step, never as a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or a state the user must resolve. The CLI prints it and exits 2."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  next: {self.hint}"
