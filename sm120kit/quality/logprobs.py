"""Whether the logprobs a server returns are a model's, without a baseline to compare with.
Finite values <= 0 alone let made-up numbers through (a constant, say); these hold for any
model, because sglang computes every figure of a position from one log_softmax of its
logits (layers/sampler.py, layers/logprob_processor.py; 0.5.9 and 0.5.23 alike):

- a greedy token (temperature 0: the argmax of those logits) carries the top logprob of
  its position: meta_info.output_token_logprobs[i][0] equals the largest of
  meta_info.output_top_logprobs[i] (asked for with `top_logprobs_num`);
- a token that is in its position's top list has the same logprob there; a prompt token
  is never more likely than its position's top (meta_info.input_top_logprobs);
- a position's top logprobs are part of one distribution: their probabilities sum to at
  most 1;
- the prompt logprobs of plain prose vary across positions (a common word after its
  usual neighbour near 0, a number or a name several nats down): a constant is made up.

Every list entry is [logprob, token_id, text-or-null] (detokenize_logprob_tokens); a top
list is a list of them, most likely first, or null (the first prompt position). orjson
writes a NaN or -inf as null: a null logprob in a top list counts as -inf."""

from __future__ import annotations

import math

TOP_LOGPROBS = 5  # top_logprobs_num asked for
TOLERANCE = 1e-3  # nats: one log_softmax gives both figures; JSON carries them exactly
MASS_TOLERANCE = 1e-3  # of probability, over a position's top list
SPREAD_MIN = 1.0  # nats between the least and the most likely prompt token of the fixed text
SHOWN = 3


def _entry(row) -> tuple[float, int] | None:
    """(logprob, token id) of a [logprob, token_id, text] entry; None when not that shape.
    A null logprob is -inf (orjson writes NaN and -inf as null)."""
    if not isinstance(row, (list, tuple)) or len(row) < 2 or not isinstance(row[1], int) or isinstance(row[1], bool):
        return None
    value = row[0]
    if value is None:
        return -math.inf, row[1]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value), row[1]


def _top(rows) -> list[tuple[float, int]] | None:
    """A position's top list; None when it is null, empty or not sglang's shape."""
    if not isinstance(rows, list) or not rows:
        return None
    found = [entry for entry in map(_entry, rows) if entry is not None]
    return found if len(found) == len(rows) else None


def _position(where: str, value: float, token: int, top: list[tuple[float, int]], greedy: bool) -> list[str]:
    """What is wrong with one position: its token's logprob against its top list."""
    problems = []
    best, best_id = max(top, key=lambda pair: pair[0])
    if greedy and not value >= best - TOLERANCE:
        problems.append(
            f"{where} (id {token}) has logprob {value:.4f}, below its position's top {best:.4f} (id {best_id}): "
            "a greedy token is the most likely of its position"
        )
    elif not greedy and value > best + TOLERANCE:
        problems.append(f"{where} (id {token}) has logprob {value:.4f}, above its position's top {best:.4f}")
    listed = [v for v, t in top if t == token]
    if listed and abs(listed[0] - value) > TOLERANCE:
        problems.append(f"{where} (id {token}) has logprob {value:.4f}, and {listed[0]:.4f} in its position's top list")
    mass = sum(math.exp(min(v, 50.0)) for v, _ in top)  # -inf adds 0; a huge one must not overflow
    if mass > 1 + MASS_TOLERANCE:
        problems.append(f"{where}: its position's top {len(top)} logprobs add up to probability {mass:.3f}, over 1")
    return problems


def check(meta: dict, prompt: list[float | None]) -> tuple[list[str], dict]:
    """(what is wrong, figures) of one /generate's meta_info, asked with return_logprob,
    logprob_start_len 0 and top_logprobs_num; `prompt` its parsed prompt logprobs (the
    first None)."""
    problems: list[str] = []
    finite = [v for v in prompt[1:] if v is not None and math.isfinite(v)]
    spread = max(finite) - min(finite) if finite else 0.0
    if len(finite) > 1 and spread < SPREAD_MIN:
        problems.append(
            f"the {len(finite)} prompt logprobs hardly vary (all within {spread:.3f} nats; plain prose spans "
            f"{SPREAD_MIN:g}+): numbers made up, not a model's"
        )
    outputs, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    greedy = 0
    if not isinstance(outputs, list) or not outputs:
        problems.append("no meta_info.output_token_logprobs came back")
    elif not isinstance(tops, list) or len(tops) != len(outputs):
        problems.append(
            f"meta_info.output_top_logprobs (top_logprobs_num {TOP_LOGPROBS}) did not come back one per output "
            "token: whether a greedy token is the most likely of its position cannot be told"
        )
    else:
        for i, (row, rows) in enumerate(zip(outputs, tops)):
            entry, top = _entry(row), _top(rows)
            if entry is None or top is None:
                problems.append(f"output token {i}: not sglang's [logprob, token_id, text] shape")
                continue
            if not math.isfinite(entry[0]):
                problems.append(f"output token {i} (id {entry[1]}): logprob {entry[0]}, not finite")
                continue
            greedy += 1
            problems += _position(f"greedy output token {i}", entry[0], entry[1], top, greedy=True)
    prompt_tops = meta.get("input_top_logprobs")
    ids = meta.get("input_token_logprobs") or []
    checked = 0
    if isinstance(prompt_tops, list) and isinstance(ids, list):
        for i, (row, rows) in enumerate(zip(ids, prompt_tops)):
            entry, top = _entry(row), _top(rows)
            if i == 0 or entry is None or top is None or not math.isfinite(entry[0]):
                continue  # the first has nothing before it; a non-finite one is the finite check's
            checked += 1
            problems += _position(f"prompt token {i}", entry[0], entry[1], top, greedy=False)
    return problems, {"spread": round(spread, 4), "greedy_checked": greedy, "prompt_tops_checked": checked}
