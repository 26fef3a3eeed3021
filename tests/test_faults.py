"""Bad input and faults: a clear message, exit 2, and nothing changed on disk."""

from __future__ import annotations

import os

import pytest
from filelock import FileLock
from support.paths import FIXTURE_PATCHES
from support.sites import install, patch_dir, replace_installed
from support.tree import tree_snapshot

from sm120kit.patching import transaction

GATE = "sglang/srt/model_executor/model_runner.py"


@pytest.fixture
def site10(site):
    install(site, "0.5.10")
    return site


def assert_refused(cli, site, *argv, says: str):
    before = tree_snapshot(site)
    code, out, err = cli(*argv)
    assert code == 2, out + err
    assert says in err, err
    assert "Traceback" not in out + err
    assert tree_snapshot(site) == before
    return err


def test_unknown_patch_id(cli, site10):
    err = assert_refused(
        cli, site10, "patch", "--site", site10, "--only", "no-such-patch", says="unknown patch id 'no-such-patch'"
    )
    assert "sm120kit patches" in err


def test_target_without_sglang(cli, site):
    err = assert_refused(
        cli, site, "patch", "--site", site, says="none of flashinfer-python, sglang is installed in site"
    )
    assert "--python" in err
    only = ("--only", "sglang-dsa-page-table-guard")
    assert_refused(cli, site, "patch", "--site", site, *only, says="sglang is not installed in site")


def test_missing_site_dir(cli, tmp_path):
    code, _, err = cli("status", "--site", tmp_path / "nope")
    assert code == 2 and "no such directory" in err


def test_read_only_file(cli, site10):
    os.chmod(site10 / GATE, 0o444)
    err = assert_refused(cli, site10, "patch", "--site", site10, says="read-only")
    assert GATE in err and "0444" in err


def test_foreign_edit_is_refused_then_forced(cli, site10):
    with open(site10 / GATE, "a") as fh:
        fh.write("# a local hotfix\n")
    code, out, _err = cli("patch", "--site", site10)
    assert code == 2 and "foreign-edit" in out and "nothing was written" in out
    code, out, _ = cli("patch", "--site", site10, "--force")
    assert code == 0 and "applied" in out
    # unpatch gives back the bytes it found (the hotfix included) and says they are not RECORD's.
    code, out, _ = cli("unpatch", "--site", site10)
    assert code == 0 and "differ from RECORD" in out
    assert (site10 / GATE).read_text().endswith("# a local hotfix\n")


def test_anchor_missing(cli, site10):
    data = (
        (site10 / GATE)
        .read_bytes()
        .replace(b"if backend_str not in [", b"if self.server_args.moe_runner_backend not in [")
    )
    replace_installed(site10, "sglang", GATE, data)
    before = tree_snapshot(site10)
    code, out, _ = cli("patch", "--site", site10)
    assert code == 2 and "anchor-missing" in out and "expected one `if backend_str not in [...]`" in out
    assert tree_snapshot(site10) == before


