"""The profile fields for the first search an operator runs (issue 15): speculative decoding
with the model's own MTP layers ([speculative]), FlashInfer all-reduce fusion, decode-only CUDA
graphs; each rendered for the flag schema of every sglang release 0.5.9-0.5.23 read from the
real wheels, and what the renderer knows beyond the flags (an environment variable, a refusal)
checked against the same releases' source. Then the shipped variants file for glm5-nvfp4: every
variant loads with the profile and renders wherever its `requires` allow, or says why not."""

from __future__ import annotations

import functools
import re
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from support.paths import ROOT
from support.sites import WINDOW, flashinfer_pin, install

from sm120kit import wheels
from sm120kit.bench.variant_plan import plan
from sm120kit.bench.variant_reading import load_variants, read_variants_file
from sm120kit.bench.variants import BASELINE
from sm120kit.catalogue import rules
from sm120kit.catalogue.survey import load_survey
from sm120kit.errors import UserError
from sm120kit.profiles import loader
from sm120kit.profiles.flags import schema_from_sources
from sm120kit.profiles.loader import ENV_VAR, list_profiles, load_profile, tomllib  # tomli on 3.10
from sm120kit.profiles.model import FLAG_OWNERS
from sm120kit.profiles.render import (
    FUSION_REFUSED_ELSEWHERE,
    PP_SPEC_ACCEPTED,
    SPEC_V2_OPT_IN,
    SPECULATIVE_BUILTINS,
    render,
)
from sm120kit.target import resolve_target

VARIANTS = ROOT / "profiles" / "variants" / "glm5-nvfp4.toml"
MTP = ["speculative.algorithm=NEXTN", "speculative.num_steps=3", "speculative.eagle_topk=1"]


@functools.cache
def wheel(version: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheels.fetch("sglang", version))


@functools.cache
def schema(version: str):
    zf = wheel(version)
    names = set(zf.namelist())
    return schema_from_sources(version, lambda relpath: zf.read(relpath) if relpath in names else None)


def source(version: str, *relpaths: str) -> str:
    """The text of the first of `relpaths` that the release has ("" if none)."""
    names = set(wheel(version).namelist())
    found = next((p for p in relpaths if p in names), None)
    return wheel(version).read(found).decode() if found else ""


def argv_pairs(argv) -> dict[str, str | None]:
    words = [a for a in argv[3:] if isinstance(a, str)]
    return {
        w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None)
        for i, w in enumerate(words)
        if w.startswith("--")
    }


def launch(version: str, sets: list[str], name: str = "glm5-nvfp4"):
    return render(load_profile(name, [], sets), schema(version))


def refusal(version: str, sets: list[str]) -> str:
    with pytest.raises(UserError) as err:
        launch(version, sets)
    return str(err.value)


# -- [speculative]: rendered per release --------------------------------------------------


@pytest.mark.parametrize("version", WINDOW)
def test_mtp_renders_for_every_release_with_the_spec_v2_switch_where_the_release_reads_it(version):
    result = launch(version, MTP)
    pairs = argv_pairs(result.argv)
    assert pairs["--speculative-algorithm"] == "NEXTN"
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"]) == ("3", "1")
    assert pairs["--speculative-num-draft-tokens"] == "4", "topk 1: num_steps + 1, as sglang would make it"
    for flag in pairs:
        spec = schema(version).get(flag)
        assert spec is not None and not spec.deprecated, (flag, version)
    # the release's own environ.py: off by default up to 0.5.10.post1 (the v1 worker, no overlap
    # scheduler), on by default in 0.5.11-0.5.13.post1, gone from 0.5.14
    environ = source(version, "sglang/srt/environ.py")
    declared = re.search(r"SGLANG_ENABLE_SPEC_V2 = EnvBool\((True|False)\)", environ)
    off_by_default = declared is not None and declared.group(1) == "False"
    assert SPEC_V2_OPT_IN.contains(version) == off_by_default, version
    assert result.env.get("SGLANG_ENABLE_SPEC_V2") == ("1" if off_by_default else None), version
    if declared is None:  # removed: 0.5.14-0.5.20 warn that it is, later releases ignore it
        text = source(version, "sglang/srt/server_args.py") + source(
            version, "sglang/srt/arg_groups/speculative_hook.py"
        )
        assert "envs.SGLANG_ENABLE_SPEC_V2" not in text, version


