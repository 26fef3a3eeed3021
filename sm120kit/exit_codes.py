"""The exit codes of every command: one table, docs/exit-codes.md.

A code says how the command ended, not which command ran; what counts as "findings" for
each command is listed in docs/exit-codes.md and in each command's `--help`.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # done; nothing to act on
    FINDINGS = 1  # done, with something to act on: a patch would change, a check failed, the server gave up
    ERROR = 2  # refused or failed: bad input, an anchor missing, a foreign edit, a failed preflight
    UNCLEAN = 3  # serve stopped, but a process, port or GPU context of the server was left
    AFTER_CHANGE = 4  # the change was made (patch, unpatch, tune-moe committed it), then a later step failed
    INTERRUPTED = 130  # Ctrl-C (what a shell reports for SIGINT)
    BROKEN_PIPE = 141  # the reader of our output went away (what a shell reports for SIGPIPE)
