"""`sm120kit try`: the whole cycle on the real wheels of two proven sglang releases (and the
flashinfer-python each pins), checked by its facts, not only its exit code: which files the
upgrade wiped, that --verify re-applied them, that unpatch gave back the wheel's bytes; the
scratch directory removed or kept; offline, a bad --release and a step that goes wrong."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

import pytest
from support.sites import WINDOW, flashinfer_pin, patch_dir, wheel_bytes

from sm120kit import wheels

FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
PREFILL = "sglang/kernels/ops/attention/prefill_attention.py"
# pip with no configuration and an index on a closed port: nothing can be downloaded.
OFFLINE = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_RETRIES": "1",
    "PIP_TIMEOUT": "2",
    "PIP_FIND_LINKS": "",
}


def flat(text: str) -> str:
    """A message as one line: what it says, whatever width it was wrapped to."""
    return re.sub(r"\n +", " ", text)


def test_the_cycle_on_the_newest_proven_release(cli):
    # A short --dir: a path is never broken, and pytest's tmp_path alone is near 100 columns.
    tmp_path = Path(tempfile.mkdtemp(prefix="try-", dir="/tmp"))
    try:
        code, out, err = cli("try", "--dir", tmp_path)
        assert list(tmp_path.iterdir()) == []  # the scratch directory is gone
    finally:
        tmp_path.rmdir()
    assert code == 0, out + err
    too_wide = [line for line in (out + err).splitlines() if len(line) > 100]  # the commands run 4 narrower
    assert too_wide == [], "\n".join(too_wide)
    assert out.splitlines()[1:3] == [  # the header wraps too
        "    on sglang 0.5.22 + flashinfer-python 0.7.1, then the upgrade to sglang 0.5.23 +",
        "      flashinfer-python 0.7.2",
    ]
    transcript, summary = out.split("\nsm120kit try: the cycle on real release wheels", 1)
    # Each step is the real command, echoed with its output.
    for command in (
        "$ sm120kit status --site $SITE",
        "$ sm120kit patch --diff --site $SITE",
        "$ sm120kit patch --verify --site $SITE",
        "# in place of `pip install -U sglang==0.5.23 flashinfer-python==0.7.2` (not run)",
        "$ sm120kit unpatch --site $SITE",
        "$ sm120kit serve glm5-nvfp4 --dry-run --site $SITE",
    ):
        assert command in transcript
    assert f"    {FORWARD_MHA}  +" in transcript and "in the upgrade; re-applied" in transcript  # the diff's stat
    assert "--tp-size 8" in transcript
    assert summary.count("\n  ok      ") == 9 and "FAILED" not in summary
    for fact in (
        "sglang 0.5.22 + flashinfer-python 0.7.1 installed in a scratch site",
        "status: 6 patches would apply (6 files); 6 parts fixed upstream",
        "upgrade to sglang 0.5.23 + flashinfer-python 0.7.2: 6 patched files wiped (vendor bytes)",
        "status: 6 patches lost in the upgrade (6 files)",
        "patch --verify: 6 of the 6 lost files re-applied and verified",
        "unpatch: 6 files byte-identical to the wheel, sha256 as in its RECORD",
        "profile glm5-nvfp4 renders for sglang 0.5.23 to 29 arguments",
        "every step did what the cycle expects.",
    ):
        assert fact in summary, summary
    assert len(summary.splitlines()) <= 24  # one screen


def test_json_and_keep_on_another_release(tmp_path, cli):
    """0.5.9 -> 0.5.10: eight patched files wiped, two of them fixed upstream in 0.5.10; the
    kept site holds the wheel's bytes after unpatch."""
    code, doc = cli.json("try", "--release", "0.5.10", "--dir", tmp_path, "--keep")
    assert code == 0 and doc["ok"] and doc["exit_code"] == 0, doc
    assert doc["from"] == {"sglang": "0.5.9", "flashinfer-python": flashinfer_pin("0.5.9")}
    assert doc["to"] == {"sglang": "0.5.10", "flashinfer-python": flashinfer_pin("0.5.10")}
    assert [s["name"] for s in doc["steps"] if s["ok"]] == [s["name"] for s in doc["steps"]] and not doc["not_run"]
    assert len(doc["lost"]) == 8 and sorted(doc["reapplied"] + doc["not_needed"]) == sorted(doc["lost"])
    assert len(doc["not_needed"]) == 2 and doc["restored"]
    assert doc["profile"] == {"name": "glm5-nvfp4", "sglang": "0.5.10", "arguments": 26}
    site = tmp_path / os.path.basename(doc["scratch"]) / "site-packages"
    assert site.is_dir()
    for path in doc["restored"]:
        package = "sglang" if path.startswith("sglang/") else "flashinfer-python"
        assert (site / path).read_bytes() == wheel_bytes(doc["to"][package], path, package)
    assert not list(site.glob(".sm120kit/backups/*"))


