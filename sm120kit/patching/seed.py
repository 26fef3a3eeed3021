"""The shipped outcome seed: the verdicts of the shipped patches on the vendor's bytes of
every release in the proven window (and on the bytes they write), computed ahead by
`python scripts/seed_outcomes.py` into patches/outcomes.json. Planning reads it after the
outcome cache misses, so a first `status` or `patch --check` on a release it knows parses
no file. Its keys are the cache's own (sm120kit's version, the patch module's sha256, the
file's sha256, ...): a changed patch or another sm120kit version misses and is parsed, so a
stale seed costs speed, never a wrong verdict. $SM120KIT_NO_OUTCOME_SEED=1 switches it off
(the tests do, to exercise the transforms; so does the script, to compute every verdict)."""

from __future__ import annotations

import json
import os
from functools import cache

from sm120kit.search_paths import shipped

FILE_NAME = "outcomes.json"


@cache
def _outcomes() -> dict:
    try:
        doc = json.loads((shipped("patches") / FILE_NAME).read_text())
    except (OSError, ValueError):  # not shipped, or damaged: every lookup misses
        return {}
    outcomes = doc.get("outcomes") if isinstance(doc, dict) else None
    return outcomes if isinstance(outcomes, dict) else {}


def get(name: str) -> dict | None:
    """The seeded verdict under an outcome-cache key, or None."""
    if os.environ.get("SM120KIT_NO_OUTCOME_SEED"):
        return None
    value = _outcomes().get(name)
    return value if isinstance(value, dict) and isinstance(value.get("outcome"), str) else None
