"""Issue 25, items 19-22: the holes a wrong model got through the smoke and the search.

19  a model that never answers one kind of task (3 of 32) passed at 29/32: every kind must
    pass on its own, and the failure names the kind;
20  nothing was streamed and the sweep never read the text it timed: a configuration that
    garbles only streamed output passed the smoke and won the search; the smoke streams one
    task of each kind and compares it with the answer sent whole, and the sweep reads a
    sample of its own outputs through the smoke's garbage detectors;
21  without --baseline, made-up logprobs (a constant) passed: the greedy tokens must carry
    the top logprob of their position, and the prompt logprobs must vary;
22  a variant whose levels all gave no figures was recorded `done` and skipped by a rerun:
    it is `failed`, with why, and a rerun runs it again.

Against the sglang stand-in (TEST FIXTURE, tests/fixtures/sglang_standin.py: its request
side in this process, or served by `sm120kit serve`) with its faults stream_garbage,
never_answers and made_up_logprobs, and the benchmark-client stand-in, which streams its
requests and writes their texts with --output-details, as sglang's own client does."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.http_server import http_served
from support.standin import PROFILES, STANDIN, Served, make_env_python

from sm120kit.bench import analysis, search
from sm120kit.bench.analysis import Level
from sm120kit.exit_codes import ExitCode
from sm120kit.quality import logprobs, tasks
from sm120kit.quality.checks import answers_check, kind_needed
from sm120kit.quality.client import Reply, assembled
from sm120kit.quality.command import smoke
from sm120kit.quality.options import SmokeOptions

# -- the stand-in's request side, in this process ------------------------------------------


@pytest.fixture(scope="module")
def standin_module():
    spec = importlib.util.spec_from_file_location("sglang_standin_first_day", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.State.starting = False
    return module


@pytest.fixture
def serve_inproc(standin_module, monkeypatch):
    """serve_inproc(**args) -> (url, FAULTS): a stand-in HTTP server on a free port."""
    monkeypatch.setattr(standin_module, "FAULTS", {})

    with contextlib.ExitStack() as servers:

        def start(**extra) -> tuple[str, dict]:
            args = {"api_key": None, "served_name": "glm-5", "model_path": "standin/GLM-5-NVFP4", "tp": 1, "port": 0}
            server = ThreadingHTTPServer(("127.0.0.1", 0), standin_module.handler({**args, **extra}))
            return servers.enter_context(http_served(server)), standin_module.FAULTS

        yield start


def check(report, name: str):
    return next(c for c in report.checks if str(c.name) == name)


def test_a_healthy_server_passes_streamed_either_way_and_its_logprobs_are_a_models(serve_inproc):
    """The default stream (each event the text so far) and --incremental-streaming-output
    (each event its own piece, as /server_info says) both assemble to the answer sent whole."""
    for incremental in (False, True):
        url, _ = serve_inproc(incremental=incremental)
        report = smoke(SmokeOptions(url=url))
        assert report.passed, report.failures
        streamed = check(report, "streamed")
        assert streamed.data == {"streamed": 9, "compared": 9, "same": 9}  # one task of each kind
        logprob = check(report, "logprobs")
        assert logprob.data["greedy_checked"] >= 2 and logprob.data["spread"] > logprobs.SPREAD_MIN
        assert logprob.data["prompt_tops_checked"] == logprob.data["tokens"] - 1 and logprob.data["problems"] == 0


# -- 19: every kind on its own ---------------------------------------------------------------


@pytest.mark.parametrize("kind", [str(k) for k in tasks.Kind])
def test_a_model_that_never_answers_one_kind_fails_and_the_kind_is_named(serve_inproc, kind):
    """On HEAD a kind of 3 tasks (copy, count, next, capitals) never answered passed: 29/32
    is over 90 %."""
    url, faults = serve_inproc()
    faults["never_answers"] = kind
    report = smoke(SmokeOptions(url=url))
    assert not report.passed and report.exit_code is ExitCode.FINDINGS
    answers = check(report, "answers")
    assert not answers.passed and answers.data["failed_kinds"] == [kind]
    of = answers.data["kinds"][kind]["of"]
    said = f"every kind must pass on its own: {kind} 0/{of} right, {kind_needed(of, 0.9)} needed"
    assert said in answers.detail and said in report.failures[0]
    assert answers.examples[0].split()[0].endswith(f"-{kind}")  # the failed kind's answer is shown first
    assert check(report, "under-load").data["failed_kinds"] == [kind]  # the burst is judged by kind too


def test_one_slip_in_a_kind_passes_and_two_do_not():
    """A kind of 3-4 tasks needs the smoke's rate of them right, rounded down: one may slip,
    as one may in the whole; a kind with no right answer never passes."""
    assert [kind_needed(n, 0.9) for n in (1, 3, 4, 8)] == [1, 2, 3, 7]
    work = tasks.generate(0)
    right = [Reply(text=f" {t.answer}") for t in work]
    capitals = [i for i, t in enumerate(work) if t.kind is tasks.Kind.CAPITALS]
    one = [Reply(text=" I cannot say.") if i == capitals[0] else r for i, r in enumerate(right)]
    assert answers_check(work, one, SmokeOptions(url="http://127.0.0.1:1")).passed
    two = [Reply(text=" I cannot say.") if i in capitals[:2] else r for i, r in enumerate(right)]
    failed = answers_check(work, two, SmokeOptions(url="http://127.0.0.1:1"))
    assert failed.data["right"] == 30 and not failed.passed and "capitals 1/3 right, 2 needed" in failed.detail


# -- 20: streamed output, in the smoke and in the sweep ------------------------------------


@pytest.mark.parametrize("mode, detector", [("bang", "bang"), ("replacement", "replacement"), ("repeat", "repeat")])
def test_a_server_that_garbles_only_streamed_output_fails_the_smoke(serve_inproc, mode, detector):
    url, faults = serve_inproc()
    faults["stream_garbage"] = mode
    report = smoke(SmokeOptions(url=url))
    assert not report.passed and report.summary().startswith("smoke FAILED: streamed (1 of 5 checks")
    streamed = check(report, "streamed")
    assert streamed.detail == "9 of 9 streamed answers differ from the same task sent whole"
    assert (
        streamed.examples[0].startswith("t00-add: streamed ")
        and f"({detector}), sent whole ' " in (streamed.examples[0])
    )
    assert check(report, "answers").passed and check(report, "garbage").passed  # sent whole, it answers right


def test_a_stream_is_assembled_as_the_server_says_it_streams():
    assert assembled([" 4", " 42", " 42"], False) == " 42"  # each event: the text so far (sglang's default)
    assert assembled([" 4", "2", ""], True) == " 42"  # --incremental-streaming-output: each its own piece
    assert assembled([" 4", " 42"], None) == " 42" and assembled([" 4", "2"], None) == " 42"  # judged from them
    assert assembled([], None) == ""


def test_the_sweeps_outputs_are_read_and_a_garbled_level_is_no_result():
    texts = ["w1 w2 w3"] * 60 + ["- - - - - - - -"] * 4
    healthy = analysis.sample_outputs({"generated_texts": texts, "errors": [""] * 64})
    assert healthy["sampled"] == 64 and healthy["flagged"] == 4  # a healthy model's odd loop: not garbage
    assert not Level(4, 64, {"total_throughput": 1.0, "completed": 64}, outputs=healthy).garbled
    bang = analysis.sample_outputs({"generated_texts": ["!!!!!!!!"] * 200 + [""] * 8, "errors": [""] * 200 + ["x"] * 8})
    assert bang["sampled"] == analysis.SAMPLED_OUTPUTS and bang["detectors"]["bang"] == analysis.SAMPLED_OUTPUTS
    level = Level(4, 208, {"total_throughput": 9.0, "completed": 200}, outputs=bang)
    assert level.garbled and level.garbage.startswith("bang in 64 of 64 sampled outputs (e.g. bang: '!!!!!!!!')")
    assert analysis.level_from_json(level.as_json()).garbled  # kept in run.json / variant.json
    ok = Level(8, 64, {"total_throughput": 10.0, "completed": 64}, outputs=healthy)
    verdict = analysis.verdict([level, ok])
    assert verdict.lines[0].startswith("concurrency 4: its outputs are GARBAGE: bang in 64 of 64 sampled outputs")
    assert analysis.sample_outputs({"completed": 3}) is None  # a client that wrote no texts: nothing sampled
    assert search._swept_outcome([level, ok])[0] is search.Outcome.EXCLUDED


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("first-day-env"), "0.5.23")


FAST = {"load_s": 0.2, "warmup_s": 0.1, "shards": 2}


def search_argv(s: Served, out: Path, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "sm120kit", "bench", "standin", "--serve", "--python", str(s.python)),
        *("--profile-dir", str(PROFILES), "--no-gpu-check", "--set", f"server.port={s.port}"),
        *("--set", "health.max_restarts=0", "--out", str(out), "--wide"),
        *("--concurrency", "4,8", "--input-len", "16", "--output-len", "16", "--prompts-per-level", "1"),
        *("--vary", "engine.max_running_requests=96"),
        *extra,
    ]


def run(argv: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def variant(out: Path, name: str) -> dict:
    return json.loads((out / name / "variant.json").read_text())


FAST_BUT_GARBLED = {
    **FAST,
    "tokens_per_s": 1500,
    "by_args": [{"args": "--max-running-requests 96", "faults": {"tokens_per_s": 6000, "stream_garbage": "bang"}}],
}


def test_a_configuration_that_garbles_streamed_output_does_not_win_the_search(env_python, tmp_path):
    """On HEAD, max_running_requests=96 (4x faster, its streamed output "!!!!") passed the
    smoke and won: `to adopt max_running_requests=96`. Now its smoke fails (streamed); with
    --no-smoke its sweep's own outputs exclude it."""
    s = Served(tmp_path / "own", env_python, FAST_BUT_GARBLED, [], [], {})
    try:
        for extra, by in (((), "the smoke"), (("--no-smoke",), "its sweep's outputs")):
            out = tmp_path / f"search{len(extra)}"
            done = run(search_argv(s, out, *extra), s.env)
            text = done.stdout + done.stderr
            assert done.returncode == 1, text
            assert variant(out, "as-written")["status"] == "done"
            garbled = variant(out, "max_running_requests=96")
            assert garbled["status"] == "excluded", garbled
            assert f"excluded by {by}: max_running_requests=96" in done.stdout
            assert (
                "to adopt max_running_requests=96" not in done.stdout
                and "overall (each variant at its best level): as-written" in text
            )
            if extra:
                assert garbled["why"].startswith("its sweep's outputs are garbage at concurrency 4, concurrency 8")
                assert garbled["diagnosis"][0].startswith("concurrency 4: bang in 32 of 32 sampled outputs")
                assert garbled["levels"][0]["outputs"]["flagged"] == 32  # the figures kept, marked
                assert variant(out, "as-written")["levels"][0]["outputs"] == {
                    "sampled": 32,
                    "flagged": 0,
                    "detectors": dict.fromkeys(["empty", "repeat", "bang", "replacement", "stops-at-once"], 0),
                    "example": "",
                }
            else:
                assert garbled["smoke"]["failures"][0].startswith("streamed: 9 of 9 streamed answers differ")
                assert not garbled["levels"]  # excluded by the smoke: not swept
        assert not s.ours()
    finally:
        s.cleanup()


