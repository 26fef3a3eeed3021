"""The known-failures survey (patches/known-failures.toml) and its launch rules.

Every rule of the shipped survey is run on the real flag schema of the releases it names
(the first and the last release of the proven window inside its range): its trigger
refuses (exit 2, the release, the upstream link and what avoids it) in `profile check`
and `serve --dry-run`; its `avoid` added, the same launch passes; where a patch covers
the failure, applying it makes the launch pass too. A damaged survey is refused with its
file and key, and changes nothing."""

from __future__ import annotations

import json

import pytest
from packaging.version import Version
from support.sites import WINDOW, flashinfer_pin, install

from sm120kit.catalogue import rules
from sm120kit.catalogue.kernels import read_table
from sm120kit.catalogue.survey import FILENAME, load_survey, read_file
from sm120kit.errors import UserError
from sm120kit.patching.registry import load_patches, shipped_dir

SURVEY = load_survey()
KERNELS = read_table()
RULED = [f for f in SURVEY.failures if f.rule is not None]


def releases_of(failure) -> list[str]:
    """The first and last release of the proven window that the entry names."""
    if failure.package == "sglang":
        inside = [v for v in WINDOW if failure.covers(v)]
    else:
        inside = [v for v in WINDOW if (pin := flashinfer_pin(v)) and failure.covers(pin)]
    return sorted({inside[0], inside[-1]}, key=Version) if inside else []


CASES = [(f, v) for f in RULED for v in releases_of(f)]


def test_the_survey_is_whole():
    """At least 20 entries; every patch shipped has an entry, and every entry's patch exists."""
    patches = {p.id for p in load_patches()}
    assert len(SURVEY.failures) >= 20
    assert patches <= {f.patch for f in SURVEY.failures}
    for failure in SURVEY.failures:
        assert failure.patch is None or failure.patch in patches
        assert failure.fixed_in is None or not failure.covers(failure.fixed_in)
        assert Version(failure.checked) >= Version("0.5.20") if failure.package == "sglang" else True


def test_every_rule_names_a_release_of_the_window():
    assert CASES and all(releases_of(f) for f in RULED), [f.id for f in RULED if not releases_of(f)]


def _model_args(failure, tmp_path) -> list[str]:
    """--set model.path= a directory with the rule's config.json (and hf_quant_config.json)."""
    if not failure.rule.trigger_config:
        return []
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    config = dict(failure.rule.trigger_config)
    if "hf_quant_config" in config:
        (model / "hf_quant_config.json").write_text(json.dumps(config.pop("hf_quant_config")))
    (model / "config.json").write_text(json.dumps(config))
    return ["--set", f"model.path={model}"]


def _run(cli, command, site, failure, sets, tmp_path, *extra):
    """`profile check` or `serve --dry-run` of the rule's profile with `sets`; the other
    rules, and the kernels that do not account for this failure, are allowed, and its patches
    are not judged (--no-patch-check: the site is unpatched), so that this one alone decides."""
    others = [w for f in RULED if f is not failure for w in ("--allow-known-failure", f.id)]
    others += [w for k in KERNELS.kernels if failure.id not in k.survey for w in ("--allow-known-failure", k.id)]
    args = [*command, failure.rule.profile, "--site", site, "--no-patch-check"]
    args += [w for s in sets for w in ("--set", s)]
    return cli(*args, *_model_args(failure, tmp_path), *others, *extra)


CHECK, DRY_RUN = ("profile", "check"), ("serve",)