@pytest.mark.parametrize("version", WINDOW)
def test_nextn_becomes_eagle_in_sglang_itself_whatever_the_env(version):
    """The reference said that without SGLANG_ENABLE_SPEC_V2 NEXTN "silently becomes EAGLE": every
    release turns NEXTN into EAGLE unconditionally (ServerArgs._handle_speculative_decoding up to
    0.5.11, _resolve_speculative_algorithm_alias from 0.5.12: in server_args.py, then from 0.5.13
    in arg_groups/speculative_hook.py); the variable only picks the worker and the overlap
    scheduler."""
    text = source(version, "sglang/srt/server_args.py") + source(version, "sglang/srt/arg_groups/speculative_hook.py")
    old = re.search(r'if self\.speculative_algorithm == "NEXTN":\n\s+self\.speculative_algorithm = "EAGLE"', text)
    new = re.search(
        r'if speculative_algorithm == "NEXTN" or speculative_algorithm == "EAGLE":(?:\n.*){0,7}\n\s+return "EAGLE"',
        text,
    )
    assert old or new, version


def test_a_topk_above_one_keeps_spec_v2_off_and_names_its_draft_tokens():
    result = launch(
        "0.5.9",
        [
            "speculative.algorithm=EAGLE",
            "speculative.num_steps=3",
            "speculative.eagle_topk=4",
            "speculative.num_draft_tokens=8",
            "speculative.draft_model_path=/models/draft",
        ],
    )
    pairs = argv_pairs(result.argv)
    assert pairs["--speculative-num-draft-tokens"] == "8" and pairs["--speculative-draft-model-path"] == "/models/draft"
    assert "SGLANG_ENABLE_SPEC_V2" not in result.env, "spec v2 raises for topk > 1 in 0.5.9"


def test_the_profiles_own_spec_v2_setting_wins_and_is_flagged_where_it_is_gone():
    kept = launch("0.5.9", [*MTP, 'env.SGLANG_ENABLE_SPEC_V2="0"'])
    assert kept.env["SGLANG_ENABLE_SPEC_V2"] == "0"
    gone = launch("0.5.23", [*MTP, 'env.SGLANG_ENABLE_SPEC_V2="1"'])
    assert any("SGLANG_ENABLE_SPEC_V2: sglang 0.5.23 has removed it" in w for w in gone.warnings)


def test_without_algorithm_nothing_speculative_is_rendered():
    pairs = argv_pairs(launch("0.5.23", []).argv)
    assert not [f for f in pairs if f.startswith("--speculative")]


@pytest.mark.parametrize("version", WINDOW)
def test_mtp_with_pipeline_parallel_is_refused_where_the_release_refuses_it(version):
    sets = [*MTP, "parallel.pp=2", "parallel.tp=4"]
    environ = source(version, "sglang/srt/environ.py")
    accepted = "SGLANG_ENABLE_PP_SPEC" in environ
    assert PP_SPEC_ACCEPTED.contains(version) == accepted, version
    message = refusal(version, sets)
    assert "speculative.algorithm = NEXTN with parallel.pp = 2" in message
    if not accepted:  # the release's own assertion, outside its NPU branch
        args = source(version, "sglang/srt/arg_groups/validation_hook.py", "sglang/srt/server_args.py")
        assert "Pipeline parallelism is not compatible with overlap schedule, speculative decoding" in args
        assert "refuses speculative decoding under pipeline parallelism" in message
        return
    hook = source(version, "sglang/srt/arg_groups/validation_hook.py")
    assert "def check_pipeline_parallel_compat" in hook and "SGLANG_ENABLE_PP_SPEC" in hook
    assert "SGLANG_ENABLE_PP_SPEC" in message
    pairs = argv_pairs(launch(version, [*sets, 'env.SGLANG_ENABLE_PP_SPEC="1"']).argv)
    assert pairs["--pp-size"] == "2" and pairs["--speculative-algorithm"] == "NEXTN"
    assert "only EAGLE" in refusal(version, [*sets, "speculative.algorithm=EAGLE3", 'env.SGLANG_ENABLE_PP_SPEC="1"'])


# -- FlashInfer all-reduce fusion -----------------------------------------------------------