def test_a_plain_sweep_of_a_server_that_garbles_streams_is_marked_and_exits_1(env_python, tmp_path):
    s = Served(tmp_path / "own", env_python, {**FAST, "stream_garbage": "repeat"}, [], [], {})
    out = tmp_path / "r"
    argv = [
        *(sys.executable, "-m", "sm120kit", "bench", "standin", "--serve", "--python", str(env_python)),
        *("--profile-dir", str(PROFILES), "--no-gpu-check", "--set", f"server.port={s.port}", "--out", str(out)),
        *("--concurrency", "4", "--input-len", "16", "--output-len", "8", "--wide", "--no-smoke"),
    ]
    try:
        done = run(argv, s.env)
    finally:
        s.cleanup()
    assert done.returncode == 1, done.stdout + done.stderr  # on HEAD: 0, the figures of garbage taken as a result
    assert "its outputs are GARBAGE: repeat in 32 of 32 sampled outputs" in done.stdout
    doc = json.loads((out / "run.json").read_text())
    assert doc["levels"][0]["outputs"]["detectors"]["repeat"] == 32
    assert "generated_texts" not in doc["levels"][0]["figures"]  # in c4.jsonl, not in every run.json
    assert "generated_texts" in json.loads((out / "c4.jsonl").read_text())
    assert "--output-details" in doc["command"]
    assert "concurrency 4: its outputs are GARBAGE" in (out / "summary.md").read_text()


