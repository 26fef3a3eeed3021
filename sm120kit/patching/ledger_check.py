"""ledger.json through its strict schema (ledger_schema.py), without paying for pydantic on
every run: the schema's reading of a document is kept in the outcome cache under the
document's contents and the schema's source, as outcomes are kept under a file's bytes. A
warm `status` or `patch --check` on a patched environment then costs what it costs on an
unpatched one; a document the cache has not seen (a changed ledger, another schema, an
empty cache) is validated in full. Only what the schema accepted is cached: a damaged
ledger is validated, and reported, every time.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

from sm120kit.patching import cache as outcome_cache
from sm120kit.patching.ledger_entries import FileEntry, TunedEntry

Entries = tuple[dict[str, FileEntry], dict[str, dict], dict[str, TunedEntry], list[str]]


class Invalid(ValueError):
    """The document is not what the schema allows: the message says where and why."""


@cache
def _schema_digest() -> str:
    # the schema and the table-path rule it applies (ledger_entries.py)
    here = Path(__file__)
    sources = (here.with_name("ledger_schema.py"), here.with_name("ledger_entries.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


def _key(raw: dict) -> str:
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return outcome_cache.key("ledger", _schema_digest(), hashlib.sha256(canonical.encode()).hexdigest())


def read(raw: dict) -> Entries:
    """(files, allowed_missing, tuned, moe_config_dirs) of a parsed ledger.json, as the
    strict schema reads them. Raises Invalid for a document it refuses."""
    key = _key(raw)
    hit = outcome_cache.get(key)
    if hit is not None:
        try:
            return _entries(hit)
        except (TypeError, KeyError, AttributeError, ValueError):
            pass  # a cache file that is not ours to trust: validate again
    doc = _validate(raw)
    outcome_cache.put(key, doc)
    return _entries(doc)


def _validate(raw: dict) -> dict:
    from sm120kit.errors import problems
    from sm120kit.patching.ledger_schema import LedgerDocument

    try:
        doc = LedgerDocument.model_validate(raw)
    except ValueError as exc:
        raise Invalid(problems(exc)) from None
    return {
        "files": {k: v.model_dump() for k, v in doc.files.items()},
        "allowed_missing": {k: v.model_dump() for k, v in doc.allowed_missing.items()},
        "tuned": {k: v.model_dump() for k, v in doc.tuned.items()},
        "moe_config_dirs": list(doc.moe_config_dirs),
    }


def _entries(doc: dict) -> Entries:
    return (
        {k: FileEntry(**v) for k, v in doc["files"].items()},
        {k: dict(v) for k, v in doc["allowed_missing"].items()},
        {k: TunedEntry(**v) for k, v in doc["tuned"].items()},
        [str(d) for d in doc["moe_config_dirs"]],
    )