@pytest.mark.parametrize("version", WINDOW)
def test_allreduce_fusion_renders_in_the_releases_spelling(version):
    """On a GPU where sglang runs the fusion (SM100): the switch, or from 0.5.14 the backend choice
    that the deprecated switch names as its replacement."""
    pairs = argv_pairs(
        launch(version, ["engine.flashinfer_allreduce_fusion=true", 'node.compute_capability="10.0"']).argv
    )
    switch = schema(version).get("--enable-flashinfer-allreduce-fusion")
    if switch.deprecated:
        assert switch.replacement == "--flashinfer-allreduce-fusion-backend=auto"
        assert pairs["--flashinfer-allreduce-fusion-backend"] == "auto"
        assert "--enable-flashinfer-allreduce-fusion" not in pairs
    else:
        assert "--enable-flashinfer-allreduce-fusion" in pairs
    assert "--flashinfer-allreduce-fusion-backend" not in argv_pairs(launch(version, []).argv)


@pytest.mark.parametrize("version", WINDOW)
def test_allreduce_fusion_on_sm120_is_refused_or_flagged_as_the_release_treats_it(version):
    """Every release fuses only on SM90/SM100 (the layer gate); from 0.5.14 it raises at startup."""
    gate = source(version, "sglang/srt/layers/communicator.py", "sglang/srt/layers/layer_boundary/residual/add_norm.py")
    name = re.search(r"def (apply_flashinfer_allreduce_fusion|flashinfer_ar_fusion_applies)\(", gate)
    body = gate[name.end() :].split("\ndef ", 1)[0]
    assert "(_is_sm90_supported or _is_sm100_supported)" in body, version
    raises = "requires SM90 or SM10X" in source(version, "sglang/srt/layers/flashinfer_comm_fusion.py")
    assert FUSION_REFUSED_ELSEWHERE.contains(version) == raises, version
    sets = ["engine.flashinfer_allreduce_fusion=true"]  # glm5-nvfp4 runs on compute capability 12.0
    if raises:  # the survey's launch rule refuses it (on SM12x: the rule's own test covers the CLI)
        facts = rules.Facts(launch(version, sets).argv, {}, {"sglang": version}, None)
        [judged] = [j for j in rules.judge(load_survey(), facts) if j.failure.id == "allreduce-fusion-sm90-sm100-only"]
        assert judged.verdict is rules.Verdict.REFUSED
        assert "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs" in judged.message()
    else:
        warnings = launch(version, sets).warnings
        assert any("fuses the all-reduce only on SM90/SM100" in w for w in warnings), warnings


def test_flashinfer_has_sm120_allreduce_kernels_from_0_6_17():
    """flashinfer/jit/comm.py gen_trtllm_comm_module: the architectures it builds for."""

    def majors(version: str) -> str:
        with zipfile.ZipFile(wheels.fetch("flashinfer-python", version)) as zf:
            text = zf.read("flashinfer/jit/comm.py").decode()
        body = text.split("def gen_trtllm_comm_module", 1)[1].split("\ndef ", 1)[0]
        return re.search(r"supported_major_versions=(\[[^\]]*\])", body).group(1)

    assert majors("0.6.16") == "[9, 10]"
    assert majors("0.6.17") == "[9, 10, 12]"


# -- decode-only CUDA graphs --------------------------------------------------------------


@pytest.mark.parametrize("version", WINDOW)
def test_decode_only_cuda_graphs_render_per_release(version):
    pairs = argv_pairs(launch(version, ["engine.cuda_graphs=true", "engine.prefill_cuda_graphs=false"]).argv)
    assert "--disable-cuda-graph" not in pairs and pairs.get("--cuda-graph-backend-decode") != "disabled"
    if schema(version).get("--cuda-graph-backend-prefill"):
        assert pairs["--cuda-graph-backend-prefill"] == "disabled"
    elif schema(version).get("--disable-piecewise-cuda-graph"):
        assert "--disable-piecewise-cuda-graph" in pairs
    else:  # 0.5.9: prefill (piecewise) graphs are opt-in and off by default
        assert re.search(r"enable_piecewise_cuda_graph: bool = False", source(version, "sglang/srt/server_args.py"))
        assert not [f for f in pairs if "piecewise" in f or ("prefill" in f and "graph" in f)]
    for flag in pairs:
        assert not schema(version).get(flag).deprecated, (flag, version)
    graphs_off = argv_pairs(launch(version, ["engine.prefill_cuda_graphs=false"]).argv)  # cuda_graphs = false wins
    assert "--disable-piecewise-cuda-graph" not in graphs_off and graphs_off.get("--cuda-graph-backend-decode") in (
        None,
        "disabled",
    )


# -- bad values: the file, the key, the nearest spelling ------------------------------------