def test_keep_prints_the_site(tmp_path, cli):
    code, out, _ = cli("try", "--dir", tmp_path, "--keep")
    assert code == 0
    [scratch] = tmp_path.iterdir()
    assert f"scratch site kept: SITE={scratch / 'site-packages'}" in flat(out)
    # The site is the newest proven release, unpatched: status shows the patches to apply.
    assert (scratch / "site-packages" / PREFILL).read_bytes() == wheel_bytes(WINDOW[-1], PREFILL)
    assert cli("status", "--site", scratch / "site-packages")[0] == 1


def test_offline_is_a_clear_error_and_leaves_nothing(tmp_path, cli, monkeypatch):
    for name, value in {**OFFLINE, "SM120KIT_WHEEL_CACHE": str(tmp_path / "empty-cache")}.items():
        monkeypatch.setenv(name, value)
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    code, out, err = cli("try", "--dir", scratch_parent)
    assert code == 2 and out == ""
    err = flat(err)
    assert (
        "sm120kit: error: cannot fetch sglang==0.5.22, which is not in the wheel cache "
        f"({tmp_path / 'empty-cache'}): cannot reach the package index for sglang==0.5.22 (no network?)"
    ) in err
    assert "next: on a machine with network, `sm120kit try` downloads the wheels" in err
    assert "Traceback" not in err and list(scratch_parent.iterdir()) == []