# -- 21: logprobs that are a model's -----------------------------------------------------------


@pytest.mark.parametrize(
    "mode, said",
    [
        ("constant", "the 83 prompt logprobs hardly vary (all within 0.000 nats"),
        ("unranked", "below its position's top"),
    ],
)
def test_made_up_logprobs_fail_without_a_baseline(serve_inproc, mode, said):
    url, faults = serve_inproc()
    faults["made_up_logprobs"] = mode
    report = smoke(SmokeOptions(url=url))
    assert not report.passed and report.summary().startswith("smoke FAILED: logprobs (1 of 5 checks")
    found = check(report, "logprobs")
    assert said in found.detail and found.data["problems"] > 0, found.detail
    assert "finite and <= 0" in found.detail  # what HEAD checked, and all it checked


def meta(prompt: list, prompt_tops: list, outputs: list, output_tops: list) -> dict:
    """meta_info as sglang 0.5.23 returns it (tokenizer_manager.add_logprob_to_meta_info)."""
    return {
        "input_token_logprobs": prompt,
        "input_top_logprobs": prompt_tops,
        "output_token_logprobs": outputs,
        "output_top_logprobs": output_tops,
        "output_token_logprobs_length": len(outputs),
    }


def test_the_logprob_rules_on_sglangs_shapes():
    prompt = [[None, 11, None], [-4.0, 12, None], [-0.2, 13, None]]
    prompt_tops = [None, [[-0.5, 99, None], [-4.0, 12, None]], [[-0.2, 13, None], [-3.0, 98, None]]]
    outputs = [[-0.1, 7, None], [-0.3, 2, None]]
    output_tops = [[[-0.1, 7, None], [-2.5, 8, None]], [[-0.3, 2, None], [None, 9, None]]]  # null: -inf (orjson)
    values = [None, -4.0, -0.2]
    assert logprobs.check(meta(prompt, prompt_tops, outputs, output_tops), values)[0] == []
    # a greedy token below its position's top
    low = [[-0.9, 7, None], outputs[1]]
    assert (
        "below its position's top -0.1000 (id 7)"
        in logprobs.check(meta(prompt, prompt_tops, low, output_tops), values)[0][0]
    )
    # a prompt token more likely than its position's top; a top list over probability 1
    high = [prompt[0], [-0.1, 12, None], prompt[2]]
    found = logprobs.check(meta(high, prompt_tops, outputs, output_tops), [None, -0.1, -0.2])[0]
    assert any("above its position's top -0.5000" in p for p in found)
    assert any("in its position's top list" in p for p in found)
    heavy = [[[-0.1, 7, None], [-0.2, 8, None]], output_tops[1]]
    assert (
        "add up to probability 1.724, over 1" in logprobs.check(meta(prompt, prompt_tops, outputs, heavy), values)[0][0]
    )
    # no top lists for the output: the greedy rule cannot be checked, and that is said
    missing = {k: v for k, v in meta(prompt, prompt_tops, outputs, output_tops).items() if k != "output_top_logprobs"}
    assert "did not come back one per output token" in logprobs.check(missing, values)[0][0]
    # a constant
    flat = [[None, 11, None], [-1.0, 12, None], [-1.0, 13, None]]
    assert "hardly vary" in logprobs.check(meta(flat, prompt_tops, outputs, output_tops), [None, -1.0, -1.0])[0][0]