@pytest.fixture
def pdir(tmp_path: Path, monkeypatch) -> Path:
    """A profile directory searched first; the shipped profiles (glm5-nvfp4) stay reachable."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    path = tmp_path / "profiles"
    path.mkdir()
    return path


def bad(pdir: Path, text: str) -> tuple[Path, str]:
    path = pdir / "p.toml"
    path.write_text('extends = "glm5-nvfp4"\n' + textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(UserError) as err:
        load_profile("p", [str(pdir)])
    assert err.value.hint, "every mistake comes with a next step"
    return path, str(err.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "[speculative]\nalgoritm = 'NEXTN'\n",
            "unknown key speculative.algoritm; did you mean speculative.algorithm?",
        ),
        (
            "[speculative]\nalgorithm = 'nextn'\n",
            "speculative.algorithm: 'nextn': sglang names its algorithms in capitals",
        ),
        ("[speculative]\nalgorithm = 'nextn'\n", "did you mean 'NEXTN'?"),
        (
            "[speculative]\nalgorithm = 'NEXTN'\nnum_steps = '3'\n",
            'speculative.num_steps: expected an integer, got "3"',
        ),
        ("[speculative]\nalgorithm = 'NEXTN'\nnum_steps = 0\neagle_topk = 1\n", "allowed: an integer from 1 to 64"),
        ("[speculative]\nnum_steps = 3\n", "speculative.num_steps is set but speculative.algorithm is not"),
        ("[speculative]\nalgorithm = 'NEXTN'\neagle_topk = 1\n", "speculative.num_steps is not set"),
        ("[speculative]\nalgorithm = 'NEXTN'\nnum_steps = 3\n", "speculative.eagle_topk is not set"),
        (
            "[speculative]\nalgorithm = 'NEXTN'\nnum_steps = 4\neagle_topk = 1\nnum_draft_tokens = 6\n",
            "speculative.num_draft_tokens = 6: with eagle_topk = 1 sglang replaces it with num_steps + 1 = 5",
        ),
        (
            "[speculative]\nalgorithm = 'EAGLE'\nnum_steps = 3\neagle_topk = 4\n",
            "speculative.num_draft_tokens is not set: with eagle_topk = 4",
        ),
        (
            "[engine]\nflashinfer_allreduce_fusion = 'yes'\n",
            "engine.flashinfer_allreduce_fusion: expected true or false",
        ),
        ("[engine]\nflashinfer_allreduce_fuson = true\n", "did you mean engine.flashinfer_allreduce_fusion?"),
        ("[engine]\nprefill_cuda_graph = false\n", "did you mean engine.prefill_cuda_graphs?"),
    ],
)
def test_bad_values_name_the_file_the_key_and_what_to_write(pdir, text, says):
    path, message = bad(pdir, text)
    assert f"{path}: " in message, message
    assert says in message, message


def test_an_algorithm_the_release_does_not_list_names_its_choices():
    message = refusal("0.5.9", ["speculative.algorithm=MEDUSA"])
    assert "speculative.algorithm = 'MEDUSA': sglang 0.5.9 accepts EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM" in message


@pytest.mark.parametrize("version", [v for v in WINDOW if Version(v) >= Version("0.5.12")])
def test_an_algorithm_outside_the_builtins_is_flagged_where_the_release_lists_no_choices(version):
    """From 0.5.12 the flag lists no choices: the release's SpeculativeAlgorithm enum has them."""
    assert schema(version).get("--speculative-algorithm").choices is None
    enum = source(version, "sglang/srt/speculative/spec_info.py").split("class SpeculativeAlgorithm(", 1)[1]
    members = set(re.findall(r"\n    ([A-Z0-9_]+) = auto\(\)", enum.split("\n\n\n")[0]))
    assert {"EAGLE", "EAGLE3", "NGRAM"} <= members and members - {"NONE"} <= set(SPECULATIVE_BUILTINS), members
    warnings = launch(version, ["speculative.algorithm=NEXN"]).warnings
    flagged = "speculative.algorithm = NEXN: not one of sglang's built-in algorithms (did you mean NEXTN?)"
    assert any(flagged in w for w in warnings), warnings
    assert not any("built-in" in w for w in launch(version, ["speculative.algorithm=NEXTN"]).warnings)


