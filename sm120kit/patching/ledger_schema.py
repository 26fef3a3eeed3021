"""The schema of ledger.json, strict: a ledger whose values have the wrong types or whose
paths could reach outside the target is damaged, never half-read (a `"patches": "<id>"`
string once made `unpatch` restore nothing and say so with exit 0)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

HEX64 = r"^[0-9a-f]{64}$"


def inside_target(path: str) -> str:
    """A path relative to a package's install root that cannot leave it."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\0" in path or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"{path!r} is not a relative path inside the target")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{path!r} leaves (or does not name a file in) the target")
    return path


def timestamp(text: str) -> str:
    if text:
        datetime.fromisoformat(text)  # ValueError: reported as damage
    return text


RelPath = Annotated[str, AfterValidator(inside_target)]
Digest = Annotated[str, Field(pattern=HEX64)]


class Entry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    package: str = Field(min_length=1)
    version: str = Field(min_length=1)
    path: RelPath
    vendor_sha256: Digest
    patched_sha256: Digest
    patches: dict[str, Annotated[int, Field(ge=1)]] = Field(min_length=1)
    patched_at: Annotated[str, AfterValidator(timestamp)] = ""


class Allowance(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    package: str
    version: str
    reason: str = ""
    at: str = ""


class LedgerDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    schema_: int = Field(alias="schema")
    tool: str = ""
    files: dict[str, Entry] = {}
    allowed_missing: dict[str, Allowance] = {}

    @model_validator(mode="after")
    def _keys_name_their_entries(self) -> LedgerDocument:
        for key, entry in self.files.items():
            if key != f"{entry.package}:{entry.path}":
                raise ValueError(f"files key {key!r} does not name its entry ({entry.package}:{entry.path})")
        for key, allowance in self.allowed_missing.items():
            package, _, patch_id = key.partition(":")
            if package != allowance.package or not patch_id:
                raise ValueError(f"allowed_missing key {key!r} is not <package>:<patch id> of its entry")
        return self
