"""Issue 31, the patch cycle: `status`, `patch --check`, `patch`, `patch --verify` and
`unpatch` give one verdict on the same state, on the real sglang 0.5.23 wheel.

- A patched file removed by hand comes back from sm120kit's backup, proven against RECORD;
  without that backup nothing is written and the state stays.
- A deleted ledger: the backups that match RECORD still restore (and `patch` records the
  entries again); a file edited since needs --force.
- After `pip uninstall sglang`: the ledger's entries for it are stale everywhere, and
  `patch` (or `unpatch`) forgets them.
- The words: a green --verify names a patch let go with --allow-missing; a refused patch
  that says "nothing was changed" leaves no state directory; unpatch's table heads PATCH
  as status does and says a row's file once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from support.sites import install, raise_version, replace_installed, wheel_bytes
from support.tree import tree_snapshot

from sm120kit import wheels
from sm120kit.patching import transaction

DSA = "sglang-dsa-page-table-guard"
FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
MHA_FP8 = "sglang-trtllm-mha-fp8-kv-sm120"
KV_DTYPE = "sglang/srt/mem_cache/kv_cache_dtype.py"
REINSTALL = "pip install --force-reinstall --no-deps sglang==0.5.23"


@pytest.fixture
def site23(site):
    install(site, "0.5.23", flashinfer=False)
    return site


def state(site: Path) -> Path:
    return site / ".sm120kit"


def is_vendor(site: Path, relpath: str) -> bool:
    """The file holds the bytes the wheel's RECORD names (read by wheels, not by the code proven)."""
    return hashlib.sha256((site / relpath).read_bytes()).hexdigest() == wheels.recorded_sha256(site, "sglang")[relpath]


def rows(doc: dict) -> dict[str, dict]:
    return {r["path"]: r for r in doc["results"]}


# -- 1: a patched file removed by hand --------------------------------------------------------


def test_unpatch_restores_a_patched_file_removed_by_hand_from_its_backup(site23, cli):
    """HEAD: "pristine: already the vendor's bytes", exit 0, and the backups/ holding the
    only copy of the vendor's bytes deleted."""
    assert cli("patch", "--site", site23, "--only", MHA_FP8, "--only", DSA)[0] == 0
    (site23 / KV_DTYPE).unlink()

    code, out, _ = cli("status", "--site", site23, "--wide")
    assert code == 2 and "removed outside sm120kit" in out
    assert f"next: {MHA_FP8}: `sm120kit unpatch --site {site23}` restores it from sm120kit's backup" in out

    code, doc = cli.json("unpatch", "--dry-run", "--site", site23)
    assert code == 0 and rows(doc)[KV_DTYPE]["outcome"] == "would-restore"
    assert not (site23 / KV_DTYPE).exists()

    code, doc = cli.json("unpatch", "--site", site23)
    row = rows(doc)[KV_DTYPE]
    assert code == 0 and row["outcome"] == "restored", doc
    assert row["detail"] == "removed outside sm120kit; its backup matches the wheel's RECORD"
    assert is_vendor(site23, KV_DTYPE) and is_vendor(site23, FORWARD_MHA)
    assert not state(site23).exists()  # nothing left to restore: the backups went only now


def test_a_removed_file_without_its_backup_is_refused_and_the_state_kept(site23, cli):
    assert cli("patch", "--site", site23, "--only", MHA_FP8, "--only", DSA)[0] == 0
    (site23 / KV_DTYPE).unlink()
    ledger = json.loads((state(site23) / "ledger.json").read_text())
    vendor = ledger["files"][f"sglang:{KV_DTYPE}"]["vendor_sha256"]
    (state(site23) / "backups" / vendor).unlink()
    before = tree_snapshot(site23)

    code, out, err = cli("unpatch", "--site", site23, "--wide")
    [row] = [line for line in out.splitlines() if line.startswith(KV_DTYPE)]
    assert code == 2 and "no-backup" in row and "removed outside sm120kit" in row and REINSTALL in row
    assert "nothing was written" in err
    assert tree_snapshot(site23) == before  # the other file's backup, and the ledger, stay


def test_a_failed_restore_of_a_removed_file_changes_nothing(site23, cli, monkeypatch):
    """The restore of a file that was absent is a create in the transaction: a write that
    fails takes it back out, and the backup and the ledger stay for the next run."""
    assert cli("patch", "--site", site23, "--only", MHA_FP8)[0] == 0
    (site23 / KV_DTYPE).unlink()
    before = tree_snapshot(site23)
    real = transaction.write_atomic

    def ledger_fails(path, data):
        if path.name == "ledger.json":
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path, data)

    monkeypatch.setattr(transaction, "write_atomic", ledger_fails)
    code, _, err = cli("unpatch", "--site", site23)
    assert code == 2 and "nothing was changed" in err and f"{site23 / KV_DTYPE}: rolled back" in err
    assert tree_snapshot(site23) == before and not (site23 / KV_DTYPE).exists()
    monkeypatch.undo()
    assert cli("unpatch", "--site", site23)[0] == 0 and is_vendor(site23, KV_DTYPE)


