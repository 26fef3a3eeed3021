"""Control characters in a value that sm120kit writes into another file's syntax (a
systemd unit, a compose file, a manifest, a URL): a newline there starts a line of its own
(a directive of its own, in a unit), a carriage return does the same for systemd, and the
rest make a value that no reader takes as it was meant. One test, said in words."""

from __future__ import annotations

NAMED = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}


def control_char(text: str) -> str | None:
    """The first control character in text (C0, DEL, C1, or the Unicode line and paragraph
    separators, which YAML reads as line breaks), in words; None when there is none."""
    for c in text:
        if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029":
            return NAMED.get(c, f"a control character (U+{ord(c):04X})")
    return None
