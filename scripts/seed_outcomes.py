#!/usr/bin/env python3
"""Write patches/outcomes.json, the shipped outcome seed (sm120kit/patching/seed.py): the
verdicts of the shipped patches on every sglang release of the proven window, the
flashinfer-python release each pins, and the flashinfer releases proven past the pins.

    python scripts/seed_outcomes.py

Run it after a patch or the window changes (a test says when the seed is stale). It fetches
the wheels (cached), unpacks only the files the patches rewrite into a scratch site, and plans
`patch --check` on each with an empty outcome cache, the seed switched off and every verdict
from the transforms (no quick read); what that puts into the cache (the verdicts on the
vendor's bytes, and already-applied on the bytes a patch would write) is the seed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from packaging.version import Version

from sm120kit import __version__, wheels
from sm120kit.patching import planning, registry, seed
from sm120kit.patching.spec import Patch
from sm120kit.target import resolve_target

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "patches" / seed.FILE_NAME


def releases() -> list[tuple[str, str]]:
    """(package, version) of every release the seed covers."""
    flashinfer = {wheels.flashinfer_pin(v) for v in wheels.SGLANG_WINDOW} | set(wheels.FLASHINFER_PAST_PINS)
    return [("sglang", v) for v in wheels.SGLANG_WINDOW] + [
        ("flashinfer-python", v) for v in sorted(flashinfer - {None}, key=Version)
    ]


def check(site: Path, patches: list[Patch]) -> None:
    """`patch --check`'s plan, every verdict from the transforms (what they write is cached)."""
    plan = planning.plan(resolve_target(site=str(site)), patches, need_bytes=False, quick=False)
    if plan.errors or plan.blockers:
        raise SystemExit(f"patch --check on {site}: {[f.detail for f in plan.errors] + plan.blockers}")


def main() -> int:
    patches = registry.load_patches()
    members = sorted({r.path for p in patches for r in p.rewrites})
    os.environ["SM120KIT_NO_OUTCOME_SEED"] = "1"  # compute every verdict: the seed being written is not read
    covered = releases()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SM120KIT_CACHE_DIR"] = str(Path(tmp) / "cache")
        for package, version in covered:
            site = Path(tmp) / f"{package}-{version}"
            wheels.install(site, package, version, members)
            check(site, patches)
            print(f"{package} {version}", file=sys.stderr)
        outcomes = {
            path.name: json.loads(path.read_text()) for path in sorted((Path(tmp) / "cache" / "outcomes").glob("*/*"))
        }
    doc = {
        "generated_by": "python scripts/seed_outcomes.py",
        "sm120kit": __version__,
        "patches": {p.id: p.source_sha256 for p in sorted(patches, key=lambda p: p.id)},
        "releases": [f"{package} {version}" for package, version in covered],
        "outcomes": outcomes,
    }
    SEED.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    print(f"{SEED.relative_to(ROOT)}: {len(outcomes)} verdicts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