# -- 2: a deleted ledger ------------------------------------------------------------------------


def test_unpatch_restores_from_the_backups_when_the_ledger_was_deleted(site23, cli):
    """HEAD: `no-backup` for every file, "reinstall", while backups/ held the vendor's bytes
    under the sha256 RECORD lists; and the first run that took the lock deleted them."""
    assert cli("patch", "--site", site23, "--only", DSA, "--only", MHA_FP8)[0] == 0
    (state(site23) / "ledger.json").unlink()

    code, doc = cli.json("status", "--site", site23)
    assert code == 1 and {r["path"] for r in doc["relearned"]} == {FORWARD_MHA, KV_DTYPE}
    assert any("`sm120kit patch --site" in m and "records them again" in m for m in doc["messages"])
    assert not doc["unrestorable"]

    code, doc = cli.json("unpatch", "--site", site23)
    assert code == 0 and {r["path"]: r["outcome"] for r in doc["results"]} == {
        FORWARD_MHA: "restored",
        KV_DTYPE: "restored",
    }, doc
    assert all(
        r["detail"] == "no ledger entry (the ledger was lost); its backup matches the wheel's RECORD"
        for r in doc["results"]
    )
    assert is_vendor(site23, FORWARD_MHA) and is_vendor(site23, KV_DTYPE)
    assert not state(site23).exists()


def test_patch_records_a_lost_ledger_entry_again(site23, cli):
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    (state(site23) / "ledger.json").unlink()
    code, out, err = cli("patch", "--verify", "--site", site23, "--only", DSA, "--wide")
    assert code == 0 and "records them again" not in out and "recorded again" in out, out + err
    assert "verified" in out
    ledger = json.loads((state(site23) / "ledger.json").read_text())
    entry = ledger["files"][f"sglang:{FORWARD_MHA}"]
    assert entry["vendor_sha256"] == wheels.recorded_sha256(site23, "sglang")[FORWARD_MHA]
    assert cli("unpatch", "--site", site23)[0] == 0 and is_vendor(site23, FORWARD_MHA)


def test_a_file_edited_after_its_ledger_was_lost_needs_force(site23, cli):
    """Without the ledger nothing proves the bytes are sm120kit's alone: every command says
    so, and --force gives back the vendor's bytes from the backup."""
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    (state(site23) / "ledger.json").unlink()
    with open(site23 / FORWARD_MHA, "a") as fh:
        fh.write("# a hotfix after patching\n")
    before = tree_snapshot(site23)

    code, out, err = cli("status", "--site", site23, "--only", DSA, "--wide")
    assert code == 2 and f"`sm120kit unpatch --force --site {site23}` restores them" in err, out + err
    assert "needs a reinstall" not in out
    code, doc = cli.json("unpatch", "--site", site23)
    [row] = doc["results"]
    assert code == 2 and row["outcome"] == "foreign-edit" and "pass --force" in row["detail"]
    assert tree_snapshot(site23) == before

    code, doc = cli.json("unpatch", "--site", site23, "--force")
    assert code == 0 and doc["results"][0]["outcome"] == "restored" and is_vendor(site23, FORWARD_MHA)


# -- 3: after `pip uninstall sglang` ------------------------------------------------------------


@pytest.fixture
def uninstalled(site, cli):
    """sglang 0.5.23 (and the flashinfer it pins) patched, then sglang uninstalled as pip
    does it: every file its RECORD lists and its dist-info go; sm120kit's state stays."""
    install(site, "0.5.23")
    assert cli("patch", "--site", site)[0] == 0
    assert wheels.uninstall(site, "sglang") and not (site / FORWARD_MHA).exists()
    return site


STALE = "sglang is not installed any more, but {ledger} records 6 files sm120kit patched in sglang 0.5.23"


def test_after_pip_uninstall_the_ledger_entries_are_stale_in_every_command(uninstalled, cli):
    """HEAD: status, patch --check and patch exit 0; --verify exits 2 on "the bytes on disk
    are not the ones sm120kit recorded" with no next step; unpatch: "already the vendor's
    bytes"."""
    site, ledger = uninstalled, state(uninstalled) / "ledger.json"
    said = STALE.format(ledger=ledger)
    before = tree_snapshot(site)
    for command in (["status"], ["patch", "--check"]):
        code, out, _ = cli(*command, "--site", site, "--wide")
        assert code == 1 and f"{said}: stale entries, with nothing to restore; `sm120kit patch --site {site}` " in out
        # nothing would be patched: the ledger alone (HEAD: "would change: run `sm120kit patch` to apply")
        assert f"would change: only sm120kit's ledger: run `sm120kit patch --site {site}` to bring it up to date" in out
        code, doc = cli.json(*command, "--site", site)
        [stale] = doc["stale"]
        assert code == 1 and stale["package"] == "sglang" and len(stale["paths"]) == 6 and not stale["forgotten"]
    code, doc = cli.json("unpatch", "--dry-run", "--site", site)
    assert code == 0 and len(doc["results"]) == 6
    assert all(
        r["outcome"] == "stale"
        and r["detail"] == "sglang is not installed any more: nothing to restore; the ledger entry goes"
        for r in doc["results"]
    ), doc
    assert tree_snapshot(site) == before

    code, out, err = cli("patch", "--verify", "--site", site, "--wide")
    assert code == 0 and f"{said}: stale entries, with nothing to restore; forgotten" in out, out + err
    assert "verified" in out and not ledger.exists()
    code, _, _ = cli("status", "--site", site)
    assert code == 0


