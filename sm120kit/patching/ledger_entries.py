"""The ledger's records (a patched file, a tuned table) and where a table may be written:
what the ledger, its strict schema and its check share, below all three."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Where tune-moe may write: a table in a configs/triton_*/ directory, below sglang's MoE
# layers in the package, or at the top of a config dir ($SGLANG_MOE_CONFIG_DIR).
TABLE_IN_CONFIG_DIR = re.compile(r"configs/triton_[^/]+/E=[^/]+\.json")
TABLE_IN_PACKAGE = re.compile(r"sglang/srt/layers/moe/(?:[^/]+/)+" + TABLE_IN_CONFIG_DIR.pattern)


def is_table_path(path: str, root: str) -> bool:
    """Whether `path` (relative to `root`: "package" or "config-dir") names a place where
    tune-moe writes a config table, and nothing else."""
    pattern = TABLE_IN_PACKAGE if root == "package" else TABLE_IN_CONFIG_DIR
    return pattern.fullmatch(path) is not None


@dataclass
class FileEntry:
    package: str
    version: str  # the package version the file was patched at
    path: str  # relative to the package's install root
    vendor_sha256: str  # the bytes before we wrote (the wheel's, when RECORD agrees)
    patched_sha256: str  # the bytes we last wrote
    patches: dict[str, int]  # patch id -> revision
    patched_at: str = ""


@dataclass
class TunedEntry:
    """A fused-MoE config table that `tune-moe` wrote where sglang looks it up."""

    package: str  # "sglang": whose lookup reads it
    version: str  # the sglang release it was tuned for (a shipped copy: copied from)
    path: str  # relative to its root
    root: str  # "package": the package's install root; "config-dir": the directory of this ledger
    kind: str  # "tuned": timed on the node; "shipped": a copy of sglang's own table for this GPU
    triton_version: str
    device_name: str  # torch.cuda.get_device_name(), as sglang names the file after it
    vendor_sha256: str  # the bytes it replaced (kept in backups/); "": there was no file
    written_sha256: str  # the bytes we wrote
    shape: dict | None = None  # MoeShape.to_json() of a tuned table
    down: bool = False  # the down projection's table (`_down` in the name)
    batch_sizes: list[int] = field(default_factory=list)
    profile: str = ""  # `sm120kit tune-moe PROFILE` tunes it again
    tuned_at: str = ""
    installed_at: str = ""
