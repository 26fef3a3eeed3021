"""The SM12x resolution matrix: what each sglang release's own resolution picked (recorded by
scripts/resolution_matrix.py with the real releases beside a real torch), judged here against
the kernel table; and `profile check` end to end on the real release's flag schema with the
recorded resolutions replayed in place of the probe (the probe itself is tested in
tests/test_resolution_probe.py): each refusal class fires before anything starts, its way out
resolves clean, the shipped profiles get the recorded verdict, and off SM12x nothing runs."""

from __future__ import annotations

import pytest
import resolution_matrix as matrix
from support.sites import install

from sm120kit.catalogue.kernels import read_table
from sm120kit.resolution import run

DOC = matrix.read_recording()
TABLE = read_table()
RELEASES = sorted(DOC["releases"], key=matrix._v)


def cell(release, model, capability, attention=None, kv="auto"):
    found = [
        c
        for c in DOC["cells"]
        if (c["release"], c["model"], c["capability"], c["attention"], c["kv"])
        == (release, model, capability, attention, kv)
    ]
    if not found:
        pytest.fail(f"no cell {release} {model} {capability} {attention} {kv}: run scripts/resolution_matrix.py record")
    return found[0]


def verdict(c):
    return matrix.verdict(c, DOC["releases"][c["release"]]["pins"], TABLE)


def test_the_recording_covers_the_releases_and_families():
    assert {"0.5.12.post1", "0.5.16", "0.5.17", "0.5.23"} <= set(RELEASES)
    models = {c["model"] for c in DOC["cells"]}
    assert {"glm5-nvfp4", "glm5next", "deepseek-v3-fp8", "kimi-k2-int4", "qwen3-next", "gpt-oss"} <= models
    assert all(c["release"] in DOC["releases"] for c in DOC["cells"])


def test_the_docs_page_is_the_recording_judged():
    assert matrix.PAGE.read_text() == matrix.render_page(), "run python scripts/resolution_matrix.py render"


@pytest.mark.parametrize("capability", ["12.0", "12.1"])
def test_dsa_fp8_before_the_sm12_branch_has_no_build(capability):
    """0.5.9-0.5.16: every DSA backend sglang resolves for GLM-5 is SM90/SM100-only."""
    c = cell("0.5.16", "glm5-nvfp4", capability, "nsa", "fp8_e4m3")
    assert c["ok"] and "dsa-trtllm-sparse-mla" in verdict(c), verdict(c)


def test_the_sm12_branch_of_0_5_17_runs_flashinfer_sparse_mla():
    c = cell("0.5.17", "glm5-nvfp4", "12.0", "dsa", "fp8_e4m3")
    assert c["record"]["dsa_decode_backend"] == "flashinfer_sparse_mla"
    # No DSA kernel is refused; the MoE runner is: the cell gives no --quantization, and an
    # NVFP4 checkpoint's `auto` runner is TRT-LLM's (the shipped profiles say modelopt_fp4).
    assert verdict(c) == "no-build: moe-auto-nvfp4"


def test_bf16_dsa_on_0_5_23_decodes_on_trtllm():
    c = cell("0.5.23", "glm5-nvfp4", "12.0", "dsa", "bf16")
    assert c["record"]["dsa_decode_backend"] == "trtllm"
    assert "dsa-trtllm-sparse-mla" in verdict(c)


@pytest.mark.parametrize("capability", ["12.0", "12.1"])
def test_glm_5_3_flash_default_launch_has_no_build(capability):
    c = cell("0.5.23", "glm5next", capability)
    assert c["record"]["dsa_decode_backend"] == c["record"]["dsa_prefill_backend"] == "trtllm"
    assert "dsa-trtllm-sparse-mla" in verdict(c) and "dsa-kpool-tail-trtllm" in verdict(c)


# -- profile check, replayed ----------------------------------------------------------------


@pytest.fixture
def replayed(monkeypatch):
    """run.resolve answered from the recording; a launch it lacks is a miss the test reports."""
    index = {
        (x["release"], x["capability"], tuple(matrix.normalized(x["flags"]))): x["answer"]
        for x in DOC.get("launches", [])
    }
    misses = []

    def replay(python, argvs, env, node, sglang, *args, **kwargs):
        answers = []
        for argv in argvs:
            key = (sglang, node.capability, tuple(matrix.normalized(run.flags_of(argv))))
            if key in index:
                answers.append(run._from_json(index[key]))
            else:
                misses.append(key)
                answers.append(run.Resolution(False, stage="probe", error="not in the recording"))
        return answers

    monkeypatch.setattr(run, "resolve", replay)
    return misses


def _site_with_torch(site, release):
    """The real release, and a torch as far as the kit looks (its dist-info): the resolution
    is replayed, so nothing imports it."""
    install(site, release)
    info = site / "torch-2.11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    return site


def _check(cli, site, profile, sets, capability, *extra):
    argv = ["profile", "check", profile, "--site", site, "--capability", capability, "--no-patch-check"]  # unpatched
    return cli(*argv, *[w for s in sets for w in ("--set", s.replace("{models}", str(matrix.MODELS)))], *extra)


# Replayed end to end: every refusal class, and the shipped profiles on the first and last
# release recorded and on 0.5.17 (the first with an SM12 DSA branch); the rest of the
# recording is judged cell by cell above.
SAMPLED = {RELEASES[0], "0.5.17", RELEASES[-1]} if RELEASES else set()
JUDGED = [j for j in DOC.get("judged", []) if j["what"] != "profile" or j["release"] in SAMPLED]


