"""Each check of the smoke, judged from the replies it got:

    answers      the tasks sent one at a time: at least PASS_RATE of them answered right,
                 and every kind of task on its own too (PASS_RATE of its 3-4 tasks,
                 rounded down, and at least one): a kind the model never answers fails
    garbage      no output of any request (alone or in the burst) that a detector flags
    under-load   the tasks again inside a burst of `concurrency` requests at once (filled
                 with more copies of them): at least PASS_RATE answered right (every kind
                 on its own too), and the answer lines the same as alone on at least
                 AGREEMENT of the requests
    streamed     one task of each kind again, streamed ("stream": true, as clients and
                 sglang's benchmark client ask): the answer the events assemble is the
                 one sent whole, to the character
    logprobs     the fixed text's prompt logprobs come back, finite and <= 0, and are a
                 model's (logprobs.py): they vary across positions, and the greedy
                 tokens generated after the text carry the top logprob of their position
    baseline     (--baseline) the same logprobs against the recorded ones: mean and max
                 |Δ| per token within LOGPROB_MEAN_MAX / LOGPROB_TOKEN_MAX; the answers
                 the same as recorded on at least AGREEMENT of the tasks

Separate from the run (command.py), which sends the requests: these read replies and return a
`Check`, nothing more, so each can be judged on replies made up in a test.
"""

from __future__ import annotations

import math

from sm120kit.quality import baseline as baselines
from sm120kit.quality import detectors, tasks
from sm120kit.quality import logprobs as logprob_rules
from sm120kit.quality.client import Reply
from sm120kit.quality.options import SmokeOptions
from sm120kit.quality.smoke_report import Check, CheckName

EXAMPLES = 3
SHOWN = 60  # characters of an output in an example


def _shown(reply: Reply) -> str:
    if reply.error:
        return f"error: {reply.error}"
    text = reply.text if len(reply.text) <= SHOWN else reply.text[:SHOWN] + "..."
    return repr(text)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def kind_needed(of: int, rate: float) -> int:
    """Right answers a kind of `of` tasks needs on its own: the smoke's rate, rounded down
    (a kind has 3-4 of the 32 tasks: one may slip, as in the whole), and at least one."""
    return max(1, math.floor(rate * of + 1e-9))


def _by_kind(judged: list[tuple[tasks.Task, bool]], rate: float) -> tuple[dict[str, dict], list[str]]:
    """Per task kind, {"right", "of"}; and the kinds short of kind_needed."""
    kinds: dict[str, dict] = {}
    for task, ok in judged:
        count = kinds.setdefault(str(task.kind), {"right": 0, "of": 0})
        count["right"] += ok
        count["of"] += 1
    return kinds, [kind for kind, c in kinds.items() if c["right"] < kind_needed(c["of"], rate)]


def _kinds_said(kinds: dict[str, dict], failed: list[str], rate: float) -> str:
    """ "; every kind must pass on its own: capitals 0/3 right, 2 needed" (a few kinds)."""
    if not failed:
        return ""
    said = [
        f"{k} {kinds[k]['right']}/{kinds[k]['of']} right, {kind_needed(kinds[k]['of'], rate)} needed" for k in failed
    ]
    more = f"; and {len(said) - EXAMPLES} more kinds" if len(said) > EXAMPLES else ""
    return f"; every kind must pass on its own: {'; '.join(said[:EXAMPLES])}{more}"


def answers_check(work: list[tasks.Task], alone: list[Reply], options: SmokeOptions) -> Check:
    judged = [(t, not r.error and t.check(r.text)) for t, r in zip(work, alone)]
    wrong = [(t, r) for (t, ok), r in zip(judged, alone) if not ok]
    right = len(work) - len(wrong)
    kinds, failed_kinds = _by_kind(judged, options.pass_rate)
    passed = right >= math.ceil(options.pass_rate * len(work)) and not failed_kinds
    needed = _percent(options.pass_rate, 1)
    detail = f"{right}/{len(work)} answers right ({_percent(right, len(work))}, at least {needed} needed)"
    detail += _kinds_said(kinds, failed_kinds, options.pass_rate)
    wrong.sort(key=lambda pair: str(pair[0].kind) not in failed_kinds)  # the kinds that failed shown first
    examples = [f"{t.id} {t.question!r} -> {_shown(r)} (expected {t.answer})" for t, r in wrong[:EXAMPLES]]
    short_text = f"{right}/{len(work)} answers right"
    data = {"right": right, "of": len(work), "kinds": kinds, "failed_kinds": failed_kinds}
    return Check(CheckName.ANSWERS, passed, detail, short_text, [] if passed else examples, data)