@pytest.mark.parametrize(("failure", "version"), CASES, ids=[f"{f.id}-{v}" for f, v in CASES])
def test_rule_refuses_then_passes(cli, site, tmp_path, failure, version):
    install(site, version)
    trigger, avoid = failure.rule.trigger, failure.rule.avoid
    for command in (CHECK, DRY_RUN):
        extra = ("--dry-run",) if command == DRY_RUN else ()
        code, out, err = _run(cli, command, site, failure, trigger, tmp_path, *extra)
        assert code == 2, out + err
        assert f"known failure {failure.id} on {failure.package} " in err and failure.upstream[0] in err, err
        assert "avoid:" in err and "Traceback" not in err and not out
    code, _, err = _run(cli, CHECK, site, failure, [*trigger, *avoid], tmp_path)
    assert code == 0, err
    code, _, err = _run(cli, CHECK, site, failure, trigger, tmp_path, "--allow-known-failure", failure.id)
    assert code == 0 and f"allowed by --allow-known-failure {failure.id}" in err
    if failure.patch:
        code, out, err = cli("patch", "--site", site, "--only", failure.patch)
        assert code == 0, out + err
        code, _, err = _run(cli, CHECK, site, failure, trigger, tmp_path)
        assert code == 0, err


def test_rule_is_silent_off_sm120(cli, site, tmp_path):
    """A profile for another GPU (node.compute_capability) is not judged by SM120 rules: it
    passes and nothing is said of the rule, neither a refusal nor a warning nor an allowance."""
    failure, version = CASES[0]
    install(site, version)
    code, out, err = _run(
        cli, CHECK, site, failure, [*failure.rule.trigger, 'node.compute_capability="10.0"'], tmp_path
    )
    assert code == 0 and err == "", err
    assert failure.id not in out and "known failure" not in out, out
    assert out.startswith(f"profile {failure.rule.profile}: ok for sglang {version} "), out


# -- the loader's refusals -----------------------------------------------------------------

GOOD = """
[[failure]]
id = "example"
title = "an example"
package = "sglang"
affected = ">=0.5.20"
checked = "0.5.23"
upstream = ["https://github.com/sgl-project/sglang/issues/1"]
symptom = "boom"
evidence = "nowhere"
answer = "rule"
avoid = "--attention-backend flashinfer"
advice = "avoid it"

[failure.rule]
when = [{ flag = "--attention-backend", in = ["fa3"] }]
profile = "glm5-nvfp4"
trigger = ["engine.attention_backend=fa3"]
avoid = ["engine.attention_backend=flashinfer"]
"""

