"""A directory as files and bytes: "nothing changed" is two equal snapshots."""

from __future__ import annotations

from pathlib import Path


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (ledger included) with its bytes; the ledger's lock is left out."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock"
    }
