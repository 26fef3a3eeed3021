"""`sm120kit bench`: a concurrency sweep with sglang's own client against a running server
(a profile's, or --url), written to a results directory; `sm120kit bench compare A B`."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from sm120kit import report
from sm120kit.bench import analysis, client, results
from sm120kit.errors import UserError


def _versions(target) -> dict[str, str | None]:
    return {
        name: (d.version if (d := target.find(name)) else None)
        for name in ("sglang", "flashinfer-python", "torch", "triton")
    }


def _patch_status(target) -> list[dict]:
    from sm120kit.patching import engine
    from sm120kit.patching.registry import load_patches

    plan = engine.plan(target, load_patches(None), need_bytes=False)
    return [
        {"patch": f.patch.id, "version": f.version, "outcome": f.outcome.value, "proven": not f.unproven}
        for f in plan.findings
    ]


def _live_line(level: analysis.Level) -> str:
    if not level.figures:
        return f"  FAILED: {level.error}"
    f = level.figures
    failed = f", {level.failed} of {level.prompts} FAILED" if level.failed else ""
    return (
        f"  total {f.get('total_throughput', 0):,.1f} tok/s (output {f.get('output_throughput', 0):,.1f}, peak {f.get('max_output_tokens_per_s') or 0:,.0f}), "
        f"TTFT p50 {f.get('median_ttft_ms') or 0:,.0f} ms, ITL p50 {f.get('median_itl_ms') or 0:.1f} ms{failed}"
    )


def _new_events(path: Path, offset: int) -> list[str]:
    """Kinds of the events appended after `offset`; a line still being written is skipped."""
    try:
        text = path.read_bytes()[offset:].decode("utf-8", errors="replace")
    except OSError:
        return []
    kinds = []
    for line in text.split("\n")[:-1]:  # complete lines only
        try:
            kinds.append(json.loads(line)["event"])
        except (ValueError, KeyError, TypeError):
            continue
    return kinds


@contextlib.contextmanager
def served(args, profile):
    """`sm120kit serve PROFILE` in a process of its own for the length of the sweep: up
    when it generates, stopped (SIGTERM: the supervisor's clean stop) afterwards."""
    from sm120kit.serve.rundir import serve_root

    events = serve_root() / profile.name / "events.jsonl"
    seen = events.stat().st_size if events.exists() else 0
    argv = [sys.executable, "-m", "sm120kit", "serve", profile.name, "--quiet"]
    argv += [a for d in args.profile_dir or [] for a in ("--profile-dir", d)] + [
        a for kv in args.sets or [] for a in ("--set", kv)
    ]
    argv += ["--python", args.python] if args.python else []
    argv += ["--no-gpu-check"] if getattr(args, "no_gpu_check", False) else []
    print(f"starting the server: {' '.join(argv[3:])} (up to {profile.health.startup_timeout_s:g} s)", flush=True)
    # its preflight and progress lines are the user's to see; a session of its own, so that
    # Ctrl-C reaches only us and the server gets one SIGTERM (and drains) from the finally below
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + profile.health.startup_timeout_s + 60
        while True:
            kinds = _new_events(events, seen)
            if "ready" in kinds:
                break
            if proc.poll() is not None or "gave_up" in kinds or time.monotonic() > deadline:
                code = proc.poll()
                raise UserError(
                    f"the server for {profile.name} did not get ready"
                    + (f" (sm120kit serve exit code {code})" if code is not None else "")
                    + "; nothing was benchmarked",
                    f"see the lines above; sm120kit serve {profile.name} --check; the log is in {events.parent}",
                )
            time.sleep(0.2)
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            print(f"stopped the server (sm120kit serve exit code {proc.returncode})", flush=True)


def bench(args, profile, target) -> int:
    """Exit 0: every level ran and every request completed; 1: some level or request
    failed; 2: bad input or no server; 130: interrupted (finished levels are kept)."""
    try:
        levels = analysis.parse_levels(args.concurrency)
    except analysis.BadLevels as exc:
        raise UserError(
            f"--concurrency {args.concurrency!r}: {exc}",
            "give a comma-separated list, e.g. --concurrency 64,128,256,512",
        ) from None
    if args.serve and profile is None:
        raise UserError(
            "--serve starts a profile's server; with --url the server is yours", "sm120kit bench PROFILE --serve"
        )
    url = client.parse_url(args.url) if args.url else None
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: its benchmark client runs from there",
            "point sm120kit at the serving environment with --python EXE",
        )
    key_env = None
    if url:
        name, max_running, model = url.split("//")[-1].replace(":", "-"), None, None
    else:
        from sm120kit.serve.probe import probe_host

        url = f"http://{probe_host(profile.server.host)}:{profile.server.port}"
        name, max_running, model = profile.name, profile.engine.max_running_requests, profile.model.path
        key_env = profile.server.api_key_env
    api_key = client.api_key(key_env)
    sweep = client.Sweep(
        args.python or sys.executable,
        client.client_module(dist),
        url,
        args.input_len,
        args.output_len,
        args.prompts_per_level,
        tokenizer=args.tokenizer,
        model=args.model or None,
        api_key=api_key,
    )
    with served(args, profile) if args.serve else contextlib.nullcontext():
        client.check_reachable(url, api_key)
        directory = Path(args.out) if args.out else Path("sm120kit-bench") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "title": f"{name}, input {args.input_len} / output {args.output_len} tokens",
            "profile": profile.model_dump(mode="json", exclude={"name", "source"}) if profile else None,
            "profile_name": profile.name if profile else None,
            "url": url,
            "model": model,
            "client": sweep.module,
            "threshold": args.threshold,
            "command": sweep.argv(levels[0], directory / f"c{levels[0]}.jsonl"),
            "versions": _versions(target),
            "patches": _patch_status(target),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        meta["summary"] = {"url": url, "client": sweep.module, **{k: v for k, v in meta["versions"].items() if v}}
        print(
            f"sweeping {url} with {sweep.module} (sglang {dist.version}): concurrency {', '.join(map(str, levels))}; results in {directory}"
        )
        return _run_levels(sweep, levels, directory, meta, args.threshold, max_running)