IDS = [f"{j['what']}-{j['profile']}-{j['release']}-{j['capability']}" for j in JUDGED]


@pytest.mark.parametrize("judged", JUDGED, ids=IDS)
def test_profile_check_says_what_the_recording_says(cli, site, replayed, judged):
    _site_with_torch(site, judged["release"])
    code, out, err = _check(cli, site, judged["profile"], judged["sets"], judged["capability"])
    assert not replayed, f"not in the recording (run scripts/resolution_matrix.py record): {replayed}"
    if judged["said"] == "clean":
        assert code == 0, err
        assert f"resolved by sglang {judged['release']}'s own code on capability {judged['capability']}" in out
        return
    assert code == 2 and "Traceback" not in err
    assert judged["said"].replace("{models}", str(matrix.MODELS)).splitlines()[0] in err
    if judged["way_out"]:
        sets = [*judged["sets"], *judged["way_out"]]
        code, out, err = _check(cli, site, judged["profile"], sets, judged["capability"])
        assert not replayed, replayed
        assert code == 0, err
        assert "resolved by sglang" in out


TRIALS_RECORDED = {j["what"] for j in JUDGED if j["what"] != "profile"}


SERVED = {"dsa-native-fp8"}  # the trial that shows 0.5.17's SM12 DSA branch serving GLM-5: clean


def test_every_refusal_class_was_recorded_and_refused():
    names = {t[0] for t in matrix.TRIALS}
    assert names <= TRIALS_RECORDED, names - TRIALS_RECORDED
    for j in JUDGED:
        if j["what"] != "profile":
            assert (j["said"] == "clean") == (j["what"] in SERVED), j


def test_off_sm12x_nothing_is_resolved_or_judged(cli, site, replayed, monkeypatch):
    _site_with_torch(site, "0.5.23")
    calls = []
    monkeypatch.setattr(run, "resolve", lambda *a, **k: calls.append(a) or [])
    sets = ['node.compute_capability="9.0"', "engine.attention_backend=fa3", f"model.path={matrix.MODELS}/glm46-fp8"]
    argv = ["profile", "check", "glm46-fp8", "--site", site, "--no-patch-check"]  # the site is unpatched
    code, out, err = cli(*argv, *[w for s in sets for w in ("--set", s)])
    assert code == 0, err
    assert not calls and "what will run" not in out


# -- what cannot be resolved: said, never a traceback -------------------------------------


def _answering(monkeypatch, answer):
    calls = []

    def fake(python, argvs, *args, **kwargs):
        calls.append(argvs)
        return [answer for _ in argvs]

    monkeypatch.setattr(run, "resolve", fake)
    return calls


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (run.Resolution(False, stage="timeout", error="no answer within 120 s"), "timeout: no answer within 120 s"),
        (run.Resolution(False, stage="probe", error="the probe gave no answer (Segmentation fault)"), "Segmentation"),
        (run.Resolution(False, stage="import", error="ModuleNotFoundError: No module named 'msgspec'"), "msgspec"),
    ],
)
def test_a_resolution_that_cannot_run_is_a_warning_and_the_flags_are_judged(cli, site, monkeypatch, answer, says):
    _site_with_torch(site, "0.5.23")
    calls = _answering(monkeypatch, answer)
    code, out, err = _check(cli, site, "glm46-fp8", ["model.path={models}/glm46-fp8"], "12.0")
    assert code == 0 and calls and "Traceback" not in err
    assert "sglang's own resolution could not run" in err and says in err
    assert "what will run, judged from the flags on capability 12.0" in out


def test_what_sglang_refuses_is_refused_with_its_own_words(cli, site, monkeypatch):
    _site_with_torch(site, "0.5.23")
    refused = run.Resolution(
        False, stage="resolve", error="ValueError: TRTLLM FMHAv2 prefill on SM120 does not support"
    )
    _answering(monkeypatch, refused)
    code, out, err = _check(cli, site, "glm46-fp8", ["model.path={models}/glm46-fp8"], "12.0")
    assert code == 2 and not out
    assert "sglang 0.5.23 refuses this launch at argument time" in err and "FMHAv2 prefill on SM120" in err


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (lambda d: (d / "config.json").write_text("{not json"), "is not readable JSON"),
        (lambda d: None, "no config.json in the model directory"),
    ],
)
def test_a_model_config_that_cannot_be_read_is_a_warning_and_nothing_starts(
    cli, site, monkeypatch, tmp_path, write, says
):
    _site_with_torch(site, "0.5.23")
    calls = _answering(monkeypatch, run.Resolution(True))
    model = tmp_path / "model"
    model.mkdir()
    write(model)
    code, _out, err = _check(cli, site, "glm46-fp8", [f"model.path={model}"], "12.0")
    assert code == 0 and not calls and "Traceback" not in err
    assert "sglang's own resolution could not run (the model's config.json" in err and says in err


def test_no_torch_in_the_target_says_so_in_the_basis_without_a_warning(cli, site, monkeypatch):
    install(site, "0.5.23")
    calls = _answering(monkeypatch, run.Resolution(True))
    code, out, err = _check(cli, site, "glm46-fp8", ["model.path={models}/glm46-fp8"], "12.1")
    assert code == 0 and not calls
    assert (
        "judged from the flags on capability 12.1 (sglang's own resolution could not run: no torch in site"
        in " ".join(out.split())
    )
    assert "could not run" not in err
