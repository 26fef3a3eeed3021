"""`sm120kit smoke`: the run against a running server, one SmokeReport. It reaches the server,
sends the tasks alone, streamed and inside a burst, and the fixed text for its logprobs, within
its budget, then hands the replies to the checks (checks.py) and records a baseline when asked.

What is asked is options.py's, what is found smoke_report.py's, how each check judges checks.py's:
this module is the order of the requests and their sending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from sm120kit.errors import UserError
from sm120kit.quality import baseline as baselines
from sm120kit.quality import logprobs as logprob_rules
from sm120kit.quality import tasks
from sm120kit.quality.checks import (
    answers_check,
    baseline_check,
    garbage_check,
    logprob_check,
    streamed_check,
    streamed_tasks,
    under_load_check,
)
from sm120kit.quality.client import Client, Reply
from sm120kit.quality.options import SmokeOptions, check_options
from sm120kit.quality.smoke_report import SmokeReport

LOGPROB_NEW_TOKENS = 8  # greedy tokens after the fixed text, each checked against its position's top logprobs
GIVE_UP_AFTER = 3  # requests in a row without an answer (timed out, refused): the rest are not sent


class Progress(Protocol):
    def step(self, text: str) -> None: ...


class _Quiet:
    def step(self, text: str) -> None:
        pass


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
    checks = [answers_check(work, alone, options)]
    picked = streamed_tasks(work)  # after the tasks alone: each is compared with its answer sent whole
    streamed = [streamed_reply(work[i]) for i in picked]
    burst: list[Reply] = []
    if any(r.error is None for r in alone) and not sender.stopped():
        progress.step(f"the tasks again inside a burst of {options.concurrency} concurrent requests ...")
        prompts = [work[i % len(work)].prompt for i in range(options.concurrency)]
        burst = client.burst(prompts, options.max_new_tokens, sender.deadline)
        if all(r.unanswered for r in burst):
            sender.stalled = f"none of the burst's {len(burst)} requests got an answer (e.g. {burst[0].error})"
    checks.append(garbage_check(work, alone, burst))
    checks.append(under_load_check(work, alone, burst, options, sender.stalled))
    checks.append(streamed_check(work, alone, picked, streamed))
    checks.append(logprob_check(found[baselines.FIXED_TEXT]))
    if reference:
        checks.append(baseline_check(options, reference, found[reference.text], drift, work, alone))

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


def _incremental_streaming(info: dict) -> bool | None:
    """Whether the server streams each event's own text (--incremental-streaming-output,
    0.5.10+; --stream-output in 0.5.9) or the text so far (the default), as /server_info
    says; None when it does not say."""
    for key in ("incremental_streaming_output", "stream_output"):
        if isinstance(info.get(key), bool):
            return info[key]
    return None


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
