"""Garbage detectors: the shapes broken numerics give an output, each named in the report.
NaN logits decode as token 0 over and over ("!!!!" in most vocabularies), a corrupted KV
cache as a loop of one token, bad bytes as U+FFFD, a broken sampler as nothing at all or
an end at once. None of them fires on a right answer to a smoke task; a wrong answer that
is not garbage is the answers check's to count."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

REPEAT_RUN = 6  # the same word this many times in a row
CHAR_RUN = 12  # the same non-space character this many times in a row
BANG_RUN = 4  # "!!!!"


@dataclass(frozen=True)
class Output:
    """What one /generate request gave (as the detectors see it)."""

    text: str
    completion_tokens: int | None = None
    finish: str | None = None  # meta_info.finish_reason.type: "stop", "length", "abort"; None: unknown


@dataclass(frozen=True)
class Detector:
    name: str
    meaning: str
    fires: Callable[[Output], bool]


def _empty(out: Output) -> bool:
    return not out.text.strip()


def _repeat(out: Output) -> bool:
    words = out.text.split()
    run = 1
    for a, b in itertools.pairwise(words):
        run = run + 1 if a == b else 1
        if run >= REPEAT_RUN:
            return True
    return re.search(rf"(\S)\1{{{CHAR_RUN - 1},}}", re.sub("[!\ufffd]", "", out.text)) is not None


def _bang(out: Output) -> bool:
    return "!" * BANG_RUN in out.text or bool(re.fullmatch(r"[\s!?.,;:*#~_-]{3,}", out.text) and out.text.strip())


def _replacement(out: Output) -> bool:
    return "\ufffd" in out.text


def _stops_at_once(out: Output) -> bool:
    """Finished (not cut by max_new_tokens) after 0 or 1 tokens: sglang counts the EOS
    token in completion_tokens, so a one-token answer and its EOS are 2."""
    return out.finish == "stop" and out.completion_tokens is not None and out.completion_tokens <= 1


DETECTORS: tuple[Detector, ...] = (
    Detector("empty", "no text (or only whitespace)", _empty),
    Detector("repeat", f"one word {REPEAT_RUN}+ times in a row, or one character {CHAR_RUN}+ times", _repeat),
    Detector("bang", f'"{"!" * BANG_RUN}"-style output: runs of "!" or punctuation alone', _bang),
    Detector("replacement", "U+FFFD replacement characters (bytes that do not decode)", _replacement),
    Detector("stops-at-once", "finished after 0-1 tokens", _stops_at_once),
)
NAMES = tuple(d.name for d in DETECTORS)


def flags(out: Output) -> list[str]:
    """The names of the detectors that fire on this output."""
    return [d.name for d in DETECTORS if d.fires(out)]