def test_the_community_recipe_4_6_1_is_refused_with_what_sglang_would_run():
    with pytest.raises(UserError) as err:
        load_profile(
            "glm5-nvfp4",
            [],
            [*MTP[:1], "speculative.num_steps=4", "speculative.eagle_topk=1", "speculative.num_draft_tokens=6"],
        )
    assert "--set speculative.num_draft_tokens=6: speculative.num_draft_tokens = 6" in str(err.value)
    assert "sglang replaces it with num_steps + 1 = 5" in str(err.value)


# -- extra_args cannot set what the new fields own ----------------------------------------

OWNED = [
    ("--speculative-algorithm", '"NEXTN"', "speculative.algorithm"),
    ("--speculative-num-steps", "3", "speculative.num_steps"),
    ("--speculative-eagle-topk", "1", "speculative.eagle_topk"),
    ("--speculative-num-draft-tokens", "4", "speculative.num_draft_tokens"),
    ("--speculative-draft-model-path", '"/d"', "speculative.draft_model_path"),
    ("--speculative-draft-model", '"/d"', "speculative.draft_model_path"),
    ("--enable-flashinfer-allreduce-fusion", "true", "engine.flashinfer_allreduce_fusion"),
    ("--flashinfer-allreduce-fusion-backend", '"trtllm"', "engine.flashinfer_allreduce_fusion"),
    ("--disable-piecewise-cuda-graph", "true", "engine.prefill_cuda_graphs"),
    ("--disable-prefill-cuda-graph", "true", "engine.prefill_cuda_graphs"),
]


@pytest.mark.parametrize(("flag", "value", "field"), OWNED)
def test_extra_args_may_not_set_a_flag_the_new_fields_own(pdir, flag, value, field):
    path, message = bad(pdir, f'[extra_args]\n"{flag}" = {value}\n')
    assert f"{path}: extra_args.{flag}: {flag} is rendered from {field}: set {field} instead" in message, message


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10.post1", "0.5.13", "0.5.14", "0.5.21", "0.5.23"])
def test_every_flag_the_new_fields_render_is_owned(version):
    sets = [
        *MTP,
        "speculative.draft_model_path=/models/draft",
        "engine.flashinfer_allreduce_fusion=true",
        'node.compute_capability="10.0"',
        "engine.cuda_graphs=true",
        "engine.prefill_cuda_graphs=false",
        "engine.cuda_graph_max_bs=64",
    ]
    profile = load_profile("glm5-nvfp4", [], sets)
    profile = profile.model_copy(update={"extra_args": {}})
    rendered = {a for a in render(profile, schema(version)).argv[3:] if isinstance(a, str) and a.startswith("--")}
    assert rendered - set(FLAG_OWNERS) == set(), version


# -- the shipped variants file ------------------------------------------------------------


def shipped_variants() -> dict[str, dict]:
    """name -> {"sets": [--set words], "requires": {...}, "why": str}, read by the search's own
    parser (sm120kit/bench/variant_reading.py), which checks the file's keys, names and ranges."""
    found, meta = read_variants_file(VARIANTS)
    assert meta["profile"] == "glm5-nvfp4" and meta["description"]
    assert set(tomllib.loads(VARIANTS.read_text(encoding="utf-8"))["variants"]) == {v.name for v in found}
    for v in found:
        assert v.description and len(v.description) <= 120, v.name
    return {v.name: {"sets": list(v.sets), "requires": dict(v.requires), "why": v.why} for v in found}


SHIPPED = shipped_variants()


def installed(version: str) -> dict[str, str]:
    """What an install of sglang==version brings: sglang and the flashinfer-python it pins."""
    return {"sglang": version, "flashinfer-python": flashinfer_pin(version) or "0"}


def allowed(variant: dict, version: str) -> bool:
    have = installed(version)
    return all(SpecifierSet(r).contains(have[p], prereleases=True) for p, r in variant["requires"].items())


def test_the_file_has_the_levers_the_issue_names():
    assert set(SHIPPED) == {
        "max-running-2048",
        "decode-cuda-graphs",
        "radix-cache",
        "pp2-tp4",
        "allreduce-fusion",
        "mtp",
        "dsa-native",
    }
    for name, variant in SHIPPED.items():
        assert not variant["requires"] or variant["why"], f"{name}: a skipped variant says why"
        for package in variant["requires"]:
            assert package in ("sglang", "flashinfer-python"), (name, package)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_variant_loads_with_the_profile(name):
    profile = load_profile("glm5-nvfp4", [], SHIPPED[name]["sets"])
    base = load_profile("glm5-nvfp4", [])
    assert profile != base, f"{name} changes something"


