"""The smoke's tasks: short questions with one checkable answer (arithmetic, copy a code
back, the larger or smaller of two numbers, count the items of a list, the next number of
a sequence, a word in capitals), generated from a seed: the same seed gives the same tasks
on every machine, and nothing is downloaded.

Each prompt is a plain completion (`Question: ... Answer with the number only.\\nAnswer:`),
which base and chat models alike continue with the answer when sent to /generate without
a chat template (a reasoning model's leading `<think>...</think>`, when it closes within
the tokens asked for, is skipped). The check reads the first non-empty line of the output:
tolerant of whitespace, quotes, markdown emphasis, a trailing period and a short sentence
around the answer ("The answer is 42.", "17 + 25 = 42"), strict about the value ("43",
"42.5", "42 or 43", "43 or 42", "apple" for "APPLE" all fail)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from enum import Enum

DEFAULT_COUNT = 32
MIN_COUNT = 30
LONGEST_ANSWER_LINE = 80  # characters: a longer first line is not "the answer alone"

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "silver",
    "window", "rocket", "forest", "pencil", "bridge", "orange", "planet", "castle", "mirror", "basket",
)  # fmt: skip


class Kind(str, Enum):
    ADD = "add"
    SUBTRACT = "subtract"
    MULTIPLY = "multiply"
    LARGER = "larger"
    SMALLER = "smaller"
    COPY = "copy"
    COUNT = "count"
    NEXT = "next"
    CAPITALS = "capitals"

    def __str__(self) -> str:
        return self.value


NUMERIC = frozenset({Kind.ADD, Kind.SUBTRACT, Kind.MULTIPLY, Kind.LARGER, Kind.SMALLER, Kind.COUNT, Kind.NEXT})
CODE = re.compile(r"[A-Za-z0-9]+(?:-[A-Za-z0-9]+)+")  # what could be a COPY code: hyphenated words
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")  # "42", "-42", "42.5" (not "4.42"'s "42")
THINK = re.compile(r"\s*<think>.*?</think>", re.S)  # a reasoning model's leading think block, closed


@dataclass(frozen=True)
class Task:
    id: str  # "t07-add": stable for a seed, the key of a recorded answer
    kind: Kind
    question: str
    answer: str

    @property
    def prompt(self) -> str:
        what = "the number" if self.kind in NUMERIC else "the code" if self.kind is Kind.COPY else "the word"
        return f"Question: {self.question} Answer with {what} only.\nAnswer:"

    def check(self, output: str) -> bool:
        return check(self, output)


def generate(seed: int = 0, count: int = DEFAULT_COUNT) -> list[Task]:
    """`count` tasks, the kinds in turn, their numbers drawn from random.Random(seed)."""
    rng = random.Random(seed)
    kinds = list(Kind)
    return [_task(rng, i, kinds[i % len(kinds)]) for i in range(count)]


def _task(rng: random.Random, i: int, kind: Kind) -> Task:
    tid = f"t{i:02d}-{kind}"
    if kind is Kind.ADD:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return Task(tid, kind, f"What is {a} + {b}?", str(a + b))
    if kind is Kind.SUBTRACT:
        a, b = rng.randint(50, 99), rng.randint(10, 49)
        return Task(tid, kind, f"What is {a} - {b}?", str(a - b))
    if kind is Kind.MULTIPLY:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return Task(tid, kind, f"What is {a} * {b}?", str(a * b))
    if kind in (Kind.LARGER, Kind.SMALLER):
        a, b = rng.sample(range(100, 1000), 2)
        which = "larger" if kind is Kind.LARGER else "smaller"
        return Task(
            tid, kind, f"Which number is {which}, {a} or {b}?", str(max(a, b) if which == "larger" else min(a, b))
        )
    if kind is Kind.COPY:
        code = "".join(rng.choice("abcdefghjkmnpqrstuvwxyz") for _ in range(3)) + f"-{rng.randint(1000, 9999)}"
        return Task(tid, kind, f"Repeat this code exactly: {code}", code)
    if kind is Kind.COUNT:
        items = rng.sample(WORDS, rng.randint(3, 7))
        return Task(tid, kind, f"How many items are in this list: {', '.join(items)}?", str(len(items)))
    if kind is Kind.NEXT:
        start, step = rng.randint(1, 20), rng.randint(2, 9)
        seq = ", ".join(str(start + k * step) for k in range(4))
        return Task(tid, kind, f"What number comes next: {seq}?", str(start + 4 * step))
    word = rng.choice(WORDS)
    return Task(tid, kind, f"Write the word {word} in capital letters.", word.upper())


def answer_line(output: str) -> str:
    """The first non-empty line of an output, trimmed: what the checks and the agreement
    under load compare (a model may go on after it: a next question, blank lines). A
    leading think block that closes (`<think>...</think>`, a reasoning model's, empty in
    its non-thinking mode) is skipped; one still open leaves "<think>": no answer."""
    if match := THINK.match(output):
        output = output[match.end() :]
    return next((line.strip() for line in output.splitlines() if line.strip()), "")


def _plain(line: str) -> str:
    """The line without markdown emphasis, quotes, backticks and a trailing period."""
    return line.replace("**", "").replace("__", "").strip(" \t\"'`*").rstrip(".!").strip(" \"'`*")


def check(task: Task, output: str) -> bool:
    line = answer_line(output)
    if not line or len(line) > LONGEST_ANSWER_LINE:
        return False
    plain = _plain(line)
    if plain == task.answer:
        return True
    if task.kind in NUMERIC:  # "17 + 25 = 42", "The answer is 42.": the last number is the answer,
        numbers = NUMBER.findall(plain.replace(",", " "))  # and any other one is the question's ("43 or 42")
        given = set(NUMBER.findall(task.question.replace(",", " ")))
        return bool(numbers) and numbers[-1] == task.answer and all(n in given for n in numbers[:-1])
    if task.kind is Kind.COPY:  # every hyphenated word in the line is the code
        found = CODE.findall(plain)
        return bool(found) and all(c == task.answer for c in found)
    found = re.findall(r"\b[A-Z]{3,}\b", plain)  # CAPITALS: every capitalised word is the word
    return bool(found) and all(w == task.answer for w in found)
