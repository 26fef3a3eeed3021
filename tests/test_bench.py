"""`sm120kit bench`: the plateau verdict and tables on the field report's real figures,
and the sweep end to end: `sm120kit serve` runs the sglang stand-in, `sm120kit bench`
runs the benchmark-client stand-in (TEST FIXTURES: the real server needs GPUs, the real
client imports torch) from the serving environment's python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.standin import PROFILES, Served, make_env_python

from sm120kit.bench.analysis import DETAILS, BadLevels, Level, compare_rows, parse_levels, table_rows, verdict

# The seeds: before the autotune patch (32 .. 512) and after it (256 .. 1024), total tok/s.
BEFORE = {32: 438.0, 64: 757.0, 128: 806.0, 256: 879.87, 512: 912.70}
AFTER = {256: 1846.0, 512: 2800.0, 1024: 3740.0}


def levels(totals: dict[int, float]) -> list[Level]:
    return [
        Level(c, 3 * c, {"total_throughput": t, "output_throughput": t / 3, "completed": 3 * c})
        for c, t in totals.items()
    ]


@pytest.mark.parametrize("text, parsed", [("64,128,256", [64, 128, 256]), (" 512, 64 ,64", [64, 512]), ("1", [1])])
def test_levels_parse(text, parsed):
    assert parse_levels(text) == parsed


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        (" , ", "empty"),
        ("64,x", "'x' is not"),
        ("0", "'0' is not"),
        ("-8", "'-8' is not"),
        ("6.5", "'6.5' is not"),
    ],
)
def test_levels_refused(text, message):
    with pytest.raises(BadLevels, match=message):
        parse_levels(text)


def test_the_plateau_of_the_field_report():
    v = verdict(levels(BEFORE))
    assert v.plateau_from == 64 and v.best.concurrency == 512
    assert v.lines[0] == (
        "512 vs 256: +3.7% — throughput has plateaued near 912 tok/s from concurrency 64 on "
        "(each doubling gains under 10%); the limit is not concurrency"
    )
    assert v.lines[1] == "per doubling: 64 vs 32: +72.8%, 128 vs 64: +6.5%, 256 vs 128: +9.2%, 512 vs 256: +3.7%"


def test_after_the_patch_it_still_scales_and_queued_levels_are_flagged():
    v = verdict(levels(AFTER), max_running=1024)
    assert v.plateau_from is None
    assert v.lines[0] == "1024 vs 512: +33.6% — still scaling at 3,740 tok/s; a higher concurrency may give more"
    v = verdict(levels({**AFTER, 2048: 3790.0}), max_running=1024)
    assert (
        v.plateau_from == 1024
        and "levels 2048 exceed the server's max running requests (1024): the excess only queues" in v.lines
    )
    assert verdict(levels({256: 100.0, 1024: 121.0})).plateau_from is None  # +21% over two doublings is +10% each


def test_a_threshold_and_too_few_levels():
    assert verdict(levels(BEFORE), threshold=0.05).plateau_from == 256
    assert verdict(levels({64: 757.0})).lines == [
        "too few levels with figures to judge the scaling (two or more needed)"
    ]


def test_table_and_compare():
    headers, rows = table_rows(levels(BEFORE))
    assert headers[:2] == ["concurrency", "total tok/s"] and headers[-2:] == ["done", "failed"]
    assert (
        rows[-1][:2] == ["512", "912.7"] and rows[-1][-2:] == ["1536", "0"] and rows[0][4] == "-"
    )  # no peak figure: "-"
    headers, rows = compare_rows(levels(BEFORE), levels(AFTER))
    row = {r[0]: r for r in rows}
    assert row["512"][1:4] == ["912.7", "2,800.0", "3.07x"] and row["256"][3] == "2.10x"
    assert row["1024"][1:4] == ["-", "3,740.0", "-"] and row["32"][2:4] == ["-", "-"]


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("bench-env"), "0.5.23")


@pytest.fixture(scope="module")
def server(tmp_path_factory, env_python):
    """`sm120kit serve standin` on a free port, for the whole module."""
    served = Served(tmp_path_factory.mktemp("bench-serve"), env_python, {"load_s": 0.2}, [], ["--quiet"], {}).start()
    served.wait("ready")
    yield served
    served.signal()
    served.cleanup()


def bench_argv(server: Served, out: Path, *extra: str, port: int | None = None) -> list[str]:
    """`sm120kit bench standin` against the stand-in (or nothing, on `port`)."""
    port = server.port if port is None else port
    return [
        *(sys.executable, "-m", "sm120kit", "bench", "standin", "--python", str(server.python)),
        *("--profile-dir", str(PROFILES), "--set", f"server.port={port}", "--out", str(out), *extra),
    ]


def bench(server: Served, out: Path, plan: dict, *extra: str) -> subprocess.CompletedProcess:
    argv = bench_argv(server, out, "--wide", *extra)  # --wide: a level's error on one line, as asserted
    env = {**server.env, "SGLANG_STANDIN_BENCH": json.dumps(plan)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


def test_a_sweep_reports_what_the_client_wrote(server, tmp_path):
    out = tmp_path / "before"
    done = bench(server, out, {"total": {str(c): t for c, t in BEFORE.items()}}, "--concurrency", "32,64,128,256,512")
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads((out / "run.json").read_text())
    for level in run["levels"]:
        written = json.loads(
            (out / f"c{level['concurrency']}.jsonl").read_text().splitlines()[-1]
        )  # the client's own file
        assert level["figures"] == {k: v for k, v in written.items() if k not in DETAILS}  # the texts: sampled
        assert level["outputs"]["sampled"] == 64 and level["outputs"]["flagged"] == 0
        assert f"total {written['total_throughput']:,.1f} tok/s" in done.stdout
    assert run["finished"] and run["client"] == "sglang.benchmark.serving" and run["versions"]["sglang"] == "0.5.23"
    assert (
        run["command"][1:3] == ["-m", "sglang.benchmark.serving"]
        and "--dataset-name" in run["command"]
        and "random-ids" in run["command"]
    )
    assert {p["patch"] for p in run["patches"]} >= {"sglang-dsa-page-table-guard"}
    assert "throughput has plateaued near 912 tok/s from concurrency 64 on" in done.stdout
    csv_rows = (out / "results.csv").read_text().splitlines()
    assert csv_rows[0].startswith("concurrency,prompts,completed,failed,total_throughput") and csv_rows[-1].startswith(
        "512,1536,1536,0,912.7"
    )
    assert "| 512 | 912.7 |" in (out / "summary.md").read_text()
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib is in the test extra

    after = tmp_path / "after"
    assert (
        bench(
            server, after, {"total": {str(c): t for c, t in AFTER.items()}}, "--concurrency", "256,512,1024"
        ).returncode
        == 0
    )
    cmp = subprocess.run(
        [sys.executable, "-m", "sm120kit", "bench", "compare", str(out), str(after)],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in cmp.stdout.splitlines() if x.startswith("512 "))
    assert "912.7" in line and "2,800.0" in line and "3.07x" in line


def test_failed_requests_and_a_crashed_level_are_reported_and_the_sweep_goes_on(server, tmp_path):
    plan = {"total": {"64": 757, "128": 806, "256": 879.87}, "fail": {"128": 0.5}, "crash": [256]}
    done = bench(server, tmp_path / "r", plan, "--concurrency", "64,128,256")
    assert done.returncode == 1
    assert "concurrency 128: 192 of 384 requests failed" in done.stdout
    assert (
        "FAILED: the client wrote no result (exit code 1): "
        "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected; see c256.log" in done.stdout
    )
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert [lv["failed"] for lv in run["levels"]] == [0, 192, 768]


def test_what_a_crashed_client_said_is_quoted_without_its_escape_sequences(server, tmp_path):
    plan = {"total": {"64": 757}, "crash": [64], "crash_says": "\x1b]0;pwned\x07\x1b[31mBoom\x1b[0m\x07"}
    done = bench(server, tmp_path / "r", plan, "--concurrency", "64")
    assert "FAILED: the client wrote no result (exit code 1): Boom\\x07; see c64.log" in done.stdout, done.stdout
    assert "\x1b" not in done.stdout + done.stderr


def test_no_server_is_a_clear_error_before_any_level(server, tmp_path):
    argv = bench_argv(server, tmp_path / "r", port=1)
    done = subprocess.run(argv, capture_output=True, text=True, env=server.env)
    assert done.returncode == 2
    assert "no sglang server at http://127.0.0.1:1" in done.stderr and "nothing was benchmarked" in done.stderr
    assert not (tmp_path / "r").exists()


def test_ctrl_c_keeps_the_finished_levels(server, tmp_path):
    out = tmp_path / "r"
    argv = bench_argv(server, out, "--concurrency", "32,64,128")
    env = {
        **server.env,
        "SGLANG_STANDIN_BENCH": json.dumps({"total": {"32": 438, "64": 757, "128": 806}, "sleep_s": 3.0}),
    }
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    end = time.monotonic() + 60
    while time.monotonic() < end and not (
        (out / "run.json").exists() and json.loads((out / "run.json").read_text())["levels"]
    ):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    run = json.loads((out / "run.json").read_text())
    assert [lv["concurrency"] for lv in run["levels"]] == [32] and not run["finished"]
    assert "interrupted: the 1 finished level(s) are kept in" in err


def test_compare_needs_results_directories(tmp_path, cli):
    code, _, err = cli("bench", "compare", tmp_path, tmp_path / "nope")
    assert code == 2 and "is not a results directory (no run.json)" in err


def results(tmp_path: Path) -> list[Path]:
    """Two results directories, before and after, as `sm120kit bench` writes their run.json."""
    dirs = []
    for name, totals in (("before", BEFORE), ("after", AFTER)):
        levels = [{"concurrency": c, "prompts": 3 * c, "figures": {"total_throughput": t}} for c, t in totals.items()]
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"title": name, "levels": levels}))
        dirs.append(tmp_path / name)
    return dirs


def test_compare_is_a_verb_with_its_own_options_help_and_exit_codes(tmp_path, cli, capsys):
    """Before, `compare` was the first word of bench's profile: `bench compare A B --concurrency 5`
    compared and ignored the option, and `bench compare --help` was bench's help. Now compare
    is a subcommand: its options are its own, and a sweep's is refused with compare's usage."""
    before, after = results(tmp_path)
    code, out, err = cli("bench", "compare", before, after)
    assert code == 0 and "912" in out and err == ""
    with pytest.raises(SystemExit) as refused:
        cli("bench", "compare", before, after, "--concurrency", "5")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "usage: sm120kit bench compare " in err and "--concurrency 5" in err
    with pytest.raises(SystemExit) as helped:
        cli("bench", "compare", "--help")
    out = capsys.readouterr().out
    assert helped.value.code == 0 and out.startswith("usage: sm120kit bench compare") and "--concurrency" not in out
    code, out, err = cli("bench", "compare", before, after, before)
    assert code == 2 and "two results directories, or one search directory" in err


def test_the_spelling_from_before_the_verb_still_compares_and_says_it_is_deprecated(tmp_path, cli):
    before, after = results(tmp_path)
    code, out, err = cli("bench", "--json", "compare", before, after)
    assert code == 0 and json.loads(out) == json.loads(cli("bench", "compare", before, after, "--json")[1])
    assert "is deprecated" in err and "sm120kit bench compare DIR..." in " ".join(err.split())


@pytest.mark.parametrize(
    "version, module",
    [
        ("0.5.9", "sglang.bench_serving"),
        ("0.5.14", "sglang.bench_serving"),
        ("0.5.15", "sglang.benchmark.serving"),
        ("0.5.23", "sglang.benchmark.serving"),
    ],
)
def test_the_client_module_of_each_release(site, version, module):
    from support.sites import install

    from sm120kit.bench.client import client_module
    from sm120kit.target import resolve_target

    install(site, version, flashinfer=False)
    assert client_module(resolve_target(site=str(site)).find("sglang")) == module


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch):
    from sm120kit.bench.results import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert (
        write_plot(tmp_path, "t", levels(BEFORE))
        == "plot.png skipped: matplotlib is not installed (pip install 'sm120kit[plot]')"
    )
    assert not (tmp_path / "plot.png").exists()


def test_the_standin_server_streams_generate_at_its_capacity(tmp_path):
    """The sglang stand-in's POST /generate, parsed the way sglang's client parses it
    (benchmark/serving.py: `data: ` lines, cumulative text, meta_info.completion_tokens),
    and its token-rate cap: 4 requests at 20 tok/s each on a 40 tok/s server take twice
    as long as one alone."""
    import http.client
    import threading

    from support.standin import STANDIN, free_port

    port = free_port()
    env = {
        **os.environ,
        "SGLANG_STANDIN": json.dumps({"load_s": 0.1, "warmup_s": 0.1, "tokens_per_s": 40, "request_tokens_per_s": 20}),
    }
    server = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(port)], env=env, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def generate(n: int) -> tuple[list[dict], float]:
        began = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/generate",
            json.dumps({"text": "w1 w2 w3", "sampling_params": {"max_new_tokens": n}, "stream": True}),
        )
        response = conn.getresponse()
        body = response.read().decode()
        assert response.status == 200, response.status  # 503 while the stand-in starts
        chunks = [line.removeprefix("data: ") for line in body.splitlines() if line.strip()]
        assert chunks[-1] == "[DONE]"
        return [json.loads(c) for c in chunks[:-1]], time.monotonic() - began

    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                chunks, alone = generate(10)
                break
            except (OSError, http.client.HTTPException, AssertionError):
                time.sleep(0.1)
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 11))
        assert (
            chunks[-1]["text"].split() == [f"w{k}" for k in range(1, 11)]
            and chunks[-1]["meta_info"]["prompt_tokens"] == 3
        )
        took = []
        threads = [threading.Thread(target=lambda: took.append(generate(10)[1])) for _ in range(4)]
        began = time.monotonic()  # the four together, however the threads happen to overlap
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = time.monotonic() - began
        # 10 tokens at 20 tok/s alone (the first at once: >= 0.45 s); 40 at 40 tok/s in all (>= 0.975 s)
        assert 0.4 <= alone < 3, alone
        assert len(took) == 4 and together >= 0.9, (took, together)
    finally:
        server.terminate()
        server.wait()


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "http://h:abc", "http://127.0.0.1", "http://127.0.0.1:30000/v1"])
def test_a_url_that_is_not_host_and_port(cli, url):
    code, _, err = cli("bench", "--url", url)
    assert code == 2 and "is not http://HOST:PORT" in err


def test_a_level_rerun_into_the_same_directory_never_reports_the_old_line(server, tmp_path):
    out = tmp_path / "r"
    assert bench(server, out, {"total": {"64": 757}}, "--concurrency", "64").returncode == 0
    done = bench(server, out, {"total": {"64": 757}, "crash": [64]}, "--concurrency", "64")
    assert done.returncode == 1 and "FAILED: the client wrote no result" in done.stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--threshold", "inf"),
        ("--threshold", "nan"),
        ("--threshold", "0"),
        ("--threshold", "-0.1"),
        ("--threshold", "2"),
        ("--input-len", "0"),
        ("--input-len", "-5"),
        ("--input-len", "1000000000"),
        ("--output-len", "0"),
        ("--output-len", "-1"),
        ("--prompts-per-level", "0"),
        ("--prompts-per-level", "nan"),
        ("--prompts-per-level", "inf"),
        ("--prompts-per-level", "-1"),
        ("--concurrency", "64,100000000"),
    ],
)
def test_numbers_out_of_range_are_refused_before_anything_runs(cli, option, value):
    code, _, err = cli("bench", "--url", "http://127.0.0.1:9", option, value)
    assert code == 2 and "Traceback" not in err
    assert f"{option} {value}" in err or f"{option} {value!r}" in err, err
    assert "allowed" in err or "is not" in err, err


def test_a_client_key_that_would_break_the_header_is_refused_without_telling_it(monkeypatch):
    from sm120kit import endpoint
    from sm120kit.errors import UserError

    secret = "sk-live-0123456789abcdef"
    monkeypatch.setenv("BENCH_KEY", secret + "\r")
    with pytest.raises(UserError) as info:
        endpoint.api_key("BENCH_KEY")
    assert "$BENCH_KEY ends with a carriage return" in str(info.value) and secret not in str(info.value)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("API_KEY", secret + "\n")
    with pytest.raises(UserError, match="API_KEY ends with a newline"):
        endpoint.api_key(None)