def garbage_check(work: list[tasks.Task], alone: list[Reply], burst: list[Reply]) -> Check:
    counts = dict.fromkeys(detectors.NAMES, 0)
    examples: dict[str, str] = {}
    outputs = [("alone", work[i], r) for i, r in enumerate(alone)]
    outputs += [("burst", work[i % len(work)], r) for i, r in enumerate(burst)]
    for where, task, reply in outputs:
        if reply.error:
            continue
        for name in detectors.flags(detectors.Output(reply.text, reply.completion_tokens, reply.finish)):
            counts[name] += 1
            examples.setdefault(name, f"{name} ({where}) {task.id} -> {_shown(reply)}")
    fired = {name: n for name, n in counts.items() if n}
    answered = sum(1 for _, _, r in outputs if not r.error)
    if not fired:
        detail = f"no garbage in {answered} outputs ({', '.join(detectors.NAMES)})"
    else:
        detail = ", ".join(f"{name} in {n} of {answered} outputs" for name, n in fired.items())
    examples_ = list(examples.values())[:EXAMPLES]
    return Check(CheckName.GARBAGE, not fired, detail, "no garbage", examples_, {"detectors": counts})


def under_load_check(
    work: list[tasks.Task], alone: list[Reply], burst: list[Reply], options: SmokeOptions, stalled: str | None = None
) -> Check:
    if not burst:
        why = "no task was answered alone" if all(r.error for r in alone) else stalled
        return Check(CheckName.UNDER_LOAD, False, f"not run: {why}", data={"requests": 0})
    n = len(work)
    judged = [(work[i % n], not r.error and work[i % n].check(r.text)) for i, r in enumerate(burst)]
    right = sum(ok for _, ok in judged)
    kinds, failed_kinds = _by_kind(judged, options.pass_rate)
    differ = [
        (i, r)
        for i, r in enumerate(burst)
        if r.error or alone[i % n].error or tasks.answer_line(r.text) != tasks.answer_line(alone[i % n].text)
    ]
    same = len(burst) - len(differ)
    passed = right >= math.ceil(options.pass_rate * len(burst)) and same >= math.ceil(options.agreement * len(burst))
    passed = passed and not failed_kinds
    detail = (
        f"burst of {len(burst)}: {right} right ({_percent(right, len(burst))}), "
        f"{same} agree with alone ({_percent(same, len(burst))}, at least {_percent(options.agreement, 1)} needed)"
    ) + _kinds_said(kinds, failed_kinds, options.pass_rate)
    examples = [
        f"{work[i % n].id}: alone {_shown(alone[i % n])}, in the burst {_shown(r)}" for i, r in differ[:EXAMPLES]
    ]
    if not examples:  # as wrong as alone: the answers check shows what
        wrong = [(i, r) for i, r in enumerate(burst) if r.error or not work[i % n].check(r.text)]
        examples = [f"{work[i % n].id} in the burst -> {_shown(r)}" for i, r in wrong[:EXAMPLES]]
    data: dict[str, object] = {
        "requests": len(burst),
        "right": right,
        "agree": same,
        "errors": sum(1 for r in burst if r.error),
    }
    data["kinds"], data["failed_kinds"] = kinds, failed_kinds
    short = f"burst of {len(burst)} agrees on {same}/{len(burst)}"
    return Check(CheckName.UNDER_LOAD, passed, detail, short, [] if passed else examples, data)


def streamed_tasks(work: list[tasks.Task]) -> list[int]:
    """The tasks sent again streamed: the first of each kind."""
    seen: dict[tasks.Kind, int] = {}
    for i, task in enumerate(work):
        seen.setdefault(task.kind, i)
    return sorted(seen.values())


