"""Issue 31, user directories and user data: every command gives the same answer about them.

- A user directory (--patch-dir, --profile-dir, their variables) that this user cannot
  read is one line naming it and why, exit 2, in every command; a `known-failures.toml`
  there that is not a file is refused too, never passed over.
- A user patch with a range (or fixed_in) that PEP 440 cannot read names its file.
- A --python whose site answer is nested too deeply, and a site's damaged direct_url.json,
  are bad input, not a RecursionError.
- A user's own survey entry needs an id, a range, and a symptom or a rule; the shipped
  survey keeps its test-data rules. A list of validation errors names each error once.

Unreadable is made real, not imitated: root's bypass of file permissions is dropped for
the child (setpriv takes CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH out of its bounding and
inheritable sets), so the kernel refuses the directory as it would for any other user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import FIXTURE_PATCHES
from support.sites import install, patch_dir
from support.tree import tree_snapshot

from sm120kit import search_paths
from sm120kit.catalogue.survey import FILENAME, load_survey, read_file
from sm120kit.errors import UserError
from sm120kit.target import Distribution

WITHOUT_ROOTS_BYPASS = [
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
]


def _as_a_user(locked: Path) -> list[str]:
    """The prefix that runs a child as a user the permissions of `locked` (mode 000) bind."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: cannot drop root's bypass of file permissions")
    probe = [sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(locked)]
    if subprocess.run([*WITHOUT_ROOTS_BYPASS, *probe], capture_output=True).returncode == 0:
        pytest.skip("setpriv could not drop root's bypass of file permissions here")
    return WITHOUT_ROOTS_BYPASS


def _sm120kit(prefix: list[str], *argv: object) -> tuple[int, str]:
    proc = subprocess.run([*prefix, sys.executable, "-m", "sm120kit", *map(str, argv)], capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def locked(tmp_path):
    """A user directory with mode 000 (given back its mode afterwards, for pytest's cleanup)."""
    directory = tmp_path / "locked"
    (directory / "sglang").mkdir(parents=True)
    shutil.copy(FIXTURE_PATCHES / "sglang" / "version_marker.py", directory / "sglang")
    directory.chmod(0)
    yield directory
    directory.chmod(0o755)


# -- 4. an unreadable user directory ------------------------------------------------------


def test_an_unreadable_patch_dir_is_one_line_in_every_command(site, locked):
    """known-failures and serve --dry-run ended in PermissionError; patches, status and
    patch --check dropped the user's patches without a word (green without reading them)."""
    install(site, "0.5.23", flashinfer=False)
    prefix = _as_a_user(locked)
    before = tree_snapshot(site)
    for argv in (
        ["known-failures"],
        ["serve", "glm5-nvfp4", "--dry-run", "--site", site],
        ["patches"],
        ["status", "--site", site],
        ["patch", "--check", "--site", site],
    ):
        code, out = _sm120kit(prefix, *argv, "--patch-dir", locked)
        said = f"patch directory {locked} cannot be read (Permission denied"
        assert code == 2 and said in out and "internal error" not in out and "Traceback" not in out, (argv, out)
        assert f"chmod a+rx {locked}" in out, out
    assert tree_snapshot(site) == before


def test_an_unreadable_profile_dir_is_refused_as_a_missing_one_is(site, locked):
    install(site, "0.5.23", flashinfer=False)
    prefix = _as_a_user(locked)
    for argv in (
        ["profiles"],
        ["profile", "check", "glm5-nvfp4", "--site", site],
        ["serve", "glm5-nvfp4", "--dry-run", "--site", site],
    ):
        code, out = _sm120kit(prefix, *argv, "--profile-dir", locked)
        said = f"profile directory {locked} cannot be read (Permission denied"
        assert code == 2 and said in out and "Traceback" not in out, (argv, out)


def test_an_unreadable_package_directory_inside_a_patch_dir_is_named(tmp_path):
    """Only the sglang/ inside the --patch-dir is locked: its patches were dropped too."""
    mine = patch_dir(
        tmp_path / "mine", "sglang", "marker", (FIXTURE_PATCHES / "sglang" / "version_marker.py").read_text()
    )
    (mine / "sglang").chmod(0)
    try:
        prefix = _as_a_user(mine / "sglang")
        code, out = _sm120kit(prefix, "patches", "--patch-dir", mine)
        assert code == 2 and f"patch directory {mine / 'sglang'} cannot be read" in out, out
    finally:
        (mine / "sglang").chmod(0o755)


def test_an_unreadable_directory_from_the_variable_names_the_variable(tmp_path, monkeypatch):
    """The one check every search goes through: os.access answers for this user (root
    here, so it is made to answer as it does for another user)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: False if Path(path) == locked else real(path, mode, **kw)
    )
    monkeypatch.setenv("SM120KIT_PATCH_PATH", str(locked))
    with pytest.raises(UserError) as caught:
        search_paths.search_path("patches", "--patch-dir", "SM120KIT_PATCH_PATH", None, tmp_path)
    assert (
        str(caught.value.message)
        == f"patch directory {locked} cannot be read (Permission denied: it needs read and search permission)"
    )
    assert caught.value.hint.endswith("or leave it out of $SM120KIT_PATCH_PATH")


def test_a_directory_named_known_failures_toml_is_refused(cli, tmp_path):
    """It was passed over (exit 0): the user's survey ignored without a word."""
    (tmp_path / "mine" / FILENAME).mkdir(parents=True)
    code, out, err = cli("known-failures", "--patch-dir", tmp_path / "mine")
    assert code == 2 and f"{tmp_path / 'mine' / FILENAME} is not a file" in err and not out, err


# -- 5. a user patch whose range PEP 440 cannot read -------------------------------------

BANANA = (FIXTURE_PATCHES / "sglang" / "version_marker.py").read_text()


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (
            BANANA.replace('Rewrite("sglang/version.py", ">=0.5.9,<0.5.24"', 'Rewrite("sglang/version.py", "banana"'),
            "the rewrite of sglang/version.py has versions 'banana', not a PEP 440 range",
        ),
        (
            BANANA.replace("    summary=", '    fixed_in="banana",\n    summary='),
            "PATCH.fixed_in is 'banana', not a release",
        ),
    ],
    ids=["range", "fixed_in"],
)
def test_a_user_patch_with_an_invalid_range_names_its_file(cli, site, tmp_path, source, said):
    install(site, "0.5.23", flashinfer=False)
    mine = patch_dir(tmp_path / "mine", "sglang", "bad", source)
    before = tree_snapshot(site)
    for argv in (["patches"], ["status", "--site", site], ["patch", "--site", site]):
        code, _, err = cli(*argv, "--patch-dir", mine)
        assert code == 2 and f"{mine / 'sglang' / 'bad.py'}: {said}" in err, (argv, err)
        assert "internal error" not in err and "Invalid" not in err, err
    assert tree_snapshot(site) == before


