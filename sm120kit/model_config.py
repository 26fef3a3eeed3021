"""A model's config.json: found in a local directory or the Hugging Face cache (never the
network: a launch is judged and tune-moe runs where the node may be offline), and read.
What a config says is its readers' business: tune-moe's MoE shape (tune/model_config.py),
the launch rules' model conditions (catalogue/rules.py). A leaf: only other leaves here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sm120kit import shallow_json
from sm120kit.errors import UserError


def hub_cache(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache as huggingface_hub resolves it."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HUGGINGFACE_HUB_CACHE"):  # the older spelling, still honoured by huggingface_hub
        return Path(env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return xdg / "huggingface" / "hub"


def _is_repo_id(model_path: str) -> bool:
    parts = model_path.split("/")
    return len(parts) == 2 and all(parts) and not model_path.startswith((".", "~"))


def find_model_config(model_path: str, *, env: Mapping[str, str] = os.environ) -> Path:
    """config.json of a local model directory, or of a repo id's snapshot in the Hugging Face
    cache: the revision refs/main names, else the newest snapshot that has a config.json."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local / "config.json"
        raise UserError(
            f"no config.json in the model directory {local}",
            "point [model] path at the directory that holds the checkpoint and its config.json",
        )
    if not _is_repo_id(model_path):
        raise UserError(
            f"model path {model_path!r} is neither a local directory nor a Hugging Face repo id (org/name)",
            "set [model] path to the checkpoint's directory or its repo id",
        )
    repo = hub_cache(env) / f"models--{model_path.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip() / "config.json"
        if pinned.is_file():
            return pinned
    found = sorted((p for p in snapshots.glob("*/config.json") if p.is_file()), key=lambda p: p.parent.stat().st_mtime)
    if found:
        return found[-1]
    raise UserError(
        f"no config.json for {model_path} in the Hugging Face cache (searched {snapshots}; "
        "set HF_HUB_CACHE or HF_HOME if the cache lives elsewhere)",
        f"huggingface-cli download {model_path} config.json (or set [model] path to a local directory)",
    )


def read_model_config(path: Path) -> dict:
    try:
        data = shallow_json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist", "download the model's config.json, or pass its path") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON: {exc}", "download the model's config.json again") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a model config (a JSON object)", "download the model's config.json again")
    return data
