"""What one smoke run is asked to do (`SmokeOptions`): the server, the burst, the budget and the
thresholds it is judged by; `options_for` fills them from a profile.

Separate from the run (command.py) because serve, fleet and bench build these options for the
smoke they start, and the cli for the one it runs, without sending a request.

Thresholds, and why: greedy decoding of a healthy server is deterministic for one request;
in a batch, sglang's kernels may sum in another order (batch-size-dependent reductions)
and a near-tie between two tokens can flip — on outputs of ~16 tokens that is rare, and
short answers to easy questions agree. 90 % tolerates a few such flips in a burst of 64+,
and catches what the field saw (NaN tiles under load, garbled output: most answers wrong).
Logprobs of the same weights moved by a kernel or KV-cache change differ by ~1e-3..1e-2
nats per token on average; a broken numeric path moves them by tenths to whole nats: a
mean above 0.05 or a token above 1.0 nat is a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120kit.errors import UserError
from sm120kit.quality import tasks

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile

PASS_RATE = 0.90  # of the tasks answered right, alone and in the burst
AGREEMENT = 0.90  # of the burst's answer lines equal to the same task's alone (and of the baseline's)
LOGPROB_MEAN_MAX = 0.05  # nats: mean |Δ logprob| per prompt token against the baseline
LOGPROB_TOKEN_MAX = 1.0  # nats: the largest |Δ| of one token
MIN_BURST, MAX_BURST = 64, 512  # the burst: at least the 64; at most 512 threads and sockets
MAX_NEW_TOKENS = 16


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


def check_options(options: SmokeOptions) -> None:
    if not MIN_BURST <= options.concurrency <= MAX_BURST:
        raise UserError(
            f"a burst of {options.concurrency} requests: allowed: {MIN_BURST} to {MAX_BURST}",
            f"e.g. --concurrency {MIN_BURST} (the profile's engine.max_running_requests by default)",
        )
    if options.tasks < tasks.MIN_COUNT:
        raise UserError(f"{options.tasks} tasks: at least {tasks.MIN_COUNT}")