def test_offline_names_the_wheel_it_lacks(tmp_path, cli, monkeypatch):
    """The sglang wheels are cached, the flashinfer-python one is not: it says which."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for version in WINDOW[-2:]:
        wheel = wheels.fetch("sglang", version)
        (cache / wheel.name).symlink_to(wheel)
    for name, value in {**OFFLINE, "SM120KIT_WHEEL_CACHE": str(cache)}.items():
        monkeypatch.setenv(name, value)
    code, doc = cli.json("try", "--dir", tmp_path)
    pin = flashinfer_pin(WINDOW[-2])
    assert code == 2 and doc["error"].startswith(f"cannot fetch flashinfer-python=={pin}, which is not in the wheel")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


@pytest.mark.parametrize(
    "release, says",
    [
        ("0.5.24", "--release 0.5.24: not a release sm120kit is proven on (sglang 0.5.9–0.5.23)"),
        ("latest", "--release latest: not a release sm120kit is proven on (sglang 0.5.9–0.5.23)"),
        ("0.5.9", "--release 0.5.9: the cycle upgrades to it from the proven release before it, and 0.5.9 is"),
    ],
)
def test_a_release_outside_the_window_is_refused(tmp_path, cli, release, says):
    code, _, err = cli("try", "--release", release, "--dir", tmp_path)
    err = flat(err)
    assert code == 2 and f"sm120kit: error: {says}" in err, err
    assert "next: choose one of 0.5.10" in err and list(tmp_path.iterdir()) == []


def test_a_missing_dir_is_refused(tmp_path, cli):
    code, _, err = cli("try", "--dir", tmp_path / "nowhere")
    err = flat(err)
    assert code == 2 and f"--dir {tmp_path / 'nowhere'}: not a directory" in err


def test_an_unwritable_dir_is_refused_before_any_download(tmp_path, cli, monkeypatch):
    """Offline and nothing cached: had it fetched first, the error would be about the wheels."""
    for name, value in {**OFFLINE, "SM120KIT_WHEEL_CACHE": str(tmp_path / "empty-cache")}.items():
        monkeypatch.setenv(name, value)
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o500)
    if os.access(parent, os.W_OK):  # root writes anywhere: what anyone else gets there
        mkdir = os.mkdir

        def refused(path, *args, **kwargs):
            if os.path.dirname(path) == str(parent):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", refused)
    code, out, err = cli("try", "--dir", parent)
    assert code == 2 and out == ""
    err = flat(err)
    assert f"sm120kit: error: cannot make the scratch directory in --dir {parent}: Permission denied" in err
    assert "next: give --dir a directory you can write to" in err and "Traceback" not in err
    assert list(parent.iterdir()) == [] and not (tmp_path / "empty-cache").exists()


@pytest.mark.parametrize("cache", ["a-file", "a-file/wheels"])
def test_a_wheel_cache_that_cannot_be_made_is_a_user_error(tmp_path, cli, monkeypatch, cache):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("SM120KIT_WHEEL_CACHE", str(tmp_path / cache))
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    code, out, err = cli("try", "--dir", scratch_parent)
    assert code == 2 and out == "" and "internal error" not in err
    err = flat(err)
    why = "a file, not a directory" if cache == "a-file" else "Not a directory"
    assert f"error: cannot use {tmp_path / cache} as the wheel cache ($SM120KIT_WHEEL_CACHE): {why}" in err
    assert "next: point $SM120KIT_WHEEL_CACHE at a directory you can write to" in err
    assert list(scratch_parent.iterdir()) == []


def test_a_command_that_answers_with_an_error_fails_its_step(tmp_path, cli, monkeypatch):
    """A damaged site (its ledger a symbolic link out of it): `status --json` answers
    {"error": ...}; the step fails with that error (no KeyError, no "internal error") and
    the rest is not run."""
    from sm120kit import tryout

    install = tryout._step_install

    def install_then_damage(run, step):
        shown = install(run, step)
        (run.site / ".sm120kit").mkdir()
        (run.site / ".sm120kit" / "ledger.json").symlink_to(tmp_path / "elsewhere.json")
        return shown

    monkeypatch.setattr(tryout, "_step_install", install_then_damage)
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    code, doc = cli.json("try", "--dir", scratch_parent)
    assert code == 1 and not doc["ok"], doc
    status = doc["steps"][1]
    assert status["name"] == "status" and status["exit_code"] == 2 and not status["ok"]
    assert status["problem"].startswith("`sm120kit status --json` answered with an error (exit 2): ")
    assert f"ledger.json is a symbolic link (to {tmp_path / 'elsewhere.json'})" in status["problem"]
    assert "; stderr: next: remove the link (rm " in status["problem"]
    assert doc["not_run"][0] == "patch --diff" and list(scratch_parent.iterdir()) == []


def test_a_step_that_goes_wrong_is_named_and_the_rest_not_run(tmp_path, cli, monkeypatch):
    """A user patch whose anchor moved: status reports an error, so the cycle stops there."""
    source = (
        "from sm120kit.patching.spec import AnchorMissing, Patch, Rewrite\n"
        "PATCH = Patch(id='user-moved-anchor', package='sglang', summary='a user patch', why='a test',\n"
        "    rewrites=(Rewrite('sglang/version.py', '>=0.5.9,<=0.5.23',\n"
        "        lambda module, ctx: AnchorMissing('the code moved')),))\n"
    )
    monkeypatch.setenv("SM120KIT_PATCH_PATH", str(patch_dir(tmp_path / "patches", "sglang", "moved", source)))
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    code, out, _ = cli("try", "--dir", scratch_parent)
    assert code == 1
    assert "  FAILED  status: errors on the installed releases: user-moved-anchor: anchor-missing" in out
    assert "  not run: patch --diff, patch --verify, upgrade," in out
    assert "the cycle stopped at `sm120kit status --site $SITE`" in out
    assert "$ sm120kit patch --verify" not in out and list(scratch_parent.iterdir()) == []


def test_help_says_what_it_downloads_and_the_exit_codes(cli):
    with pytest.raises(SystemExit):
        cli("try", "--help")
    out = " ".join(cli.capsys.readouterr().out.split())  # as one line, whatever the terminal's width
    assert "no GPU and no installed sglang needed" in out and "(~/.cache/sm120kit/wheels on Linux)" in out
    assert "exit codes: 0 every step did what the cycle expects 1 a step did not" in out
    assert "2 bad input, or a wheel could not be fetched (offline and not cached)" in out
