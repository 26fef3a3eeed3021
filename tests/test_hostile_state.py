"""Hostile or damaged state never steers a write outside the target: ledgers and journals
that name paths outside it, symbolic links out of the state directory, ledgers with the
wrong types, damaged RECORD and METADATA, and an interpreter that never answers."""

from __future__ import annotations

import json
import os
import shutil
import time

import psutil
import pytest
from support.sites import install
from support.tree import tree_snapshot

from sm120kit import target as target_module
from sm120kit.errors import UserError
from sm120kit.patching.ledger import sha256

DSA = "sglang-dsa-page-table-guard"
FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"


@pytest.fixture
def patched(site, cli):
    install(site, "0.5.23", flashinfer=False)
    assert cli("patch", "--site", site)[0] == 0
    return site


@pytest.fixture
def victim(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "victim.txt"
    path.write_text("precious\n")
    return path


def ledger_doc(site) -> dict:
    return json.loads((site / ".sm120kit" / "ledger.json").read_text())


def write_ledger(site, doc: dict) -> None:
    (site / ".sm120kit" / "ledger.json").write_text(json.dumps(doc))


def everything(site, victim) -> dict:
    return {**tree_snapshot(site), "victim": victim.read_bytes(), "outside": sorted(os.listdir(victim.parent))}


@pytest.mark.parametrize(
    "where, says",
    [
        ("../outside/victim.txt", "leaves (or does not name a file in) the target"),
        ("absolute", "is not a relative path inside the target"),
    ],
)
def test_a_ledger_path_outside_the_target_is_refused(patched, victim, cli, where, says):
    path = str(victim) if where == "absolute" else where
    doc = ledger_doc(patched)
    entry = doc["files"].pop(f"sglang:{FORWARD_MHA}")
    # The victim's bytes as "ours", the file's backup as the "vendor" bytes to restore.
    entry.update(path=path, patched_sha256=sha256(victim.read_bytes()))
    doc["files"][f"sglang:{path}"] = entry
    write_ledger(patched, doc)
    before = everything(patched, victim)
    for command in (["unpatch"], ["unpatch", "--force"], ["patch"]):
        code, out, err = cli(*command, "--site", patched)
        assert code == 2 and "the sm120kit ledger is damaged" in err and says in err, err
        assert "Traceback" not in out + err
        assert everything(patched, victim) == before
    code, out, err = cli("status", "--site", patched)  # read-only: reported, and the markers still judge the code
    assert code == 2 and "the sm120kit ledger is damaged" in err and f"{DSA}" in out and "already-applied" in out


def test_a_journal_path_outside_the_target_is_left_alone(patched, victim, cli):
    """A hostile journal: it names the victim with its current bytes as 'written' and a
    backup's bytes as the 'old' ones to roll back to."""
    backup = next((patched / ".sm120kit" / "backups").iterdir())
    journal = {
        "schema": 1,
        "op": "patch",
        "ledger_after": "0" * 64,
        "files": [
            {
                "package": "sglang",
                "path": f"../../{victim.parent.name}/victim.txt",
                "before": backup.name,
                "after": sha256(victim.read_bytes()),
            }
        ],
    }
    (patched / ".sm120kit" / "journal.json").write_text(json.dumps(journal))
    code, out, err = cli("patch", "--verify", "--site", patched)
    assert code == 0, out + err
    assert victim.read_text() == "precious\n"
    assert not (patched / ".sm120kit" / "journal.json").exists()


def test_symlinked_backups_are_refused_and_nothing_outside_is_deleted(patched, victim, cli):
    backups = patched / ".sm120kit" / "backups"
    for p in backups.iterdir():
        p.rename(victim.parent / p.name)
    backups.rmdir()
    backups.symlink_to(victim.parent)
    before = everything(patched, victim)
    for command in (["unpatch"], ["patch", "--verify"], ["status"]):
        code, out, err = cli(*command, "--site", patched)
        assert code == 2 and f"{backups} is a symbolic link" in err and f"rm {backups}" in err, out + err
        assert everything(patched, victim) == before


def test_a_symlinked_state_directory_is_refused(site, victim, cli):
    install(site, "0.5.23", flashinfer=False)
    (site / ".sm120kit").symlink_to(victim.parent)
    before = everything(site, victim)
    code, _out, err = cli("patch", "--site", site)
    assert code == 2 and "is a symbolic link" in err
    assert everything(site, victim) == before


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda e: e.update(patches=DSA), "patches: Input should be a valid dictionary"),
        (lambda e: e.update(patches={DSA: "1"}), "Input should be a valid integer"),
        (lambda e: e.update(vendor_sha256="../../etc/passwd"), "vendor_sha256: String should match pattern"),
        (lambda e: e.pop("patched_sha256"), "patched_sha256: Field required"),
    ],
)
def test_a_ledger_with_wrong_types_is_damaged_not_a_false_success(patched, cli, damage, says):
    doc = ledger_doc(patched)
    damage(doc["files"][f"sglang:{FORWARD_MHA}"])
    write_ledger(patched, doc)
    before = tree_snapshot(patched)
    code, _out, err = cli("unpatch", "--site", patched)
    assert code == 2 and "the sm120kit ledger is damaged" in err and says in err, err
    assert "move it aside" in err and tree_snapshot(patched) == before
    code, doc = cli.json("status", "--site", patched)
    assert (
        code == 2
        and doc["damaged"]
        and {r["outcome"] for r in doc["results"] if r["path"] == FORWARD_MHA} == {"already-applied"}
    )