# -- 6. JSON nested too deeply -------------------------------------------------------------


def test_a_python_whose_site_answer_is_nested_too_deeply_is_bad_input(cli, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n" + "[" * 100_000 + "]" * 100_000 + "\nEOF\n")
    fake.chmod(0o755)
    code, _, err = cli("status", "--python", fake)
    assert code == 2 and "did not answer as a Python interpreter would" in err, err
    assert "RecursionError" not in err and "internal error" not in err


@pytest.mark.parametrize(
    "damage",
    ["[" * 100_000 + "]" * 100_000, "[]", '{"dir_info": true, "url": 1}'],
    ids=["nested-too-deeply", "a-list", "fields-of-other-types"],
)
def test_a_damaged_direct_url_json_is_not_an_editable_install(cli, site, damage):
    """direct_url.json (PEP 610) is read to find an editable install's source tree: a damaged
    one (nested too deeply, or of another shape) is read as none, not a crash."""
    dist_info = install(site, "0.5.23", flashinfer=False)
    (dist_info / "direct_url.json").write_text(damage)
    assert Distribution("sglang", "0.5.23", site, dist_info).editable_root is None
    code, out, err = cli("status", "--site", site)
    assert code == 1 and "internal error" not in err, out + err


# -- 10. a user's own survey entry ---------------------------------------------------------

SHIPPED_STYLE = """
[[failure]]
id = "example"
title = "an example"
package = "sglang"
affected = ">=0.5.20"
checked = "0.5.23"
upstream = ["https://github.com/sgl-project/sglang/issues/1"]
symptom = "boom"
evidence = "nowhere"
answer = "compiled"
avoid = "--attention-backend flashinfer"
advice = "avoid it"
"""

# What an operator knows of a failure their own tracker follows: no GitHub link, no
# evidence read in a wheel, no test profile.
OWN = """
[[failure]]
id = "ours-gpu-42"
affected = ">=0.5.20"
upstream = ["https://tracker.example.com/browse/GPU-42"]
symptom = "boom at layer \\\\d+"

[[failure]]
id = "ours-port-rule"
affected = ">=0.5.20"
[failure.rule]
when = [{ flag = "--port", in = ["30000"] }]
"""


def _mine(tmp_path: Path, text: str) -> Path:
    (tmp_path / "mine").mkdir(exist_ok=True)
    (tmp_path / "mine" / FILENAME).write_text(text)
    return tmp_path / "mine"


def test_a_users_own_entry_needs_an_id_a_range_and_a_symptom_or_a_rule(cli, tmp_path):
    mine = _mine(tmp_path, OWN)
    code, doc = cli.json("known-failures", "--patch-dir", mine)
    assert code == 0
    listed = {f["id"]: f for f in doc["failures"]}
    assert listed["ours-gpu-42"]["upstream"] == ["https://tracker.example.com/browse/GPU-42"]
    assert listed["ours-gpu-42"]["title"] == "ours-gpu-42" and listed["ours-gpu-42"]["package"] == "sglang"
    assert listed["ours-port-rule"]["answer"] == "rule"
    code, out, err = cli("known-failures", "--patch-dir", mine)
    assert code == 0 and "ours-gpu-42" in out and "ours-port-rule" in out, err

    neither = _mine(tmp_path, '[[failure]]\nid = "ours-1"\naffected = ">=0.5.20"\n')
    code, out, err = cli("known-failures", "--patch-dir", neither)
    assert code == 2 and "failure[0] (ours-1): needs a `symptom` (for diagnose) or a [failure.rule]" in err, err


def test_a_users_own_rule_refuses_and_its_symptom_is_diagnosed(cli, site, tmp_path, monkeypatch):
    install(site, "0.5.23", flashinfer=False)
    mine = _mine(tmp_path, OWN)
    code, out, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, "--patch-dir", mine)
    assert code == 2 and "known failure ours-port-rule on sglang 0.5.23" in err and not out, err
    assert "--allow-known-failure ours-port-rule" in err and "Traceback" not in err

    from sm120kit.serve import diagnose

    monkeypatch.setenv("SM120KIT_PATCH_PATH", str(mine))  # (diagnose takes no --patch-dir)
    diagnose.signatures.cache_clear()
    try:
        log = tmp_path / "server.log"
        log.write_text("rank 0: boom at layer 7\n")
        code, doc = cli.json("diagnose", log)
    finally:
        diagnose.signatures.cache_clear()
    [found] = [d for d in doc["diagnoses"] if d["id"] == "ours-gpu-42"]
    assert "https://tracker.example.com/browse/GPU-42" in found["advice"] and code == 1, doc