@pytest.mark.parametrize("version", WINDOW)
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_variant_renders_where_its_requires_allow_or_says_why(name, version):
    variant = SHIPPED[name]
    if not allowed(variant, version):  # skipped by the search, with the variant's why
        assert variant["why"]
        return
    result = launch(version, variant["sets"])
    expected_refusal = {"allreduce-fusion": "allreduce-fusion-sm90-sm100-only"}
    if name in expected_refusal and FUSION_REFUSED_ELSEWHERE.contains(version):  # the survey's launch rule
        facts = rules.Facts(result.argv, {}, {"sglang": version}, None)
        assert expected_refusal[name] in [j.failure.id for j in rules.judge(load_survey(), facts)]
        return
    pairs = argv_pairs(result.argv)
    for flag, value in pairs.items():
        spec = schema(version).get(flag)
        assert spec is not None and not spec.deprecated, (name, flag, version)
        if spec.choices is not None and value is not None:
            assert value in spec.choices, (name, flag, value, version)
    if name == "pp2-tp4":
        assert (pairs["--pp-size"], pairs["--tp-size"]) == ("2", "4")
    if name == "mtp":
        assert pairs["--model-path"] == "festr2/GLM-5-NVFP4-MTP" and pairs["--speculative-algorithm"] == "NEXTN"
    if name == "max-running-2048":
        assert pairs["--max-running-requests"] == "2048"
    if name == "radix-cache":
        assert "--disable-radix-cache" not in pairs
    if name == "decode-cuda-graphs":
        assert "--disable-cuda-graph" not in pairs and pairs.get("--cuda-graph-backend-decode") != "disabled"
        prefill_off = (
            pairs.get("--cuda-graph-backend-prefill") == "disabled" or "--disable-piecewise-cuda-graph" in pairs
        )
        assert prefill_off or version == "0.5.9", version  # 0.5.9 captures no prefill graphs unless asked
        assert (pairs.get("--cuda-graph-max-bs") or pairs.get("--cuda-graph-max-bs-decode")) == "256"


def test_the_allreduce_fusion_variant_is_skipped_across_the_window_with_a_reason():
    """Below flashinfer 0.6.17 by its requires; with 0.6.17 (sglang 0.5.18 on) by the render."""
    variant = SHIPPED["allreduce-fusion"]
    by_requires = [v for v in WINDOW if not allowed(variant, v)]
    assert by_requires == [v for v in WINDOW if Version(flashinfer_pin(v)) < Version("0.6.17")]
    assert "0.5.18" not in by_requires and "0.5.17" in by_requires


@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.23"])
def test_the_search_plans_the_shipped_file_on_a_real_install(site, version):
    """As `bench --variants glm5-nvfp4` plans it: found by name, every variant rendered for the
    installed sglang (with the flashinfer-python it pins), the all-reduce fusion skipped with why."""
    install(site, version)
    variants, source, written_for = load_variants(None, "glm5-nvfp4", [])
    assert Path(source) == VARIANTS and written_for == "glm5-nvfp4"
    planned = plan("glm5-nvfp4", [], [], variants, resolve_target(site=str(site)), "python3", source, written_for)
    status = {p.name: (str(p.status), p.why) for p in planned.variants}
    assert next(iter(status)) == BASELINE
    skipped = {name: why for name, (state, why) in status.items() if state == "skipped"}
    assert set(skipped) == {"allreduce-fusion"}, status
    if Version(flashinfer_pin(version)) < Version("0.6.17"):
        assert f"needs flashinfer-python>=0.6.17; installed: {flashinfer_pin(version)}" in skipped["allreduce-fusion"]
    else:
        assert "requires SM90 or SM10X" in skipped["allreduce-fusion"]
    assert "flashinfer PR #3903" in skipped["allreduce-fusion"]


# -- the variants directory is not a profile, and ships in the wheel ---------------------------


def test_the_loader_does_not_take_variants_for_profiles(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    names = {name for name, _, _ in list_profiles([])}
    assert "glm5-nvfp4" in names and "variants" not in names
    assert all(path.parent == loader.shipped_dir() for _, path, _ in list_profiles([]))
    with pytest.raises(UserError, match="unknown profile"):
        load_profile("variants", [])


def test_the_wheel_ships_the_variants_directory():
    """hatch force-includes profiles/ as a directory (recursively) into sm120kit/_shipped/profiles."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    force = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert force["profiles"] == "sm120kit/_shipped/profiles"
    assert VARIANTS.is_relative_to(ROOT / "profiles")
