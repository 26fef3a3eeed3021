"""The variants of a search (`bench --vary`, `bench --variants`): each a name and the --set
words that turn the profile as written into it (`Variant`), and the plan made of them before
anything starts (`Plan`, one `Planned` a variant: runnable, skipped or refused, with why);
how a value is written as TOML, as --set reads it back.

Reading the variants from the command line or a file is variant_reading.py's, planning them
variant_plan.py's: the search, its state and its report read these types and need neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

BASELINE = "as-written"


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...] = ()  # --set words: "engine.max_running_requests=2048"
    description: str = ""
    requires: tuple[tuple[str, str], ...] = ()  # (package, PEP 440 range)
    why: str = ""  # said when it is skipped

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "set": list(self.sets),
            "description": self.description,
            "requires": dict(self.requires),
            "why": self.why,
        }


class VariantStatus(str, Enum):
    RUNNABLE = "runnable"
    SKIPPED = "skipped"  # nothing started: why says
    REFUSED = "refused"  # serve's preflight would refuse it: nothing started, why says

    def __str__(self) -> str:
        return self.value


@dataclass
class Planned:
    """A variant, its profile and launch, or why it is skipped."""

    variant: Variant
    status: VariantStatus
    why: str = ""
    profile: Any = None  # the Profile with the variant's sets
    launch: Any = None  # its Launch for the installed sglang
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def runnable(self) -> bool:
        return self.status is VariantStatus.RUNNABLE

    def as_json(self) -> dict:
        return {
            **self.variant.as_json(),
            "status": str(self.status),
            "why": self.why or self.variant.why,
            "warnings": self.warnings,
        }


@dataclass(frozen=True)
class Plan:
    profile: str  # the profile's name
    source: str  # "--vary" or the variants file
    variants: list[Planned]  # as-written first
    notes: list[str] = field(default_factory=list)
    serve_args: tuple[str, ...] = ()  # --profile-dir / --python words: serve finds the same profile and sglang

    def with_serve_args(self, profile_dirs: list[str] | None, python: str | None) -> Plan:
        words = [w for d in profile_dirs or () for w in ("--profile-dir", str(Path(d).resolve()))]
        words += ["--python", python] if python else []
        return dataclasses.replace(self, serve_args=tuple(words))

    @property
    def runnable(self) -> list[Planned]:
        return [p for p in self.variants if p.runnable]

    @property
    def skipped(self) -> list[Planned]:
        """Those not run: skipped, or refused."""
        return [p for p in self.variants if not p.runnable]

    @property
    def refused(self) -> list[Planned]:
        return [p for p in self.variants if p.status is VariantStatus.REFUSED]

    def as_json(self) -> dict:
        return {
            "profile": self.profile,
            "source": self.source,
            "variants": [p.as_json() for p in self.variants],
            "notes": self.notes,
            "serve_args": list(self.serve_args),
        }


# -- values as TOML ----------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """A value as TOML spells it (what --set reads back to the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else {"inf": "inf", "-inf": "-inf"}.get(str(value), "nan")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return json.dumps(str(value))


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def set_word(key: str, value: Any) -> str:
    return f"{key}={toml_value(value)}"


def profile_snippet(profile_name: str, sets: tuple[str, ...]) -> str:
    """A profile file that adopts the sets: extends the profile, one table per section."""
    from sm120kit.profiles.loader import parse_set

    tables: dict[tuple, list[str]] = {}
    for word in sets:
        path, value = parse_set(word)
        tables.setdefault(tuple(path[:-1]), []).append(f"{_toml_key(str(path[-1]))} = {toml_value(value)}")
    lines = [f'extends = "{profile_name}"']
    lines += tables.pop((), [])
    for table, rows in tables.items():
        lines += ["", f"[{'.'.join(_toml_key(str(k)) for k in table)}]", *rows]
    return "\n".join(lines)