def test_failure_between_two_writes_rolls_back(cli, site10, monkeypatch):
    real = transaction.write_atomic
    targets = []

    def fail_second_target(path, data):
        if ".sm120kit" not in path.parts:
            targets.append(path)
            if len(targets) == 2:
                raise OSError(28, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(transaction, "write_atomic", fail_second_target)
    before = {p: b for p, b in tree_snapshot(site10).items() if not p.startswith(".sm120kit")}
    only = ("--only", "sglang-moe-autotune-flashinfer-cutlass", "--only", "test-version-marker")
    code, out, err = cli("patch", "--site", site10, "--patch-dir", FIXTURE_PATCHES, *only)
    assert code == 2, out + err
    first, second, rolled_back = targets
    assert rolled_back == first
    assert f"writing {second} failed ([Errno 28] No space left on device): the disk holding it, " in err
    assert f"{first}: rolled back" in err and f"{second}: unchanged" in err and "nothing was changed" in err
    after = {p: b for p, b in tree_snapshot(site10).items() if not p.startswith(".sm120kit")}
    assert after == before
    assert not (site10 / ".sm120kit" / "ledger.json").exists() and not (site10 / ".sm120kit" / "journal.json").exists()
    # Both files were meant to change: the transaction did cover two.
    monkeypatch.setattr(transaction, "write_atomic", real)
    code, doc = cli.json("patch", "--site", site10, "--patch-dir", FIXTURE_PATCHES, *only)
    assert code == 0 and [r["outcome"] for r in doc["results"]] == ["applied"] * 3


def test_concurrent_run_is_refused(cli, site10):
    (site10 / ".sm120kit").mkdir()
    with FileLock(str(site10 / ".sm120kit" / "lock")):
        assert_refused(cli, site10, "patch", "--site", site10, says="another sm120kit run is changing")
        assert_refused(cli, site10, "unpatch", "--site", site10, says="another sm120kit run is changing")


def test_broken_user_patch_module(cli, site10, tmp_path):
    mine = patch_dir(tmp_path / "mine", "sglang", "oops", "PATCH = 1 / 0\n")
    err = assert_refused(cli, site10, "patch", "--site", site10, "--patch-dir", mine, says="failed to load")
    assert "oops.py" in err and "ZeroDivisionError" in err


def test_missing_patch_dir(cli, site10, tmp_path):
    assert_refused(cli, site10, "status", "--site", site10, "--patch-dir", tmp_path / "nope", says="does not exist")


def test_json_error_document(cli, site):
    code, doc = cli.json("status", "--site", site)
    assert code == 2 and "is installed in site" in doc["error"] and doc["hint"]


def test_lost_ledger_is_still_recognised(cli, site10):
    assert cli("patch", "--site", site10)[0] == 0
    for path in sorted((site10 / ".sm120kit").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    code, doc = cli.json("status", "--site", site10, "--only", "sglang-moe-autotune-flashinfer-cutlass")
    [row] = doc["results"]
    assert row["outcome"] == "already-applied" and "state was lost" in row["detail"]
    # In place, but nothing could give the vendor's bytes back: not clean, as --verify is not.
    assert code == 2 and doc["unrestorable"] == [
        f"{GATE}: patched code without a ledger entry, so `unpatch` cannot restore it; "
        "reinstall: pip install --force-reinstall --no-deps sglang==0.5.10"
    ]
    code, out, _err = cli("unpatch", "--site", site10, "--wide")  # each row and its detail on one line
    assert code == 2 and "no-backup" in out and "pip install --force-reinstall --no-deps sglang==0.5.10" in out


def test_reinstall_of_same_version_is_reported(cli, site10):
    assert cli("patch", "--site", site10)[0] == 0
    install(site10, "0.5.10")  # pip install --force-reinstall
    code, out, _ = cli("status", "--site", site10, "--wide")  # each message on one line
    assert code == 1
    assert (
        f"sglang 0.5.10: patch sglang-moe-autotune-flashinfer-cutlass was lost ({GATE} was reinstalled); "
        f"run `sm120kit patch --site {site10}` to re-apply it" in out
    )


def test_write_keeps_mode_and_clears_stale_bytecode(cli, site10):
    os.chmod(site10 / GATE, 0o640)
    cache = (site10 / GATE).parent / "__pycache__"
    cache.mkdir()
    stale = cache / "model_runner.cpython-311.pyc"
    stale.write_bytes(b"stale")
    other = cache / "forward_batch_info.cpython-311.pyc"
    other.write_bytes(b"unrelated")
    assert cli("patch", "--site", site10)[0] == 0
    assert (site10 / GATE).stat().st_mode & 0o777 == 0o640
    assert not stale.exists() and other.exists()


def test_patch_path_environment_variable(cli, site10, monkeypatch):
    monkeypatch.setenv("SM120KIT_PATCH_PATH", str(FIXTURE_PATCHES))
    _code, doc = cli.json("patches")
    sources = {p["id"]: p["source"] for p in doc["patches"]}
    assert sources["sglang-moe-autotune-flashinfer-cutlass"] == "shipped"
    assert sources["test-version-marker"].startswith(str(FIXTURE_PATCHES))


def test_a_user_patch_must_name_the_last_release_it_was_proven_on(cli, site10, tmp_path):
    """Without a top to its range, a newer release could never be told unproven."""
    source = (
        "from sm120kit.patching.spec import AlreadyApplied, Patch, Rewrite\n"
        "PATCH = Patch(id='open-ended', package='sglang', summary='s', why='w',\n"
        "    rewrites=(Rewrite('sglang/version.py', '>=0.5.9', lambda m, c: AlreadyApplied()),))\n"
    )
    mine = patch_dir(tmp_path / "mine", "sglang", "open_ended", source)
    err = assert_refused(
        cli, site10, "status", "--site", site10, "--patch-dir", mine, says="names no last release it was proven on"
    )
    assert "<=X" in err