def test_unpatch_after_pip_uninstall_forgets_the_stale_entries(uninstalled, cli):
    code, doc = cli.json("unpatch", "--site", uninstalled)
    assert code == 0 and [r["outcome"] for r in doc["results"]] == ["stale"] * 6
    assert all(r["version"] == "0.5.23" for r in doc["results"])
    assert not state(uninstalled).exists()


def test_verify_where_the_uninstalled_package_was_the_only_one_forgets_and_passes(site, cli):
    """sglang alone, patched, then uninstalled: `patch --verify` forgets its stale entries and
    has nothing left to prove (HEAD: exit 4, "the change was made ..., then this failed: none of
    flashinfer-python, sglang is installed"); `status` then says nothing is here, as on a site
    sm120kit never touched."""
    install(site, "0.5.23", flashinfer=False)
    assert cli("patch", "--site", site)[0] == 0
    assert wheels.uninstall(site, "sglang")
    code, out, err = cli("patch", "--verify", "--site", site, "--wide")
    assert code == 0, out + err
    assert "stale entries, with nothing to restore; forgotten" in out
    assert "verified: nothing the patches change is installed here any more" in out
    assert not (state(site) / "ledger.json").exists()
    code, out, err = cli("status", "--site", site)
    assert code == 2 and "none of flashinfer-python, sglang is installed" in err


# -- 14: the patch cycle's words ------------------------------------------------------------------


def test_verify_with_allow_missing_names_the_patch_that_is_not_in_place(site, cli):
    """HEAD: "verified: every patch is in place, ..." though one is anchor-missing."""
    install(site, "0.5.23", flashinfer=False)
    raise_version(site, "sglang", "0.5.24")
    anchor = b"_get_mla_kv_buffer_from_fp8_for_dsa"  # upstream renamed the function DSA rewrites
    replace_installed(site, "sglang", FORWARD_MHA, wheel_bytes("0.5.23", FORWARD_MHA).replace(anchor, anchor + b"_v2"))
    code, out, err = cli("patch", "--verify", "--site", site, "--allow-missing", DSA, "--wide")
    assert code == 0, out + err
    assert "verified: every patch is in place" not in out
    assert (
        f"verified: every patch but {DSA} is in place, fixed upstream or not applicable, and matches the ledger; "
        f"{DSA}: anchor-missing, not in place (allowed with --allow-missing)" in out
    )


def test_a_patch_refused_on_a_read_only_sub_directory_leaves_no_lock(site23, cli, monkeypatch):
    """HEAD: "read-only: .../kv_cache_dtype.py (mode 0644); nothing was changed", with
    .sm120kit/lock created. As root a directory's mode bits stop no write: os.access answers
    as it does for the user who owns the environment, for whom they do."""
    real = os.access

    def as_the_owner(path, mode, **kw):
        if mode & os.W_OK and not os.stat(path).st_mode & 0o200:
            return False
        return real(path, mode, **kw)

    monkeypatch.setattr(os, "access", as_the_owner)
    locked = (site23 / KV_DTYPE).parent
    locked.chmod(0o555)
    before = tree_snapshot(site23)
    try:
        code, out, err = cli("patch", "--site", site23, "--wide")
    finally:
        locked.chmod(0o755)
    assert code == 2 and "nothing was changed" in err, out + err
    assert f"read-only: {locked} (mode 0555, the directory of {Path(KV_DTYPE).name})" in err
    assert f"chmod u+w {locked}" in err
    assert tree_snapshot(site23) == before and not state(site23).exists()


def test_unpatch_heads_its_table_as_status_does_and_says_a_file_once(site23, cli):
    """HEAD: headed PATCHES, and a no-backup row printed its file twice (the row's, then
    the detail's)."""
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    shutil.rmtree(state(site23))  # the ledger and the backups: nothing can restore the file
    for wide in ((), ("--wide",)):
        code, out, _ = cli("unpatch", "--site", site23, *wide)
        table = out.split("\n", 1)[1]  # after the target line
        assert code == 2 and "PATCHES" not in table and table.split()[3 if wide else 0] == "PATCH", out
        assert table.count(FORWARD_MHA) == 1, out
        assert "no-backup" in table and "patched code without a ledger entry" in " ".join(table.split())
