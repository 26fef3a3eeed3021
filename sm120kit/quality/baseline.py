"""The reference a smoke is compared with: a fixed text's prompt logprobs, teacher-forced
(/generate with `return_logprob: true, logprob_start_len: 0`, one new token), and the
answers to the tasks, recorded from a server known to be right; with the model it served,
its sglang release and the text's token ids, so that a reference from another model or
tokenizer is refused rather than compared.

sglang returns meta_info.input_token_logprobs as [logprob, token_id, text-or-null] per
prompt token, the first logprob null (nothing precedes it): TokenizerManager.
detokenize_logprob_tokens, filled by convert_logprob_style / add_logprob_to_meta_info
(0.5.9 and 0.5.23 alike)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sm120kit.errors import UserError

FORMAT = "sm120kit-smoke-baseline"
VERSION = 1

# Plain prose, ~120 tokens in most tokenizers: common words, numbers, punctuation.
FIXED_TEXT = (
    "The river runs past the old mill, under three stone bridges, and into the harbour, where the "
    "fishing boats come back at dawn. In 1887 the town counted 4,200 people; today it has nearly "
    "twice as many, and the market still opens every Saturday at eight o'clock. Visitors walk along "
    "the quay, buy bread, apples and cheese, and watch the gulls circle above the lighthouse. When "
    "the tide is low, children look for crabs between the rocks, and the water is clear and cold."
)


@dataclass(frozen=True)
class Baseline:
    model: str | None  # what /v1/models said
    model_path: str | None  # /server_info's model_path
    sglang: str | None  # /server_info's version
    text: str
    token_ids: list[int]
    logprobs: list[float | None]  # per token; the first is None
    answers: dict[str, str] = field(default_factory=dict)  # task id -> its answer line
    seed: int = 0
    url: str = ""
    recorded_at: str = ""

    def as_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


@dataclass(frozen=True)
class Drift:
    """|Δ logprob| per prompt token against the baseline."""

    tokens: int
    mean: float
    max: float
    worst: int  # the position of the largest
    worst_token: int


def parse_logprobs(meta: dict) -> tuple[list[int], list[float | None]] | None:
    """(token ids, logprobs) of meta_info.input_token_logprobs; None when it is missing or
    not sglang's shape. A NaN comes back as null (orjson) or NaN: kept as NaN."""
    rows = meta.get("input_token_logprobs")
    if not isinstance(rows, list) or not rows:
        return None
    ids, values = [], []
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) < 2 or not isinstance(row[1], int):
            return None
        value = row[0]
        if value is not None and not isinstance(value, (int, float)):
            return None
        ids.append(row[1])
        values.append(None if value is None else float(value))
    values = [values[0], *(math.nan if v is None else v for v in values[1:])]  # past the first, null is NaN
    return ids, values


def writable(path: Path) -> str | None:
    """Why a baseline cannot be written to path (None: it can), asked before any request."""
    if path.is_dir():
        return "it is a directory"
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if folder is None or not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "permission denied"
    return None


def save(path: Path, baseline: Baseline) -> None:
    """Written atomically (a temp file beside it, then renamed); nothing is left on a failure."""
    from sm120kit.atomic_write import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(baseline.as_json(), indent=1) + "\n").encode())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def load(path: Path, target: str = "PROFILE") -> Baseline:
    """A recorded baseline, or a UserError that says what is wrong with the file (and the
    command that records one: `sm120kit smoke TARGET --record-baseline PATH`)."""
    hint = f"record a new one from a server you trust: sm120kit smoke {target} --record-baseline {path}"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"baseline {path}: no such file", hint) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"baseline {path} cannot be read: {getattr(exc, 'strerror', None) or exc}", hint) from None
    except ValueError as exc:
        raise UserError(f"baseline {path} is not JSON ({exc}): corrupt or not a baseline", hint) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f'baseline {path} is not an sm120kit smoke baseline (no "format": "{FORMAT}")', hint)
    if doc.get("version") != VERSION:
        raise UserError(
            f"baseline {path} has format version {doc.get('version')!r}; this sm120kit reads {VERSION}", hint
        )
    try:
        ids, values = doc["token_ids"], doc["logprobs"]
        ok = (
            isinstance(doc["text"], str)
            and isinstance(ids, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            and isinstance(values, list)
            and len(values) == len(ids) > 1
            and values[0] is None
            and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values[1:])
            and isinstance(doc.get("answers", {}), dict)
            and all(isinstance(v, str) for v in doc.get("answers", {}).values())
            and all(isinstance(doc.get(k), (str, type(None))) for k in ("model", "model_path", "sglang"))
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise UserError(
            f"baseline {path} is corrupt: it needs text, token_ids and as many finite logprobs (the first null)", hint
        )
    return Baseline(
        model=doc.get("model"),
        model_path=doc.get("model_path"),
        sglang=doc.get("sglang"),
        text=doc["text"],
        token_ids=ids,
        logprobs=[None, *map(float, values[1:])],
        answers=doc.get("answers", {}),
        seed=doc.get("seed", 0) if isinstance(doc.get("seed", 0), int) else 0,
        url=str(doc.get("url", "")),
        recorded_at=str(doc.get("recorded_at", "")),
    )


def same_model(
    path: Path, baseline: Baseline, model: str | None, model_path: str | None, target: str = "PROFILE"
) -> None:
    """A baseline of another model is a UserError (comparing it would only show noise)."""
    theirs, ours = dict.fromkeys((baseline.model, baseline.model_path)), dict.fromkeys((model, model_path))
    if (baseline.model and model and baseline.model != model) or (
        baseline.model_path and model_path and baseline.model_path != model_path
    ):
        raise UserError(
            f"baseline {path} was recorded from another model ({' / '.join(filter(None, theirs))}); "
            f"this server serves {' / '.join(filter(None, ours))}: nothing was compared",
            f"compare with a baseline of this model, or record one: sm120kit smoke {target} --record-baseline FILE",
        )


def drift(path: Path, baseline: Baseline, ids: list[int], values: list[float | None], target: str = "PROFILE") -> Drift:
    """|Δ logprob| per token; a different tokenization of the text is a UserError."""
    if ids != baseline.token_ids:
        at = next(
            (i for i, (a, b) in enumerate(zip(ids, baseline.token_ids)) if a != b),
            min(len(ids), len(baseline.token_ids)),
        )
        raise UserError(
            f"baseline {path}: the server tokenizes the fixed text differently ({len(ids)} tokens, "
            f"{len(baseline.token_ids)} recorded; first difference at token {at}): another model or tokenizer, "
            "nothing was compared",
            "compare with a baseline recorded from this model and tokenizer, or record one: "
            f"sm120kit smoke {target} --record-baseline FILE",
        )
    deltas = [
        (abs(v - b) if math.isfinite(v) else math.inf, i)
        for i, (v, b) in enumerate(zip(values, baseline.logprobs))
        if i > 0 and v is not None and b is not None
    ]
    largest, worst = max(deltas)
    return Drift(len(deltas), sum(d for d, _ in deltas) / len(deltas), largest, worst, ids[worst])
