"""JSON that sm120kit reads back (its ledger and journal, a run's state.json, a recorded
NVML document, a model's config.json), with its nesting bounded before it is parsed.

json recurses once per level: a document nested a few thousand levels deep is a
RecursionError there (or in whatever walks the result), where it must be what any other
malformed document is: a ValueError, so that the reader reports the file as damaged.
No file sm120kit reads is nested more than a few levels.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)  # a bracket inside a string nests nothing
_BRACKETS = re.compile(r"[^\[\]{}]+")


class TooDeep(ValueError):
    """A document nested deeper than MAX_DEPTH."""


def depth(text: str) -> int:
    """How deep the brackets of a JSON text nest (outside its strings)."""
    deepest = level = 0
    for bracket in _BRACKETS.sub("", _STRING.sub("", text)):
        level += 1 if bracket in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing (TooDeep, a ValueError) a document nested deeper than max_depth."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # a UnicodeDecodeError is a ValueError too
    if text.count("[") + text.count("{") > max_depth and (found := depth(text)) > max_depth:
        raise TooDeep(f"nested {found} levels deep; no document sm120kit reads nests more than {max_depth}")
    return json.loads(text)
