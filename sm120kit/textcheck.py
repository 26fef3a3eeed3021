"""Control characters in text sm120kit passes on. In a value that it writes into another
file's syntax (a systemd unit, a compose file, a manifest, a URL) a newline starts a line of
its own (a directive of its own, in a unit), a carriage return does the same for systemd,
and the rest make a value that no reader takes as it was meant: one test, said in words
(control_char). In text quoted from a server's log onto a terminal (a diagnosis, the last
lines of a dead server) an escape sequence recolours the terminal or sets its title: one
sanitiser (printable)."""

from __future__ import annotations

import re

NAMED = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}


def control_char(text: str) -> str | None:
    """The first control character in text (C0, DEL, C1, or the Unicode line and paragraph
    separators, which YAML reads as line breaks), in words; None when there is none."""
    for c in text:
        if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029":
            return NAMED.get(c, f"a control character (U+{ord(c):04X})")
    return None


# A terminal's escape sequences (ECMA-48), as 7-bit ESC forms and their 8-bit C1 equals: a
# control sequence (CSI ... final byte: colours, cursor moves), a string (OSC, DCS, SOS, PM,
# APC: a window title, a hyperlink) ended by BEL or ST, or ESC and its one-character function.
ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|\x1b[ -/]*[0-~]"
)
# What is left that a terminal would act on or that reorders what it shows: C0 but the tab,
# DEL, C1, the line and paragraph separators, the bidirectional overrides and isolates.
UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


ESCAPE_START = re.compile("[\x1b\x90\x98\x9b\x9d-\x9f]")  # where any of them begins: a quick look first


def printable(text: str) -> str:
    """Text from a log as a terminal may show it: escape sequences removed (what the log says
    without its colours or title), any other control character spelled out (\\x1b, \\u202e)."""
    return UNPRINTABLE.sub(_spelled, without_escapes(text))


def without_escapes(text: str) -> str:
    """The text without its escape sequences (the same string when it has none): what a
    pattern is matched against, so that a coloured line matches as a plain one."""
    return ESCAPE_SEQUENCE.sub("", text) if ESCAPE_START.search(text) else text


def _spelled(match: re.Match) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