DAMAGED = {
    "wrong type": (GOOD.replace('affected = ">=0.5.20"', "affected = 0.5"), "failure[0] (example).affected"),
    "no releases": (GOOD.replace('affected = ">=0.5.20"\n', ""), "failure[0] (example).affected"),
    "empty range": (GOOD.replace('affected = ">=0.5.20"', 'affected = ""'), "failure[0] (example).affected"),
    "unknown key": (GOOD.replace('advice = "avoid it"', 'advice = "avoid it"\nseverity = 3'), "severity"),
    # (a link that is no GitHub issue is refused in the shipped file only: a user's may name
    # their own tracker; tests/test_truth_user_data.py)
    "bad regex": (GOOD.replace('symptom = "boom"', 'symptom = "(unclosed"'), "failure[0] (example).symptom"),
    "unknown patch": (
        GOOD.replace('answer = "rule"', 'answer = "patch"\npatch = "sglang-nosuch"'),
        "failure example.patch",
    ),
    "condition": (GOOD.replace('in = ["fa3"]', 'in = ["fa3"], present = true'), "rule.when[0]"),
    "present over alternatives": (
        GOOD.replace('flag = "--attention-backend", in = ["fa3"]', 'flag = [["--a"], ["--b"]], present = true'),
        "rule.when[0]",
    ),
    "quantization off a model": (GOOD.replace('in = ["fa3"]', 'in = ["fa3"], quantization = ["fp8"]'), "rule.when[0]"),
    "rule without rule": (GOOD[: GOOD.index("[failure.rule]")], "needs a [failure.rule]"),
    "fixed inside": (GOOD.replace('checked = "0.5.23"', 'checked = "0.5.23"\nfixed_in = "0.5.21"'), "fixed_in"),
    "not toml": (GOOD.replace("[failure.rule]", "[failure.rule"), "not valid TOML"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_survey_is_refused_with_file_and_key(cli, tmp_path, case):
    text, where = DAMAGED[case]
    (tmp_path / "mine").mkdir()
    path = tmp_path / "mine" / FILENAME
    path.write_text(text)
    with pytest.raises(UserError) as caught:
        load_survey([str(tmp_path / "mine")])
    assert str(path) in caught.value.message and where in caught.value.message
    code, out, err = cli("known-failures", "--patch-dir", tmp_path / "mine")
    assert code == 2 and str(path) in err and "Traceback" not in err and not out


def test_a_user_survey_adds_and_replaces(tmp_path):
    (tmp_path / "mine").mkdir()
    replaced = GOOD.replace('id = "example"', 'id = "triton-shared-memory"')
    (tmp_path / "mine" / FILENAME).write_text(GOOD + replaced)
    survey = load_survey([str(tmp_path / "mine")])
    assert survey.get("example").title == "an example"
    assert survey.get("triton-shared-memory").title == "an example"
    assert len(survey.failures) == len(SURVEY.failures) + 1


def test_the_shipped_file_reads_alone():
    assert [f.id for f in read_file(shipped_dir() / FILENAME)] == [f.id for f in SURVEY.failures]


def test_unknown_allow_known_failure_is_bad_input(cli, site):
    install(site, WINDOW[-1], flashinfer=False)
    for argv in (
        ["profile", "check", "glm5-nvfp4", "--site", site],
        ["serve", "glm5-nvfp4", "--dry-run", "--site", site],
        ["doctor", "--site", site, "--nvml", "/dev/null"],
    ):
        code, _, err = cli(*argv, "--allow-known-failure", "trtllm-mla-prefil")
        assert code == 2 and "--allow-known-failure trtllm-mla-prefil" in err and "Traceback" not in err, err


def test_a_user_rule_in_doctor_and_bench_vary(cli, site, tmp_path):
    """doctor --profile fails the check; bench --vary skips the variant before any load."""
    install(site, WINDOW[-1], flashinfer=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / FILENAME).write_text(GOOD)
    code, doc = cli.json(
        "doctor",
        "--site",
        site,
        "--patch-dir",
        tmp_path / "mine",
        "--profile",
        "glm5-nvfp4",
        "--set",
        "engine.attention_backend=fa3",
    )
    [check] = [c for c in doc["checks"] if c["check"] == "known failures"]
    assert check["status"] == "fail" and "example" in check["detail"] and code == 1
    assert "engine.attention_backend=flashinfer" in check["fix"]

    from sm120kit.bench.variant_plan import plan
    from sm120kit.bench.variants import Variant, VariantStatus
    from sm120kit.target import resolve_target

    mine = [str(tmp_path / "mine")]
    found = [Variant("fa3", ("engine.attention_backend=fa3",)), Variant("triton", ("engine.attention_backend=triton",))]
    planned = plan("glm5-nvfp4", None, [], found, resolve_target(site=str(site)), "python", "--vary", None, mine)
    status = {p.variant.name: (p.status, p.why) for p in planned.variants}
    assert status["fa3"][0] is VariantStatus.SKIPPED and "known failure example" in status["fa3"][1]
    assert status["triton"][0] is VariantStatus.RUNNABLE
    with pytest.raises(UserError, match="known SM120 failure"):  # the profile as written must be runnable
        plan(
            "glm5-nvfp4",
            None,
            ["engine.attention_backend=fa3"],
            found,
            resolve_target(site=str(site)),
            "python",
            "--vary",
            None,
            mine,
        )


def test_diagnose_knows_the_survey(cli, tmp_path):
    """Every entry with a symptom is a diagnose signature (an entry whose id a generic
    signature already has is that signature)."""
    from sm120kit.serve.diagnose import diagnose, signatures

    ids = {s.id for s in signatures()}
    assert {f.id for f in SURVEY.failures if f.symptom} <= ids
    log = tmp_path / "server.log"
    sample = next(f for f in SURVEY.failures if f.id == "dsa-page-table")
    log.write_text("x\nAttributeError: 'PrefillMetadata' object has no attribute 'page_table_1_flattened'\n")
    [found] = diagnose(log.read_text())
    assert found.id == sample.id


def test_judge_reads_flags_model_and_env(tmp_path):
    """The conditions on their own: `--x v`, `--x=v`, a default, a config.json key, $ENV."""
    doc = GOOD.replace(
        'when = [{ flag = "--attention-backend", in = ["fa3"] }]',
        'when = [{ flag = ["--dsa-prefill-backend", "--nsa-prefill-backend"], in = ["trtllm"], default = "trtllm" },'
        ' { model = "quantization_config.kv_cache_quant_algo", in = ["FP8"] }, { env = "X", in = ["1"] },'
        ' { flag = "--disable-radix-cache", present = false }]',
    )
    (tmp_path / "judge.toml").write_text(doc)
    [failure] = read_file(tmp_path / "judge.toml")
    survey = type(SURVEY)((failure,), ())
    config = {"quantization_config": {"kv_cache_quant_algo": "FP8"}}

    def verdicts(argv, env, model):
        facts = rules.Facts(argv, env, {"sglang": "0.5.23"}, model, "no config.json")
        return [j.verdict for j in rules.judge(survey, facts)]

    assert verdicts(["python"], {"X": "1"}, config) == [rules.Verdict.REFUSED]  # the default holds
    assert verdicts(["--nsa-prefill-backend=trtllm"], {"X": "1"}, config) == [rules.Verdict.REFUSED]
    assert verdicts(["--dsa-prefill-backend", "tilelang"], {"X": "1"}, config) == []
    assert verdicts(["python"], {"X": "0"}, config) == []
    assert verdicts(["--disable-radix-cache"], {"X": "1"}, config) == []
    assert verdicts(["python"], {"X": "1"}, None) == [rules.Verdict.UNDECIDED]
    assert verdicts(["python"], {"X": "1"}, {"quantization_config": {}}) == []
    old = rules.Facts(["python"], {"X": "1"}, {"sglang": "0.5.19"}, config)
    assert rules.judge(survey, old) == []  # outside `affected`


def test_judge_matches_and_capability(tmp_path):
    doc = GOOD.replace(
        'when = [{ flag = "--attention-backend", in = ["fa3"] }]',
        'when = [{ capability = true, in = ["12.1"] },'
        ' { model = ["quantization_config.exclude_modules", "hf_quant_config.quantization.exclude_modules"],'
        ' matches = "shared_expert" }]',
    )
    (tmp_path / "judge.toml").write_text(doc)
    survey = type(SURVEY)(tuple(read_file(tmp_path / "judge.toml")), ())
    quant = {"hf_quant_config": {"quantization": {"exclude_modules": ["lm_head", "layers.3.mlp.shared_experts*"]}}}

    def verdicts(capability, config):
        facts = rules.Facts(["python"], {}, {"sglang": "0.5.23"}, config, "", capability)
        return [j.verdict for j in rules.judge(survey, facts)]

    assert verdicts("12.1", quant) == [rules.Verdict.REFUSED]
    assert verdicts("12.0", quant) == []
    assert verdicts("12.1", {"quantization_config": {"exclude_modules": ["lm_head"]}}) == []
    assert verdicts("10.0", quant) == []  # not an SM12x node: no rule is judged


def test_the_docs_page_is_the_survey():
    import render_survey

    assert render_survey.PAGE.read_text() == render_survey.render(), "run python scripts/render_survey.py"


def _one_rule(tmp_path, when: str):
    """A survey of GOOD with its `when` replaced."""
    (tmp_path / "judge.toml").write_text(GOOD.replace('when = [{ flag = "--attention-backend", in = ["fa3"] }]', when))
    return type(SURVEY)(tuple(read_file(tmp_path / "judge.toml")), ())


def test_alternatives_judge_each_phase(tmp_path):
    """A flag's alternatives: the rule holds when the backend of either phase is fa3 (the
    phase's own flag where given, else --attention-backend); one list stays one flag's
    spellings, the first given deciding."""
    survey = _one_rule(
        tmp_path,
        'when = [{ flag = [["--prefill-attention-backend", "--attention-backend"],'
        ' ["--decode-attention-backend", "--attention-backend"]], in = ["fa3"] }]',
    )

    def verdicts(*argv):
        return [j.verdict for j in rules.judge(survey, rules.Facts(["python", *argv], {}, {"sglang": "0.5.23"}, {}))]

    refused = [rules.Verdict.REFUSED]
    assert verdicts("--attention-backend", "fa3") == refused
    assert verdicts("--attention-backend", "flashinfer", "--prefill-attention-backend", "fa3") == refused
    assert verdicts("--attention-backend", "flashinfer", "--decode-attention-backend=fa3") == refused
    assert verdicts("--attention-backend", "flashinfer") == []
    assert verdicts("--attention-backend", "fa3", "--prefill-attention-backend", "triton") == refused  # decode: fa3
    both = ("--prefill-attention-backend", "triton", "--decode-attention-backend", "flashinfer")
    assert verdicts("--attention-backend", "fa3", *both) == []
    [condition] = survey.failures[0].rule.when
    assert condition.describe() == (
        "(--prefill-attention-backend / --attention-backend) or (--decode-attention-backend / --attention-backend)"
        " in {fa3}"
    )
    spellings = _one_rule(
        tmp_path, 'when = [{ flag = ["--prefill-attention-backend", "--attention-backend"], in = ["fa3"] }]'
    )
    facts = rules.Facts(
        ["python", "--attention-backend", "fa3", "--prefill-attention-backend", "triton"], {}, {"sglang": "0.5.23"}, {}
    )
    assert rules.judge(spellings, facts) == []  # one flag: the first spelling given decides


def test_every_shipped_rule_on_attention_names_its_phases():
    """A rule on the attention backend says which phases it judges: each alternative is a
    phase's flag before --attention-backend, never --attention-backend before a phase's."""
    phases = {"--prefill-attention-backend", "--decode-attention-backend"}
    for failure in RULED:
        for condition in failure.rule.when:
            for spellings in condition.flag_alternatives():
                if "--attention-backend" in spellings and len(spellings) > 1:
                    assert spellings[-1] == "--attention-backend" and set(spellings[:-1]) <= phases, failure.id
    [fa3] = SURVEY.get("fa3-attention-sm120").rule.when
    assert fa3.flag_alternatives() == [
        ["--prefill-attention-backend", "--attention-backend"],
        ["--decode-attention-backend", "--attention-backend"],
    ]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_phase_backend_of_fa3_is_refused(cli, site, tmp_path, phase):
    """`--set engine.<phase>_attention_backend=fa3` over a profile that gives
    --attention-backend flashinfer: the rule sees the phase on the real flag schema, and
    `profile check` refuses it."""
    from sm120kit.profiles.flags import installed_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render
    from sm120kit.target import resolve_target

    install(site, WINDOW[-1])
    sets = [f"engine.{phase}_attention_backend=fa3"]
    profile = load_profile("glm5-nvfp4", None, sets)
    target = resolve_target(site=str(site))
    launch = render(profile, installed_schema(target), "python3")
    assert "--attention-backend" in launch.argv and f"--{phase}-attention-backend" in launch.argv
    judged = rules.check_launch(profile, launch, target)
    assert [j.verdict for j in judged if j.failure.id == "fa3-attention-sm120"] == [rules.Verdict.REFUSED]
    code, out, err = cli("profile", "check", "glm5-nvfp4", "--site", site, "--set", sets[0])
    assert code == 2 and "fa3" in err and "Traceback" not in err and not out, err


def test_the_launchs_own_quantization_decides_before_config_json(tmp_path):
    """A model condition on the checkpoint's quantization: a --quantization the rule does
    not list decides it false, whether or not config.json is here; none given, or a listed
    one, reads config.json (undecided without it)."""
    survey = _one_rule(
        tmp_path, 'when = [{ model = "quantization_config.quant_method", in = ["fp8"], quantization = ["fp8"] }]'
    )
    fp8 = {"quantization_config": {"quant_method": "fp8"}}

    def verdicts(argv, config):
        facts = rules.Facts(["python", *argv], {}, {"sglang": "0.5.23"}, config, "no config.json")
        return [j.verdict for j in rules.judge(survey, facts)]

    assert verdicts(["--quantization", "modelopt_fp4"], None) == []
    assert verdicts(["--quantization=modelopt_fp4"], fp8) == []
    assert verdicts([], None) == [rules.Verdict.UNDECIDED]
    assert verdicts(["--quantization", "fp8"], None) == [rules.Verdict.UNDECIDED]
    assert verdicts(["--quantization", "fp8"], fp8) == [rules.Verdict.REFUSED]
    assert verdicts([], fp8) == [rules.Verdict.REFUSED]
    assert verdicts([], {"quantization_config": {"quant_method": "compressed-tensors"}}) == []


def test_a_profile_that_says_its_quantization_is_not_warned_about_another(cli, site, tmp_path, monkeypatch):
    """No config.json on this machine: glm5-nvfp4 says modelopt_fp4 (--quantization), so
    the block-FP8 rule of 0.5.9-0.5.12 is decided without it; glm46-fp8 says none, so
    that rule still may apply, and stating one decides it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    install(site, "0.5.12")
    fp8_rule = "known failure fp8-block-gemm-sm120-deepgemm"
    check = ["profile", "check", "--site", site, "--no-patch-check"]  # the rules alone: the site is unpatched
    code, _, err = cli(*check, "glm5-nvfp4")
    assert code == 0 and fp8_rule not in err, err
    code, _, err = cli(*check, "glm46-fp8")
    assert code == 0 and f"{fp8_rule} on sglang 0.5.12" in err and "may apply" in err, err
    code, _, err = cli(*check, "glm46-fp8", "--set", "model.quantization=modelopt_fp4")
    assert code == 0 and fp8_rule not in err, err


@pytest.mark.parametrize("renderer", ["systemd", "docker", "k8s"])
def test_every_render_target_judges_the_launch(cli, tmp_path, renderer):
    """`render systemd|docker|k8s` refuses a launch that a rule refuses (exit 2, the
    failure named, nothing printed), as `profile check` does; --allow-known-failure
    renders it, and the unit and the container pass the allowance on to serve."""
    from support.standin import make_env_python

    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", WINDOW[-1])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / FILENAME).write_text(
        GOOD.replace(
            'when = [{ flag = "--attention-backend", in = ["fa3"] }]', 'when = [{ env = "SM120KIT_X", in = ["1"] }]'
        )
    )
    where = ["--site", tmp_path / "env" / "site-packages"] if renderer == "docker" else ["--python", python]
    image = ["--image", "registry.example/sglang:0.5.23"] if renderer != "systemd" else []
    argv = ["render", renderer, "glm5-nvfp4", *where, *image, "--patch-dir", tmp_path / "mine"]
    code, out, err = cli(*argv, "--set", "env.SM120KIT_X=1")
    assert (code, out) == (2, "") and "known failure example on sglang" in err and "Traceback" not in err, err
    assert cli(*argv)[0] == 0
    code, out, err = cli(*argv, "--set", "env.SM120KIT_X=1", "--allow-known-failure", "example")
    assert code == 0 and "allowed by --allow-known-failure example" in err, err
    if renderer != "k8s":  # the unit's and the container's serve judges it again at its start
        assert "--allow-known-failure example" in out or "- --allow-known-failure" in out, out