def test_the_smoke_asks_sglang_for_the_top_logprobs(serve_inproc, standin_module, monkeypatch):
    """The logprob request: return_logprob, logprob_start_len 0, top_logprobs_num, and
    greedy tokens to check (GenerateReqInput's fields, sglang 0.5.9-0.5.23)."""
    bodies = []
    real = standin_module.handler

    def recording(args):
        cls = real(args)

        class Recorded(cls):
            def logprobs(self, body, ids, out_ids):
                bodies.append(body)
                return super().logprobs(body, ids, out_ids)

        return Recorded

    monkeypatch.setattr(standin_module, "handler", recording)
    url, _ = serve_inproc()
    smoke(SmokeOptions(url=url))
    [body] = bodies
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    assert body["top_logprobs_num"] == logprobs.TOP_LOGPROBS and body["sampling_params"]["max_new_tokens"] > 1


# -- 22: a sweep without figures is no result ---------------------------------------------------


def test_a_variant_whose_levels_gave_no_figures_failed_and_a_rerun_runs_it_again(env_python, tmp_path):
    """On HEAD both variants were `done` (exit 1 only for the levels) and the rerun said
    "already done in this directory, not run again"."""
    s = Served(tmp_path / "own", env_python, {**FAST, "tokens_per_s": 1500}, [], [], {})
    out = tmp_path / "search"
    argv = search_argv(s, out, "--no-smoke")
    broken = {**s.env, "SGLANG_STANDIN_BENCH": json.dumps({"crash": [4, 8]})}  # the client dies at every level
    try:
        done = run(argv, broken)
        assert done.returncode == 1, done.stdout + done.stderr
        for name in ("as-written", "max_running_requests=96"):
            failed = variant(out, name)
            assert failed["status"] == "failed", failed
            assert failed["why"].startswith("no figures at concurrency 4, concurrency 8: a level without figures")
            assert "the client wrote no result (exit code 1)" in failed["diagnosis"][0]
        assert "failed: as-written: no figures at concurrency 4, concurrency 8" in done.stdout
        assert json.loads((out / "search.json").read_text())["status"]["as-written"] == "failed"

        again = run(argv, s.env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already" not in again.stdout and again.stdout.count("starting the server") == 2
        assert {variant(out, n)["status"] for n in ("as-written", "max_running_requests=96")} == {"done"}
        assert not s.ours()
    finally:
        s.cleanup()


def test_a_done_record_without_figures_from_an_earlier_sm120kit_is_run_again(tmp_path):
    from sm120kit.bench.command import BenchOptions
    from sm120kit.bench.variants import Plan, Planned, Variant, VariantStatus
    from sm120kit.profiles.loader import load_profile

    profile = load_profile("standin", [str(PROFILES)])
    plan = Plan("standin", "--vary", [Planned(Variant(n), VariantStatus.RUNNABLE, "", profile) for n in ("a", "b")])
    settings = search.settings_of(BenchOptions(levels=[4]), plan, [])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "search.json").write_text(json.dumps({"settings": settings}))
    empty = Level(4, 32, None, "the client wrote no result (exit code 1); see c4.log")
    swept = Level(4, 32, {"total_throughput": 100.0, "completed": 32})
    for name, level in (("a", empty), ("b", swept)):
        record = search.VariantResult(name, [], search.Outcome.DONE, levels=[level])
        (tmp_path / name / "variant.json").write_text(json.dumps(record.as_json()))
    assert list(search.check_resumable(tmp_path, settings, plan)) == ["b"]
    assert search._swept_outcome([empty, swept])[0] is search.Outcome.FAILED
    assert search._swept_outcome([swept]) == (search.Outcome.DONE, "", [])
