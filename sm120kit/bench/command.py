"""`sm120kit bench`: a concurrency sweep with sglang's own client against a running server
(a profile's, or a URL), written to a results directory; `sm120kit bench compare A B`."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sm120kit import endpoint
from sm120kit.bench import analysis, client, results
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile
    from sm120kit.quality.smoke_report import SmokeReport
    from sm120kit.target import Target


@dataclass(frozen=True)
class BenchOptions:
    levels: list[int]  # concurrency levels, ascending
    input_len: int = 256
    output_len: int = 128
    prompts_per_level: float = 3.0
    threshold: float = analysis.DEFAULT_THRESHOLD
    tokenizer: str | None = None
    model: str | None = None
    out: Path | None = None  # the results directory (default ./sm120kit-bench/<name>-<time>)
    url: str | None = None  # http://host:port: this server, not the profile's
    python: str | None = None  # the interpreter that runs sglang's client (default: this one)
    patch_dirs: tuple[str, ...] = ()  # for the patch status recorded with the results
    repeat: int = 1  # client runs per level: the median of each figure, and their spread
    smoke: bool = True  # the smoke before the sweep (a failed one marks the run; the sweep still runs)


class Progress(Protocol):
    """What a sweep tells as it goes (bench/render.py prints it)."""

    def sweeping(self, url: str, module: str, sglang: str, levels: list[int], directory: Path) -> None: ...

    def level_started(self, number: int, count: int, concurrency: int, prompts: int) -> None: ...

    def level_done(self, level: analysis.Level) -> None: ...

    def smoke_started(self, url: str) -> None: ...

    def smoke_done(self, report: SmokeReport) -> None: ...


@dataclass(frozen=True)
class SweepResult:
    directory: Path
    run: dict  # run.json as written
    levels: list[analysis.Level]
    verdict: analysis.Verdict | None  # None: interrupted before the end
    plot_note: str | None = None  # why plot.png was skipped

    @property
    def interrupted(self) -> bool:
        return self.verdict is None

    @property
    def smoke_failed(self) -> bool:
        smoke = self.run.get("smoke") or {}
        return not smoke.get("skipped") and smoke.get("passed") is False

    @property
    def exit_code(self) -> ExitCode:
        if self.interrupted:
            return ExitCode.INTERRUPTED
        failed = any(lv.failed or not lv.figures or lv.error or lv.garbled for lv in self.levels)
        return ExitCode.FINDINGS if failed or self.smoke_failed else ExitCode.OK

    def as_json(self) -> dict:
        return {"directory": str(self.directory), **self.run, "plot": self.plot_note, "exit_code": int(self.exit_code)}


@dataclass(frozen=True)
class Comparison:
    before: tuple[str, str]  # (directory, title)
    after: tuple[str, str]
    headers: list[str]
    rows: list[list[str]]

    def as_json(self) -> dict:
        return {
            "before": {"directory": self.before[0], "title": self.before[1]},
            "after": {"directory": self.after[0], "title": self.after[1]},
            "rows": [dict(zip(self.headers, row)) for row in self.rows],
            "exit_code": int(ExitCode.OK),
        }


def _recorded_environment(target: Target, patch_dirs: tuple[str, ...]) -> tuple[dict, list[dict]]:
    """The versions and each patch's outcome in the client's environment, from the node's
    checks (bench's subset), to record with the results."""
    from sm120kit.node import registry, snapshot

    found = registry.run(registry.BENCH, registry.CheckInputs(snapshot.live(target), patch_dirs=patch_dirs))
    data = {c.id: c.data for c in found}
    return data.get("software", {}).get("versions", {}), data.get("patches", {}).get("findings", [])


def run_smoke(profile: Profile | None, url: str, api_key: str | None) -> SmokeReport:
    """sm120kit smoke against the server at url (the profile's, or --url's): a SmokeReport."""
    from sm120kit.quality.command import smoke
    from sm120kit.quality.options import SmokeOptions, options_for

    options = options_for(profile, url=url) if profile is not None else SmokeOptions(url=url, api_key=api_key)
    return smoke(options)


def sweep(
    options: BenchOptions,
    profile: Profile | None,  # None: options.url's server, no profile's
    target: Target,
    progress: Progress,
    server: contextlib.AbstractContextManager | None = None,
    smoke: dict | None = None,
    alive: Callable[[], bool] | None = None,
) -> SweepResult:
    """Against options.url, or the profile's server; `server` (bench --serve) is entered
    around the sweep: up before the first level, stopped after the last. The smoke runs
    first (options.smoke), unless `smoke` brings its verdict (the search ran it). `alive`
    (the search's): no further level starts once it says the server is gone."""
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: its benchmark client runs from there",
            "point sm120kit at the serving environment with --python EXE",
        )
    if options.url:  # a server of the user's: no profile to say its limits, model or key variable
        url, name = options.url, options.url.split("//")[-1].replace(":", "-")
        max_running = model = key_env = None
    elif profile is None:
        raise ValueError("a sweep needs options.url or a profile")  # bench loads one unless --url
    else:
        from sm120kit.endpoint import probe_host
        from sm120kit.urls import http_url

        url = http_url(probe_host(profile.server.host), profile.server.port)
        name, max_running, model = profile.name, profile.engine.max_running_requests, profile.model.path
        key_env = profile.server.api_key_env
    api_key = endpoint.api_key(key_env)
    plan = client.Sweep(
        options.python or sys.executable,
        client.client_module(dist),
        url,
        options.input_len,
        options.output_len,
        options.prompts_per_level,
        tokenizer=options.tokenizer,
        model=options.model,
        api_key=api_key,
    )
    with server or contextlib.nullcontext():
        client.check_reachable(url, api_key)
        if smoke is None:
            smoke = {"skipped": "--no-smoke"}
            if options.smoke:
                progress.smoke_started(url)
                report = run_smoke(profile, url, api_key)
                progress.smoke_done(report)
                smoke = report.as_json()
        directory = options.out or Path("sm120kit-bench") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        directory.mkdir(parents=True, exist_ok=True)
        versions, patches = _recorded_environment(target, options.patch_dirs)
        meta = {
            "title": f"{name}, input {options.input_len} / output {options.output_len} tokens",
            "profile": profile.model_dump(mode="json", exclude={"name", "source"}) if profile else None,
            "profile_name": profile.name if profile else None,
            "url": url,
            "model": model,
            "client": plan.module,
            "threshold": options.threshold,
            "repeat": options.repeat,
            "smoke": smoke,
            "command": plan.argv(options.levels[0], directory / f"c{options.levels[0]}.jsonl"),
            "versions": versions,
            "patches": patches,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        meta["summary"] = {"url": url, "client": plan.module, **{k: v for k, v in versions.items() if v}}
        progress.sweeping(url, plan.module, dist.version, options.levels, directory)
        return _run_levels(plan, options, directory, meta, max_running, progress, alive)


def _run_levels(
    plan: client.Sweep,
    options: BenchOptions,
    directory: Path,
    meta: dict,
    max_running: int | None,
    progress: Progress,
    alive: Callable[[], bool] | None = None,
) -> SweepResult:
    done: list[analysis.Level] = []
    try:
        for i, concurrency in enumerate(options.levels, 1):
            if alive is not None and not alive():
                break
            progress.level_started(i, len(options.levels), concurrency, plan.prompts(concurrency))
            done.append(client.run_repeated(plan, concurrency, directory, options.repeat))
            progress.level_done(done[-1])
            results.write_run(directory, meta, done, None, finished=False)
    except KeyboardInterrupt:  # the finished levels are kept
        return SweepResult(directory, results.write_run(directory, meta, done, None, finished=False), done, None)
    verdict = analysis.verdict(done, options.threshold, max_running)
    smoke = meta.get("smoke") or {}
    if not smoke.get("skipped") and smoke.get("passed") is False:
        verdict = analysis.Verdict(
            verdict.plateau_from,
            verdict.best,
            [f"{results.smoke_line(smoke)} — these figures are of a server that answers wrong", *verdict.lines],
        )
    run = results.write_run(directory, meta, done, verdict, finished=True)
    results.write_tables(directory, meta, done, verdict)
    return SweepResult(directory, run, done, verdict, results.write_plot(directory, meta["title"], done))


def compare(before: str, after: str) -> Comparison:
    doc_a, a = results.load_run(before)
    doc_b, b = results.load_run(after)
    headers, rows = analysis.compare_rows(a, b)
    return Comparison((before, doc_a.get("title", "")), (after, doc_b.get("title", "")), headers, rows)
