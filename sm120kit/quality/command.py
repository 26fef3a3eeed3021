"""`sm120kit smoke`: the checks against a running server, one SmokeReport.

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

Thresholds, and why: greedy decoding of a healthy server is deterministic for one request;
in a batch, sglang's kernels may sum in another order (batch-size-dependent reductions)
and a near-tie between two tokens can flip — on outputs of ~16 tokens that is rare, and
short answers to easy questions agree. 90 % tolerates a few such flips in a burst of 64+,
and catches what the field saw (NaN tiles under load, garbled output: most answers wrong).
Logprobs of the same weights moved by a kernel or KV-cache change differ by ~1e-3..1e-2
nats per token on average; a broken numeric path moves them by tenths to whole nats: a
mean above 0.05 or a token above 1.0 nat is a finding."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode
from sm120kit.quality import baseline as baselines
from sm120kit.quality import detectors, tasks
from sm120kit.quality import logprobs as logprob_rules
from sm120kit.quality.client import Client, Reply

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile

PASS_RATE = 0.90  # of the tasks answered right, alone and in the burst
AGREEMENT = 0.90  # of the burst's answer lines equal to the same task's alone (and of the baseline's)
LOGPROB_MEAN_MAX = 0.05  # nats: mean |Δ logprob| per prompt token against the baseline
LOGPROB_TOKEN_MAX = 1.0  # nats: the largest |Δ| of one token
MIN_BURST, MAX_BURST = 64, 512  # the burst: at least the issue's 64; at most 512 threads and sockets
MAX_NEW_TOKENS = 16
LOGPROB_NEW_TOKENS = 8  # greedy tokens after the fixed text, each checked against its position's top logprobs
GIVE_UP_AFTER = 3  # requests in a row without an answer (timed out, refused): the rest are not sent
EXAMPLES = 3
SHOWN = 60  # characters of an output in an example


class Progress(Protocol):
    def step(self, text: str) -> None: ...


@dataclass(frozen=True)
class SmokeOptions:
    url: str  # http://host:port
    api_key: str | None = field(default=None, repr=False)  # Bearer key (never logged)
    concurrency: int = MIN_BURST  # the burst for the agreement check (>= 64)
    baseline: Path | None = None  # compare prompt logprobs with this reference file
    record_baseline: Path | None = None  # write this server's answers + logprobs here
    name: str | None = None  # the profile: the report's title (None with --url)
    model: tuple[str, ...] = ()  # what the profile's server answers to (served name, model path); () with --url
    seed: int = 0  # the tasks' numbers, and sampling_seed
    tasks: int = tasks.DEFAULT_COUNT
    max_new_tokens: int = MAX_NEW_TOKENS
    timeout_s: float = 60.0  # per request
    budget_s: float = 300.0  # the whole smoke: no request outlives it (a hung server fails it, not hangs it)
    pass_rate: float = PASS_RATE
    agreement: float = AGREEMENT
    logprob_mean_max: float = LOGPROB_MEAN_MAX
    logprob_token_max: float = LOGPROB_TOKEN_MAX

    def thresholds(self) -> dict:
        return {
            "pass_rate": self.pass_rate,
            "agreement": self.agreement,
            "logprob_mean_max": self.logprob_mean_max,
            "logprob_token_max": self.logprob_token_max,
        }


def options_for(profile: Profile, url: str | None = None, **overrides: Any) -> SmokeOptions:
    """The profile's server (or `url`), its key ($server.api_key_env; an `api_key` override
    wins), a burst of the profile's scale (engine.max_running_requests) within
    MIN_BURST..MAX_BURST; any other SmokeOptions field as an override."""
    from sm120kit.endpoint import api_key, probe_host
    from sm120kit.urls import http_url

    if url is None:
        url = http_url(probe_host(profile.server.host), profile.server.port)
    if "api_key" not in overrides:
        overrides["api_key"] = api_key(profile.server.api_key_env)
    scale = profile.engine.max_running_requests or MIN_BURST
    served = tuple(n for n in (profile.model.served_name, profile.model.path) if n)
    values = {
        "concurrency": min(MAX_BURST, max(MIN_BURST, scale)),
        "name": profile.name,
        "model": served,
        **overrides,
    }
    return SmokeOptions(url=url, **values)


class CheckName(str, Enum):
    ANSWERS = "answers"
    GARBAGE = "garbage"
    UNDER_LOAD = "under-load"
    STREAMED = "streamed"
    LOGPROBS = "logprobs"
    BASELINE = "baseline"

    def __str__(self) -> str:  # a table cell or an f-string shows the word
        return self.value


@dataclass(frozen=True)
class Check:
    name: CheckName
    passed: bool
    detail: str  # one line: the figures
    short: str = ""  # a few words for the summary line
    examples: list[str] = field(default_factory=list)  # what failed, a few
    data: dict = field(default_factory=dict)

    def failure(self) -> str:
        shown = f"; e.g. {'; '.join(self.examples)}" if self.examples else ""
        return f"{self.name}: {self.detail}{shown}"

    def as_json(self) -> dict:
        return {
            "name": self.name.value,
            "passed": self.passed,
            "detail": self.detail,
            "examples": self.examples,
            **self.data,
        }


@dataclass(frozen=True)
class SmokeReport:
    passed: bool
    failures: list[str]  # one line per failed check: its name, what failed, an example
    checks: list[Check]
    url: str
    model: str | None
    sglang: str | None
    seconds: float
    tasks: int
    concurrency: int
    thresholds: dict
    name: str | None = None
    baseline: Path | None = None  # compared with
    recorded: Path | None = None  # written
    note: str | None = None  # e.g. why --record-baseline wrote nothing
    stalled: str | None = None  # why the smoke stopped sending: the server stopped answering, the budget ran out

    def summary(self) -> str:
        if not self.passed:
            failed = [str(c.name) for c in self.checks if not c.passed]
            return (
                f"smoke FAILED: {', '.join(failed)} ({len(failed)} of {len(self.checks)} checks; {self.seconds:.1f} s)"
            )
        return f"smoke passed: {', '.join(c.short or str(c.name) for c in self.checks)} ({self.seconds:.1f} s)"

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if self.passed else ExitCode.FINDINGS

    def as_json(self) -> dict:
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "sglang": self.sglang,
            "seconds": round(self.seconds, 3),
            "tasks": self.tasks,
            "concurrency": self.concurrency,
            "thresholds": self.thresholds,
            "checks": [c.as_json() for c in self.checks],
            "failures": self.failures,
            "baseline": str(self.baseline) if self.baseline else None,
            "recorded_baseline": str(self.recorded) if self.recorded else None,
            "note": self.note,
            "stalled": self.stalled,
            "exit_code": int(self.exit_code),
        }


class _Quiet:
    def step(self, text: str) -> None:
        pass


def check_options(options: SmokeOptions) -> None:
    if not MIN_BURST <= options.concurrency <= MAX_BURST:
        raise UserError(
            f"a burst of {options.concurrency} requests: allowed: {MIN_BURST} to {MAX_BURST}",
            f"e.g. --concurrency {MIN_BURST} (the profile's engine.max_running_requests by default)",
        )
    if options.tasks < tasks.MIN_COUNT:
        raise UserError(f"{options.tasks} tasks: at least {tasks.MIN_COUNT}")


def _same_model_as_profile(options: SmokeOptions, model: str | None, model_path: str | None) -> None:
    """The server on the profile's port serves the profile's model: another server there
    (someone else's, an earlier profile's) would be checked, and recorded, in its place."""
    said = [m for m in (model, model_path) if m]
    if not options.model or not said or set(said) & set(options.model):
        return
    raise UserError(
        f"the server at {options.url} serves {' / '.join(said)}, not profile {options.name}'s "
        f"{' / '.join(options.model)}: another server holds the port; nothing was checked",
        f"see what runs there (sm120kit ps), or check that server by its URL: sm120kit smoke --url {options.url}",
    )


def smoke(options: SmokeOptions, progress: Progress | None = None) -> SmokeReport:
    """Every check against options.url. UserError (exit 2) when the server is not there or
    refuses the key, or the baseline is corrupt or of another model or tokenizer."""
    check_options(options)
    progress = progress or _Quiet()
    began = time.monotonic()
    target = options.name or f"--url {options.url}"
    if options.record_baseline and (why := baselines.writable(options.record_baseline)):
        raise UserError(
            f"cannot write the baseline {options.record_baseline}: {why}",
            "give a writable path: --record-baseline FILE",
        )
    reference = baselines.load(options.baseline, target) if options.baseline else None  # before any request
    client = Client(options.url, options.api_key, options.timeout_s, options.seed)
    model = client.reach(options.name)
    info = client.get_json("/server_info") or client.get_json("/get_server_info") or {}
    model_path = info.get("model_path") if isinstance(info.get("model_path"), str) else None
    incremental = _incremental_streaming(info)
    sglang = info.get("version") if isinstance(info.get("version"), str) else None
    _same_model_as_profile(options, model, model_path)
    if reference and options.baseline:
        baselines.same_model(options.baseline, reference, model, model_path, target)
    sender = _Sender(began + options.budget_s, options.budget_s)

    progress.step("prompt logprobs of the fixed text ...")  # first: a baseline of another tokenizer stops here
    texts = dict.fromkeys([baselines.FIXED_TEXT, *([reference.text] if reference else [])])
    found = {text: _logprobs(client, text, sender) for text in texts}
    drift = None
    measured = found[reference.text][0] if reference else None
    if reference and options.baseline and measured is not None:
        drift = baselines.drift(options.baseline, reference, *measured, target)

    work = tasks.generate(options.seed, options.tasks)
    progress.step(f"{len(work)} tasks, one request at a time ...")

    def alone_reply(task: tasks.Task) -> Reply:
        return sender.send(lambda: client.generate(task.prompt, options.max_new_tokens, sender.deadline))

    def streamed_reply(task: tasks.Task) -> Reply:
        return sender.send(lambda: client.stream(task.prompt, options.max_new_tokens, sender.deadline, incremental))

    alone = [alone_reply(task) for task in work]
    checks = [_answers(work, alone, options)]
    picked = _streamed_tasks(work)  # after the tasks alone: each is compared with its answer sent whole
    streamed = [streamed_reply(work[i]) for i in picked]
    burst: list[Reply] = []
    if any(r.error is None for r in alone) and not sender.stopped():
        progress.step(f"the tasks again inside a burst of {options.concurrency} concurrent requests ...")
        prompts = [work[i % len(work)].prompt for i in range(options.concurrency)]
        burst = client.burst(prompts, options.max_new_tokens, sender.deadline)
        if all(r.unanswered for r in burst):
            sender.stalled = f"none of the burst's {len(burst)} requests got an answer (e.g. {burst[0].error})"
    checks.append(_garbage(work, alone, burst))
    checks.append(_under_load(work, alone, burst, options, sender.stalled))
    checks.append(_streamed(work, alone, picked, streamed))
    checks.append(_logprob_check(found[baselines.FIXED_TEXT]))
    if reference:
        checks.append(_baseline_check(options, reference, found[reference.text], drift, work, alone))

    failed = [c for c in checks if not c.passed]
    recorded, note = None, None
    if options.record_baseline:
        parsed = found[baselines.FIXED_TEXT][0]
        if failed or parsed is None:
            note = f"baseline not recorded ({options.record_baseline}): the smoke failed; a reference must be right"
        else:
            ids, values = parsed
            answers = {t.id: tasks.answer_line(r.text) for t, r in zip(work, alone)}
            record = baselines.Baseline(
                model, model_path, sglang, baselines.FIXED_TEXT, ids, values, answers, options.seed, options.url,
                baselines.now(),
            )  # fmt: skip
            try:
                baselines.save(options.record_baseline, record)
            except OSError as exc:
                raise UserError(
                    f"cannot write the baseline {options.record_baseline}: {exc.strerror or exc}",
                    "give a writable path: --record-baseline FILE",
                ) from None
            recorded = options.record_baseline
    return SmokeReport(
        passed=not failed,
        failures=[c.failure() for c in failed],
        checks=checks,
        url=options.url,
        model=model,
        sglang=sglang,
        seconds=time.monotonic() - began,
        tasks=len(work),
        concurrency=options.concurrency,
        thresholds=options.thresholds(),
        name=options.name,
        baseline=options.baseline,
        recorded=recorded,
        note=note,
        stalled=sender.stalled,
    )


# -- the parts ---------------------------------------------------------------------------


class _Sender:
    """The smoke's requests one after another, within its deadline: after GIVE_UP_AFTER in a
    row got no answer (timed out, refused), or once the deadline passed, the rest are not
    sent (a hung server would take a timeout each) and `stalled` says why."""

    def __init__(self, deadline: float, budget_s: float) -> None:
        self.deadline, self.budget_s = deadline, budget_s
        self.in_row = 0
        self.stalled: str | None = None

    def stopped(self) -> bool:
        if self.stalled is None and time.monotonic() >= self.deadline:
            self.stalled = f"the smoke's time budget ({self.budget_s:g} s) ran out"
        return self.stalled is not None

    def send(self, request: Callable[[], Reply]) -> Reply:
        if self.stopped():
            return Reply(error=f"not sent: {self.stalled}", unanswered=True)
        reply = request()
        self.in_row = self.in_row + 1 if reply.unanswered else 0
        if self.in_row >= GIVE_UP_AFTER:
            self.stalled = f"{self.in_row} requests in a row got no answer (the last: {reply.error})"
        return reply


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


def _answers(work: list[tasks.Task], alone: list[Reply], options: SmokeOptions) -> Check:
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


def _garbage(work: list[tasks.Task], alone: list[Reply], burst: list[Reply]) -> Check:
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


def _under_load(
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


def _incremental_streaming(info: dict) -> bool | None:
    """Whether the server streams each event's own text (--incremental-streaming-output,
    0.5.10+; --stream-output in 0.5.9) or the text so far (the default), as /server_info
    says; None when it does not say."""
    for key in ("incremental_streaming_output", "stream_output"):
        if isinstance(info.get(key), bool):
            return info[key]
    return None


def _streamed_tasks(work: list[tasks.Task]) -> list[int]:
    """The tasks sent again streamed: the first of each kind."""
    seen: dict[tasks.Kind, int] = {}
    for i, task in enumerate(work):
        seen.setdefault(task.kind, i)
    return sorted(seen.values())


def _streamed(work: list[tasks.Task], alone: list[Reply], picked: list[int], streamed: list[Reply]) -> Check:
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


def _logprobs(client: Client, text: str, sender: _Sender) -> tuple[tuple[list[int], list] | None, Reply]:
    reply = sender.send(
        lambda: client.generate(
            text,
            LOGPROB_NEW_TOKENS,
            sender.deadline,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=logprob_rules.TOP_LOGPROBS,
        )
    )
    return (None if reply.error else baselines.parse_logprobs(reply.meta)), reply


def _logprob_check(found: tuple) -> Check:
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


def _baseline_check(
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