def _run_levels(
    sweep: client.Sweep, levels: list[int], directory: Path, meta: dict, threshold: float, max_running: int | None
) -> int:
    done: list[analysis.Level] = []
    try:
        for i, concurrency in enumerate(levels, 1):
            bar = "#" * (i - 1) + "." * (len(levels) - i + 1)
            print(
                f"[{bar}] {i}/{len(levels)} concurrency {concurrency}: {sweep.prompts(concurrency)} prompts ...",
                flush=True,
            )
            level = client.run_level(sweep, concurrency, directory)
            done.append(level)
            print(_live_line(level), flush=True)
            results.write_run(directory, meta, done, None, finished=False)
    except KeyboardInterrupt:
        results.write_run(directory, meta, done, None, finished=False)
        print(f"interrupted: the {len(done)} finished level(s) are kept in {directory}", file=sys.stderr)
        return 130
    verdict = analysis.verdict(done, threshold, max_running)
    results.write_run(directory, meta, done, verdict, finished=True)
    results.write_tables(directory, meta, done, verdict)
    note = results.write_plot(directory, meta["title"], done)
    headers, rows = analysis.table_rows(done)
    print()
    print(report.table(headers, rows))
    print()
    for line in verdict.lines:
        print(line)
    print(f"\nresults: {directory}" + (f" ({note})" if note else ""))
    return 1 if any(lv.failed or not lv.figures for lv in done) else 0


def compare(before: str, after: str) -> int:
    doc_a, a = results.load_run(before)
    doc_b, b = results.load_run(after)
    headers, rows = analysis.compare_rows(a, b)
    print(f"before: {before}  ({doc_a.get('title', '')})\nafter:  {after}  ({doc_b.get('title', '')})\n")
    print(report.table(headers, rows))
    return 0