@pytest.mark.parametrize("text", ["[]", '{"schema": 1, "files": []}', '{"schema": "1"}', "{"])
def test_a_ledger_of_the_wrong_shape_is_damaged(patched, cli, text):
    (patched / ".sm120kit" / "ledger.json").write_text(text)
    code, _out, err = cli("unpatch", "--site", patched)
    assert code == 2 and "the sm120kit ledger is damaged" in err and "Traceback" not in err


def test_record_with_non_utf8_bytes(site, cli):
    install(site, "0.5.23", flashinfer=False)
    record = next(site.glob("sglang-*.dist-info")) / "RECORD"
    record.write_bytes(b"sglang/caf\xe9.py,sha256=\xff\xfe,12\n" + record.read_bytes())
    code, out, err = cli("status", "--site", site)
    assert code == 1 and "Traceback" not in out + err and "would-apply" in out
    assert (
        "RECORD is not valid UTF-8 (a damaged installation)" in err
        and "pip install --force-reinstall --no-deps sglang==0.5.23" in err
    )
    assert cli("patch", "--verify", "--site", site)[0] == 0
    code, doc = cli.json("unpatch", "--site", site)
    assert code == 0 and all(r["detail"] == "matches the wheel's RECORD" for r in doc["results"])


def test_metadata_with_a_version_that_is_not_pep440(site, cli):
    install(site, "0.5.23", flashinfer=False)
    metadata = next(site.glob("sglang-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.23", "Version: 0.5.23-custom build", 1))
    code, _out, err = cli("status", "--site", site)
    assert code == 2 and "sglang's version '0.5.23-custom build' is not a PEP 440 version" in err
    assert "pip install --force-reinstall --no-deps sglang" in err and "Traceback" not in err


