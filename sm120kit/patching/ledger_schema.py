"""The schema of ledger.json, strict: a ledger whose values have the wrong types or whose
paths could reach outside the target is damaged, never half-read (a `"patches": "<id>"`
string once made `unpatch` restore nothing and say so with exit 0)."""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from sm120kit.patching.ledger_entries import is_table_path

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


class Shape(BaseModel):
    """A MoeShape as recorded (fields it may gain later are kept, unread)."""

    model_config = ConfigDict(strict=True, extra="allow")

    experts: int = Field(ge=1)
    hidden: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    shard: int = Field(ge=1)
    top_k: int = Field(ge=1)
    dtype: str | None
    block_shape: list[int] | None = Field(default=None, min_length=2, max_length=2)
    per_channel_quant: bool = False
    model: str = ""


class Tuned(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    package: Literal["sglang"]
    version: str = Field(min_length=1)
    path: RelPath
    root: Literal["package", "config-dir"]
    kind: Literal["tuned", "shipped"]
    triton_version: str = Field(min_length=1)
    device_name: str = Field(min_length=1)
    vendor_sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]
    written_sha256: Digest
    shape: Shape | None = None
    down: bool = False
    batch_sizes: list[Annotated[int, Field(ge=1)]] = []
    profile: str = ""
    tuned_at: Annotated[str, AfterValidator(timestamp)] = ""
    installed_at: Annotated[str, AfterValidator(timestamp)] = ""

    @model_validator(mode="after")
    def _a_table_where_tables_go(self) -> Tuned:
        if not is_table_path(self.path, self.root):
            raise ValueError(f"{self.path!r} is no place for a MoE config table ({self.root} root)")
        if self.kind == "tuned" and self.shape is None:
            raise ValueError(f"{self.path}: a tuned table without its shape")
        return self


def config_dir(path: str) -> str:
    """A $SGLANG_MOE_CONFIG_DIR: absolute and normalised (nothing for `..` to climb out of)."""
    if "\0" in path or not os.path.isabs(path) or os.path.normpath(path) != path:
        raise ValueError(f"{path!r} is not an absolute, normalised directory")
    return path


class LedgerDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    schema_: int = Field(alias="schema")
    tool: str = ""
    files: dict[str, Entry] = {}
    allowed_missing: dict[str, Allowance] = {}
    tuned: dict[str, Tuned] = {}
    moe_config_dirs: list[Annotated[str, AfterValidator(config_dir)]] = []

    @model_validator(mode="after")
    def _keys_name_their_entries(self) -> LedgerDocument:
        for key, entry in self.files.items():
            if key != f"{entry.package}:{entry.path}":
                raise ValueError(f"files key {key!r} does not name its entry ({entry.package}:{entry.path})")
        for key, table in self.tuned.items():
            if key != f"{table.package}:{table.path}":
                raise ValueError(f"tuned key {key!r} does not name its entry ({table.package}:{table.path})")
        for key, allowance in self.allowed_missing.items():
            package, _, patch_id = key.partition(":")
            if package != allowance.package or not patch_id:
                raise ValueError(f"allowed_missing key {key!r} is not <package>:<patch id> of its entry")
        return self