def test_the_shipped_survey_keeps_its_test_data_rules(tmp_path):
    """Read as the shipped file, an entry without evidence, with a tracker's link, or a rule
    without its test profile is refused; read as a user's, it is taken."""
    text = (
        SHIPPED_STYLE.replace('evidence = "nowhere"\n', "")
        .replace("https://github.com/sgl-project/sglang/issues/1", "https://tracker.example.com/browse/GPU-1")
        .replace('answer = "compiled"', 'answer = "rule"')
        + '[failure.rule]\nwhen = [{ flag = "--port", in = ["30000"] }]\n'
    )
    path = _mine(tmp_path, text) / FILENAME
    with pytest.raises(UserError) as caught:
        read_file(path)
    message = caught.value.message
    assert "failure[0] (example).upstream" in message and "failure[0] (example).evidence" in message
    assert "failure[0] (example).rule.profile: required in the shipped survey" in message, message
    [entry] = read_file(path, users=True)
    assert entry.evidence is None and entry.rule is not None and entry.rule.profile is None


def test_a_list_of_validation_errors_names_each_once(cli, tmp_path):
    """The first error was repeated verbatim at the head of "and N more: ..."."""
    text = "severity = 3\nowner = 1\n" + SHIPPED_STYLE.replace('title = "an example"', "title = 5")
    mine = _mine(tmp_path, text)
    code, out, err = cli("known-failures", "--patch-dir", mine)
    assert code == 2 and not out, err
    assert err.count("Extra inputs are not permitted") == 2, err
    assert err.count("Input should be a valid string") == 1 and "(and 2 more:" in err, err
    with pytest.raises(UserError) as caught:
        load_survey([str(mine)])
    assert "failure.0" not in caught.value.message  # each named as the first is: failure[0] (example).title