def test_an_interpreter_that_hangs_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pids}\nsleep 300\n")
    python.chmod(0o755)
    monkeypatch.setattr(target_module, "PYTHON_TIMEOUT_S", 1.0)
    with pytest.raises(UserError, match="no answer within 1 s; it was stopped, with what it started"):
        target_module.resolve_target(python=str(python))
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while (
        psutil.pid_exists(child)
        and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_an_interpreter_that_fails_is_a_clear_error(tmp_path, cli):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'boom' >&2\nexit 3\n")
    python.chmod(0o755)
    code, _, err = cli("status", "--python", python)
    assert code == 2 and "could not ask that interpreter for its site directories (exit 3: boom)" in err
    code, _, err = cli("status", "--python", tmp_path / "nope")
    assert code == 2 and "cannot run it" in err


def test_a_ledger_with_a_bad_timestamp_is_damaged(patched, cli):
    doc = ledger_doc(patched)
    doc["files"][f"sglang:{FORWARD_MHA}"]["patched_at"] = "yesterday"
    write_ledger(patched, doc)
    code, _, err = cli("unpatch", "--site", patched)
    assert code == 2 and "patched_at: Value error, Invalid isoformat string: 'yesterday'" in err


def test_verify_is_not_green_when_unpatch_could_not_restore(patched, cli):
    """The ledger moved aside (as a damaged-ledger hint says) and the backups gone: the code
    is still patched, and nothing could give the vendor's bytes back."""
    (patched / ".sm120kit" / "ledger.json").rename(patched / "ledger.json.bad")
    shutil.rmtree(patched / ".sm120kit" / "backups")
    code, out, err = cli("patch", "--verify", "--site", patched)
    assert code == 2 and "verified" not in out
    assert f"{FORWARD_MHA}: patched code without a ledger entry, so `unpatch` cannot restore it" in err


def test_a_ledger_entry_for_a_file_no_patch_rewrites_is_refused(patched, victim, cli):
    """An editable "evil" distribution whose source tree is outside: its file is named by
    no patch, so no write may follow the entry there."""
    evil = patched / "evil-1.0.dist-info"
    evil.mkdir()
    (evil / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n\n")
    (evil / "direct_url.json").write_text(
        json.dumps({"url": f"file://{victim.parent}", "dir_info": {"editable": True}})
    )
    doc = ledger_doc(patched)
    entry = dict(
        doc["files"][f"sglang:{FORWARD_MHA}"],
        package="evil",
        path="victim.txt",
        patched_sha256=sha256(victim.read_bytes()),
    )
    doc["files"]["evil:victim.txt"] = entry
    write_ledger(patched, doc)
    before = everything(patched, victim)
    code, _out, err = cli("unpatch", "--site", patched, "--force")
    assert code == 2 and "evil:victim.txt is no file that sglang-dsa-page-table-guard rewrites" in err
    assert everything(patched, victim) == before


def test_a_symbolic_link_inside_the_package_does_not_lead_a_restore_out(patched, victim, cli):
    directory = (patched / FORWARD_MHA).parent
    moved = victim.parent / "methods"
    directory.rename(moved)
    directory.symlink_to(moved)
    before = everything(patched, victim) | {"moved": (moved / "forward_mha.py").read_bytes()}
    code, _out, err = cli("unpatch", "--site", patched)
    assert code == 2 and "outside sglang's install root" in err
    assert everything(patched, victim) | {"moved": (moved / "forward_mha.py").read_bytes()} == before


@pytest.mark.parametrize(
    "damage, says",
    [
        (
            lambda d: d.update(allowed_missing={"nocolon": {"package": "sglang", "version": "0.5.23"}}),
            "is not <package>:<patch id>",
        ),
        (
            lambda d: d["files"].update(
                {"sglang:sglang/srt": dict(d["files"][f"sglang:{FORWARD_MHA}"], path="sglang/srt")}
            ),
            "is no file that",
        ),
    ],
)
def test_other_damage_is_reported_not_an_internal_error(patched, cli, damage, says):
    doc = ledger_doc(patched)
    damage(doc)
    write_ledger(patched, doc)
    code, _out, err = cli("unpatch", "--site", patched)
    assert code == 2 and says in err and "internal error" not in err


def test_unpatch_dry_run_says_an_interrupted_run_comes_first(patched, cli):
    (patched / ".sm120kit" / "journal.json").write_text(
        json.dumps({"schema": 1, "files": [], "ledger_after": "0" * 64})
    )
    _code, _out, err = cli("unpatch", "--dry-run", "--site", patched)
    assert f"`sm120kit unpatch --site {patched}` finishes it first" in err
