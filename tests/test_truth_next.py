"""Every command a command tells the user to run next (its `next:` line, a check's fix, a
warning, the "would change" line) is one that works when pasted: it names the target the
command was given (--python EXE or --site DIR, shell-quoted), the profile, and the
--profile-dir / --patch-dir it was given, wherever the command named takes them, and the
real CLI's parser reads it (issue 31, item 11: after `status --python ENV`, "run `sm120kit
patch`" patched sm120kit's own interpreter; after `serve glm5-nvfp4 --check`, "`sm120kit
serve --no-patch-check`" named no profile).

The walk runs the commands on real sglang 0.5.23 in a site directory whose path holds a
space, each in a state that makes it print a follow-up, and reads every command in
backticks in what it printed (a rendered file excepted: its comments describe the file).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from support.node import SM120_NVML as SM120
from support.node import node_tree as node
from support.sites import install
from support.standin import make_env_python

from sm120kit.cli import build_parser

PROFILE = "glm5-nvfp4"
IN_BACKTICKS = re.compile(r"`(sm120kit(?: [^`]*)?)`")
SITE_TARGET = "site"
PYTHON_TARGET = "python"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """sglang 0.5.23 unpatched in a site whose path has a space, the same as a python's
    environment (the stand-in's shim), an empty profile and patch directory each, and a
    node to replay for doctor."""
    root = tmp_path_factory.mktemp("truth next")
    site = root / "my site" / "site-packages"
    site.mkdir(parents=True)
    install(site, "0.5.23")
    (root / "env").mkdir()
    python = make_env_python(root / "env", "0.5.23")
    profiles, patches = root / "my profiles", root / "my patches"
    profiles.mkdir()
    patches.mkdir()
    (profiles / "glm5-next.toml").write_text('extends = "glm5-nvfp4"\nsglang = ">=0.6"\n')
    nvml = root / "nvml.json"
    nvml.write_text(json.dumps(SM120))
    return {
        "site": site,
        "python": python,
        "profiles": profiles,
        "patches": patches,
        "nvml": nvml,
        "root": node(root / "node"),
    }


# (id, the target kind, the profile the commands are about, the command line: a word in
# braces is the world's path of that name, {dirs} the profile and patch directories)
WALK = [
    ("status", SITE_TARGET, None, "status --site {site} --patch-dir {patches}"),
    ("status --python", PYTHON_TARGET, None, "status --python {python}"),
    ("patch --check", SITE_TARGET, None, "patch --check --site {site}"),
    ("unpatch --only", SITE_TARGET, None, "unpatch --site {site} --patch-dir {patches} --only nope"),
    (
        "serve --check",
        PYTHON_TARGET,
        PROFILE,
        f"serve {PROFILE} --check --python {{python}} --set engine.max_running_requests=64 {{dirs}}",
    ),
    ("serve --site", SITE_TARGET, PROFILE, f"serve {PROFILE} --site {{site}} {{dirs}}"),
    ("serve --dry-run, sglang too old", SITE_TARGET, "glm5-next", "serve glm5-next --dry-run --site {site} {dirs}"),
    (
        "serve --allow-known-failure",
        PYTHON_TARGET,
        PROFILE,
        f"serve {PROFILE} --check --python {{python}} --allow-known-failure nope {{dirs}}",
    ),
    ("doctor", SITE_TARGET, None, "doctor --nvml {nvml} --root {root} --site {site} --patch-dir {patches}"),
    (
        "doctor --profile",
        SITE_TARGET,
        PROFILE,
        f"doctor --nvml {{nvml}} --root {{root}} --profile {PROFILE} --site {{site}} {{dirs}}",
    ),
    (
        "profile check",
        SITE_TARGET,
        PROFILE,
        f"profile check {PROFILE} --site {{site}} --capability 12.0 --set engine.attention_backend=trtllm_mla "
        "--profile-dir {profiles}",
    ),
    ("bench --site", SITE_TARGET, PROFILE, f"bench {PROFILE} --site {{site}} {{dirs}}"),
    (
        "bench --vary",
        PYTHON_TARGET,
        PROFILE,
        f"bench {PROFILE} --vary engine.max_running_requests=64,128 --python {{python}} {{dirs}}",
    ),
    ("render systemd --site", SITE_TARGET, PROFILE, f"render systemd {PROFILE} --site {{site}} {{dirs}}"),
    (
        "render docker",
        SITE_TARGET,
        PROFILE,
        f"render docker {PROFILE} --image registry.example/glm5:1 --site {{site}} "
        "--set engine.attention_backend=trtllm_mla {dirs}",
    ),
]


def command_line(template: str, w: dict) -> list[str]:
    """The walk's command line with the world's paths (one word each, spaces and all)."""
    dirs = ["--profile-dir", str(w["profiles"]), "--patch-dir", str(w["patches"])]
    words: list[str] = []
    for word in template.split():
        words += dirs if word == "{dirs}" else [str(w[word[1:-1]])] if word.startswith("{") else [word]
    return words


def followups(out: str, err: str) -> list[str]:
    """Every `sm120kit ...` in backticks, with the lines that wrapping continued joined."""
    return IN_BACKTICKS.findall(re.sub(r"\n[ \t]+", " ", f"{out}\n{err}"))


def bare_next_commands(err_and_out: str) -> list[str]:
    """A `next:` that names an sm120kit command outside backticks (so spelled by no one)."""
    verbs = "|".join(map(re.escape, sorted(_verbs(build_parser()), key=len, reverse=True)))
    found = []
    for line in re.sub(r"\n[ \t]+", " ", err_and_out).splitlines():
        _, said, hint = line.partition("next:")
        if said and re.search(rf"\bsm120kit ({verbs})\b", IN_BACKTICKS.sub("", hint)):
            found.append(line)
    return found


def _verbs(parser) -> list[str]:
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def parsed(text: str):
    """The command as the real CLI's parser reads it (argparse exits on what it cannot read)."""
    words = shlex.split(text)
    assert words[0] == "sm120kit", text
    parser = build_parser()
    try:
        return parser.parse_args(words[1:]), parser
    except SystemExit:
        pytest.fail(f"the CLI's parser does not read the printed command: {text}")


def takes(parser, args, option: str) -> bool:
    return any(option in a.option_strings for a in parser.chosen(args)._actions)


def assert_spelled(text: str, w: dict, target: str, profile: str | None, given: list[str]) -> None:
    args, parser = parsed(text)
    if takes(parser, args, "--python"):
        if target == PYTHON_TARGET:
            assert args.python == str(w["python"]) and not args.site, f"{text}: not the target --python"
        else:  # a command that runs the target's python gets the placeholder a site cannot fill
            assert args.site == str(w["site"]) or args.python == "EXE", f"{text}: not the target --site"
    chosen = parser.chosen(args)
    positional = next((a.dest for a in chosen._actions if not a.option_strings and a.dest in ("name", "profile")), None)
    if profile and (positional or takes(parser, args, "--profile")):
        named = getattr(args, positional or "profile")
        assert named in (profile, [profile]), f"{text}: not profile {profile}"
    for option, dest, key in (("--profile-dir", "profile_dir", "profiles"), ("--patch-dir", "patch_dir", "patches")):
        if option in given and takes(parser, args, option):
            assert getattr(args, dest) == [str(w[key])], f"{text}: {option} {w[key]} left out"
    sets = [given[i + 1] for i, word in enumerate(given) if word == "--set"]
    if sets and profile and takes(parser, args, "--set"):  # the same profile, as it was changed
        assert args.sets == sets, f"{text}: --set {sets} left out"


@pytest.mark.parametrize("target, profile, template", [pytest.param(*x[1:], id=x[0]) for x in WALK])
def test_every_printed_follow_up_names_the_target_and_the_profile(cli, world, target, profile, template):
    words = command_line(template, world)
    code, out, err = cli(*words)
    if words[0] == "render":
        out = ""  # the unit, compose file or manifest: its comments describe it, they are no next step
    printed = followups(out, err)
    assert printed, f"`sm120kit {shlex.join(words)}` printed no follow-up (exit {code}):\n{out}\n{err}"
    assert bare_next_commands(f"{out}\n{err}") == []
    for text in printed:
        assert_spelled(text, world, target, profile, words)


def strings(value: object) -> list[str]:
    """Every string of a JSON document."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def _takes_json(template: str) -> bool:
    """Whether the walk's command takes --json, as the verb's own parser says."""
    import argparse

    parser = build_parser()
    for word in template.split():
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return any("--json" in a.option_strings for a in parser._actions)


@pytest.mark.parametrize(
    "target, profile, template", [pytest.param(*x[1:], id=x[0]) for x in WALK if _takes_json(x[3])]
)
def test_every_follow_up_in_a_json_document_is_spelled_as_the_text_spells_it(cli, world, target, profile, template):
    """--json: a fix, a hint, a detail names the command the human output names (HEAD: the
    error document only; a check's fix said `sm120kit patch`, for sm120kit's own python)."""
    words = command_line(template, world)
    code, out, err = cli(*words, "--json")
    # a rendered file is the document: its comments describe it, they are no next step
    found = [] if words[0] == "render" else strings(json.loads(out))
    printed = [f for text in found for f in IN_BACKTICKS.findall(text)] + followups("", err)
    assert printed, f"`sm120kit {shlex.join(words)} --json` printed no follow-up (exit {code}):\n{out}\n{err}"
    for text in printed:
        assert_spelled(text, world, target, profile, words)


def test_status_python_says_to_patch_that_python(cli, world):
    """The issue's own case, as a user reads it."""
    code, out, _ = cli("status", "--python", world["python"], "--wide")
    assert code == 1
    assert f"would change: run `sm120kit patch --python {shlex.quote(str(world['python']))}` to apply" in out


def test_serve_check_names_the_profile_in_its_fixes(cli, world):
    code, out, _ = cli("serve", PROFILE, "--check", "--python", world["python"], "--wide")
    assert code != 0
    assert f"`sm120kit serve {PROFILE} --no-patch-check --python {shlex.quote(str(world['python']))}`" in out


def test_an_error_document_carries_the_same_next_step(cli, world):
    code, doc = cli.json("serve", PROFILE, "--site", world["site"])
    assert code == 2
    assert f"`sm120kit serve {PROFILE} --python EXE`" in doc["hint"]


def test_a_lost_patch_and_a_foreign_edit_say_to_patch_the_same_site(cli, tmp_path):
    """`patch` then a reinstall: status says to re-apply on that site; an edit by hand
    since: patch --verify refuses, and its next steps name the site too."""
    site = tmp_path / "a site" / "site-packages"
    site.mkdir(parents=True)
    install(site, "0.5.23")
    assert cli("patch", "--site", site)[0] == 0
    install(site, "0.5.23")  # pip install --force-reinstall: the patches are lost
    code, out, err = cli("status", "--site", site, "--wide")
    assert code == 1 and "was lost" in out
    printed = followups(out, err)
    assert any("re-apply" in line and shlex.quote(str(site)) in line for line in out.splitlines())
    assert cli("patch", "--site", site)[0] == 0
    edited = next(p for p in (site / "sglang").rglob("forward_mha.py"))
    edited.write_text(edited.read_text() + "\n# edited by hand\n")
    code, out, err = cli("patch", "--verify", "--site", site, "--wide")
    assert code == 2
    printed += followups(out, err)
    w = {"site": site}
    for text in printed:
        assert_spelled(text, w, SITE_TARGET, None, [])
    assert any(shlex.split(t)[1] == "unpatch" for t in printed), printed


def test_a_stale_tuned_table_says_to_tune_again_for_that_environment(cli, world, tmp_path):
    """status and patch --verify on a site whose Triton moved since tune-moe: tune again
    there (tune-moe times kernels: for a site, its python)."""
    from support.tune import KIMI_K2_FP8_TP8 as KIMI
    from support.tune import configs, meta, release, set_triton

    from sm120kit.tune.install import install_table

    site = tmp_path / "tuned site" / "site-packages"
    site.mkdir(parents=True)
    install_table(release(site, "0.5.10.post1"), configs(1), meta("0.5.10.post1", KIMI))
    set_triton(site, "3.7.1")  # pip install -U triton
    printed = []
    for command_line in (["status"], ["patch", "--verify"]):
        _, out, err = cli(*command_line, "--site", site)
        printed += [t for t in followups(out, err) if "tune-moe" in t]
    assert printed and all(shlex.split(t)[1:3] == ["tune-moe", "kimi-k2-fp8"] for t in printed), printed
    for text in printed:
        assert_spelled(text, {**world, "site": site}, SITE_TARGET, None, [])


def test_the_helper_spells_a_follow_up_for_the_invocation():
    """command() outside a command line repeats nothing; inside one, the parser's options."""
    from sm120kit import followup
    from sm120kit.followup import command

    assert command("patch", "--verify") == "sm120kit patch --verify"
    parser = build_parser()
    args = parser.parse_args(["serve", "my profile.toml", "--check", "--site", "/x y/site", "--set", "a.b=1"])
    with followup.invoked(followup.invocation_of(parser, args)):
        assert command("patch") == "sm120kit patch --site '/x y/site'"
        assert command("serve", "--no-gpu-check") == (
            "sm120kit serve 'my profile.toml' --no-gpu-check --python EXE --set a.b=1"
        )
        assert (
            command("serve", "--dry-run") == "sm120kit serve 'my profile.toml' --dry-run --site '/x y/site' --set a.b=1"
        )
        assert command("profiles") == "sm120kit profiles"
        assert followup.complete("or `sm120kit patch` or `unpatch`; `sm120kit ps`") == (
            "or `sm120kit patch --site '/x y/site'` or `unpatch`; `sm120kit ps`"
        )
        twin = "`sm120kit tune-moe other-profile`"  # a profile named on purpose keeps its own settings
        assert followup.complete(twin) == "`sm120kit tune-moe other-profile --python EXE`"
        prose = "`sm120kit bench --vary/--variants` wrote it"  # not a command the parser reads: as it is
        assert followup.complete(prose) == prose
        # the name a profile file loads as is that file: spelled as it was typed
        assert followup.complete("`sm120kit profile check my profile`") == "`sm120kit profile check my profile`"
        assert followup.complete("`sm120kit profile check 'my profile'`") == (
            "`sm120kit profile check 'my profile.toml' --site '/x y/site' --set a.b=1`"
        )