def streamed_check(work: list[tasks.Task], alone: list[Reply], picked: list[int], streamed: list[Reply]) -> Check:
    """Each streamed answer, as its events assemble it, against the same task sent whole:
    greedy, one request at a time, the two are the same text."""
    compared = [(work[i], alone[i], reply) for i, reply in zip(picked, streamed) if not alone[i].error]
    differ = [(t, whole, reply) for t, whole, reply in compared if reply.error or reply.text != whole.text]
    same = len(compared) - len(differ)
    data = {"streamed": len(streamed), "compared": len(compared), "same": same}
    if not compared:
        why = "no task was answered whole" if all(alone[i].error for i in picked) else "none was streamed"
        return Check(CheckName.STREAMED, False, f"not run: {why}", data=data)

    def flagged(reply: Reply) -> str:
        found = detectors.flags(detectors.Output(reply.text, reply.completion_tokens, reply.finish))
        return f" ({', '.join(found)})" if found and not reply.error else ""

    examples = [f"{t.id}: streamed {_shown(r)}{flagged(r)}, sent whole {_shown(w)}" for t, w, r in differ[:EXAMPLES]]
    if differ:
        detail = f"{len(differ)} of {len(compared)} streamed answers differ from the same task sent whole"
    else:
        detail = f"{same} tasks streamed (one of each kind): each the same as sent whole"
    return Check(CheckName.STREAMED, not differ, detail, f"{same}/{len(compared)} streamed alike", examples, data)


def logprob_check(found: tuple) -> Check:
    parsed, reply = found
    if parsed is None:
        why = reply.error or "no meta_info.input_token_logprobs in sglang's [logprob, token_id, text] shape"
        return Check(CheckName.LOGPROBS, False, f"the fixed text's prompt logprobs did not come back: {why}")
    ids, values = parsed
    bad = [(i, v) for i, v in enumerate(values[1:], 1) if not (math.isfinite(v) and v <= 1e-6)]
    problems, figures = logprob_rules.check(reply.meta, values)
    detail = f"{len(ids)} prompt logprobs" + (", finite and <= 0" if not bad else f": {len(bad)} not finite or > 0")
    if problems:
        detail += f"; not a model's ({len(problems)} finding(s)): {problems[0]}"
    else:
        detail += (
            f", spread over {figures['spread']:.1f} nats; {figures['greedy_checked']} greedy tokens each the most "
            "likely of its position"
        )
    examples = [f"token {i} (id {ids[i]}): {v}" for i, v in bad[:EXAMPLES]] + problems[1 : 1 + EXAMPLES]
    data = {"tokens": len(ids), "bad": len(bad), "problems": len(problems), **figures}
    ok = not bad and not problems
    return Check(CheckName.LOGPROBS, ok, detail, "logprobs finite, ranked", examples[:EXAMPLES], data)


def baseline_check(
    options: SmokeOptions,
    reference: baselines.Baseline,
    found: tuple,
    d: baselines.Drift | None,
    work: list[tasks.Task],
    alone: list[Reply],
) -> Check:
    parsed, reply = found
    if parsed is None or d is None:
        return Check(
            CheckName.BASELINE, False, f"not compared: the prompt logprobs did not come back ({reply.error or 'none'})"
        )
    ok = d.mean <= options.logprob_mean_max and d.max <= options.logprob_token_max
    detail = (
        f"|Δ logprob| mean {d.mean:.4f} (at most {options.logprob_mean_max:g}), max {d.max:.4f} "
        f"(at most {options.logprob_token_max:g}) over {d.tokens} tokens"
    )
    examples = [] if ok else [f"token {d.worst} (id {d.worst_token}) moved {d.max:.4f}"]
    short = f"baseline |Δ| mean {d.mean:.4f} max {d.max:.4f}"
    data = {"mean_abs_delta": d.mean, "max_abs_delta": d.max, "tokens": d.tokens, "worst_token": d.worst}
    if reference.answers and reference.seed == options.seed:
        pairs = [(t, r) for t, r in zip(work, alone) if t.id in reference.answers]
        moved = [(t, r) for t, r in pairs if tasks.answer_line(r.text) != reference.answers[t.id]]
        same = len(pairs) - len(moved)
        agree = same >= math.ceil(options.agreement * len(pairs))
        detail += f"; {same}/{len(pairs)} answers as recorded"
        short += f", {same}/{len(pairs)} answers as recorded"
        data["answers_as_recorded"] = same
        if not agree:
            examples += [f"{t.id}: recorded {reference.answers[t.id]!r}, now {_shown(r)}" for t, r in moved[:EXAMPLES]]
        ok = ok and agree
    return Check(CheckName.BASELINE, ok, detail, short, examples, data)
