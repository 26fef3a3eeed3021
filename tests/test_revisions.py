"""A later sm120kit bumps a patch's revision: code patched at r1 is `outdated` under r2
(never fixed-upstream, never already-applied), `patch` rebuilds it at r2 from the vendor's
bytes in one transaction, and `unpatch` gives back the wheel's bytes from either revision.

For every shipped patch, on a real release where it applies; r2 is a test copy of the
shipped module with its revision raised and its rewrite changed (the marker's words)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
from support.sites import install, patch_dir, record_digest, wheel_bytes
from support.tree import tree_snapshot

from sm120kit.patching.registry import load_patches, shipped_dir

SHIPPED = {p.id: p for p in load_patches()}
FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
# A release (sglang, with the flashinfer it pins) on which each patch writes something.
RELEASE = {
    "sglang-dsa-page-table-guard": "0.5.23",
    "sglang-triton-smem-sm120": "0.5.10",  # context attention and the fp8 MoE default
    "sglang-moe-autotune-flashinfer-cutlass": "0.5.12",
    "flashinfer-sm120-arch-suffix": "0.5.9",  # flashinfer 0.6.3
    "flashinfer-sm120-gemm-gdc": "0.5.9",
    "flashinfer-sm120-fused-moe-gdc": "0.5.9",
    "sglang-trtllm-mla-prefill-sm120": "0.5.23",
    "sglang-nvfp4-moe-runner-sm120": "0.5.23",
    "sglang-trtllm-mha-fp8-kv-sm120": "0.5.23",
    "sglang-dsa-kpool-sm120": "0.5.20",
}


def revision_2(patch_id: str, root) -> str:
    """A patch directory holding the shipped patch at r2, with a changed rewrite."""
    patch = SHIPPED[patch_id]
    source = Path(patch.source).read_text()
    changed = source.replace('marker_line(f"{ctx.marker}: ', 'marker_line(f"{ctx.marker}: (r2) ')
    assert changed != source
    changed = changed.replace("PATCH = Patch(\n", "PATCH = Patch(\n    revision=2,\n", 1)
    return str(patch_dir(root / "r2", patch.package, patch_id.replace("-", "_"), changed))


def package_version(doc: dict, package: str) -> str:
    return next(r["version"] for r in doc["results"] if r["package"] == package)


def markers(site, paths, patch_id) -> set[str]:
    found = set()
    for path in paths:
        found |= set(re.findall(rf"# sm120kit: {re.escape(patch_id)} (r\d+)", (site / path).read_text()))
    return found


def test_every_shipped_patch_has_a_release_here():
    assert set(RELEASE) == set(SHIPPED)
    assert all(p.source.startswith(str(shipped_dir())) for p in SHIPPED.values())


@pytest.mark.parametrize("patch_id", sorted(RELEASE))
def test_outdated_revision_is_rebuilt_and_unpatched(patch_id, site, tmp_path, cli):
    install(site, RELEASE[patch_id])
    package = SHIPPED[patch_id].package
    code, doc = cli.json("patch", "--site", site, "--only", patch_id)
    written = sorted(r["path"] for r in doc["results"] if r["outcome"] == "applied")
    assert code == 0 and written
    version = package_version(doc, package)
    assert markers(site, written, patch_id) == {"r1"}
    r2 = revision_2(patch_id, tmp_path)

    code, doc = cli.json("status", "--site", site, "--patch-dir", r2, "--only", patch_id)
    outcomes = {r["path"]: r["outcome"] for r in doc["results"]}
    assert code == 1
    assert {p: outcomes[p] for p in written} == dict.fromkeys(written, "outdated")
    assert "fixed-upstream" not in {
        outcomes[p] for p in written
    } and "carries r1 of this patch; this sm120kit has r2" in doc["results"][0]["detail"] + "".join(
        r["detail"] for r in doc["results"]
    )
    before = tree_snapshot(site)
    assert cli("patch", "--check", "--site", site, "--patch-dir", r2, "--only", patch_id)[0] == 1
    assert tree_snapshot(site) == before

    code, out, err = cli("patch", "--verify", "--site", site, "--patch-dir", r2, "--only", patch_id, "--wide")
    assert code == 0, out + err
    assert "verified" in out and "rebuilt from the vendor's bytes" in out
    assert markers(site, written, patch_id) == {"r2"}  # not r2 on top of r1

    # The same bytes as r2 applied to a fresh install of that release.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    install(fresh, RELEASE[patch_id])
    assert cli("patch", "--site", fresh, "--patch-dir", r2, "--only", patch_id)[0] == 0
    assert all((site / p).read_bytes() == (fresh / p).read_bytes() for p in written)
    code, doc = cli.json("status", "--site", site, "--patch-dir", r2, "--only", patch_id)
    assert code == 0 and {r["outcome"] for r in doc["results"] if r["path"] in written} == {"already-applied"}

    code, doc = cli.json("unpatch", "--site", site, "--patch-dir", r2)
    assert code == 0 and {r["outcome"] for r in doc["results"]} == {"restored"}
    for path in written:
        data = (site / path).read_bytes()
        assert data == wheel_bytes(version, path, package)
        assert hashlib.sha256(data).digest() == record_digest(site, package, path)


@pytest.mark.parametrize("patch_id", ["sglang-dsa-page-table-guard", "flashinfer-sm120-arch-suffix"])
def test_unpatch_restores_an_older_revision(patch_id, site, tmp_path, cli):
    """r1 on disk, r2 loaded: unpatch needs no rebuild, only the backup."""
    install(site, RELEASE[patch_id])
    code, doc = cli.json("patch", "--site", site, "--only", patch_id)
    written = [r["path"] for r in doc["results"] if r["outcome"] == "applied"]
    version = package_version(doc, SHIPPED[patch_id].package)
    code, doc = cli.json("unpatch", "--site", site, "--patch-dir", revision_2(patch_id, tmp_path))
    assert code == 0 and {r["outcome"] for r in doc["results"]} == {"restored"}
    assert all((site / p).read_bytes() == wheel_bytes(version, p, SHIPPED[patch_id].package) for p in written)


def test_outdated_without_state_cannot_be_rebuilt(site, tmp_path, cli):
    """The ledger is gone: the vendor's bytes are too. An error with the reinstall command;
    nothing written."""
    patch_id = "sglang-dsa-page-table-guard"
    install(site, "0.5.23")
    assert cli("patch", "--site", site, "--only", patch_id)[0] == 0
    shutil.rmtree(site / ".sm120kit")
    r2 = revision_2(patch_id, tmp_path)
    before = tree_snapshot(site)
    for command in (["status"], ["patch"], ["patch", "--verify"]):
        code, doc = cli.json(*command, "--site", site, "--patch-dir", r2, "--only", patch_id)
        [row] = doc["results"]
        assert code == 2 and row["outcome"] == "outdated" and row["error"]
        assert "cannot be rebuilt: no ledger entry for this file" in row["detail"]
        assert "pip install --force-reinstall --no-deps sglang==0.5.23" in row["hint"]
    assert tree_snapshot(site) == before
    code, doc = cli.json("unpatch", "--site", site, "--patch-dir", r2)
    assert code == 2 and doc["results"][0]["outcome"] == "no-backup"


def test_a_marker_of_r1_is_not_one_of_r10(site, tmp_path, cli):
    """The engine compares revisions as numbers: r1's code under r10 is outdated."""
    patch_id = "sglang-dsa-page-table-guard"
    install(site, "0.5.23")
    assert cli("patch", "--site", site, "--only", patch_id)[0] == 0
    r10 = revision_2(patch_id, tmp_path)
    module = next((tmp_path / "r2" / "sglang").glob("*.py"))
    module.write_text(module.read_text().replace("revision=2,", "revision=10,"))
    code, doc = cli.json("status", "--site", site, "--patch-dir", r10, "--only", patch_id)
    assert code == 1 and doc["results"][0]["outcome"] == "outdated"


def test_a_revision_that_finds_the_fix_upstream_leaves_the_vendor_bytes_unrecorded(site, tmp_path, cli):
    """r2 judges the vendor's code fixed upstream: the rebuilt file is the vendor's, and the
    ledger keeps no entry for it (an entry with no patch would be damage)."""
    patch_id = "sglang-dsa-page-table-guard"
    install(site, "0.5.23", flashinfer=False)
    assert cli("patch", "--site", site, "--only", patch_id)[0] == 0
    source = (
        "from sm120kit.patching.spec import FixedUpstream, Patch, Rewrite\n"
        "PATCH = Patch(id='sglang-dsa-page-table-guard', package='sglang', summary='s', why='w', revision=2,\n"
        f"    rewrites=(Rewrite({FORWARD_MHA!r}, '>=0.5.9,<=0.5.23', "
        "lambda m, c: FixedUpstream('upstream has it')),))\n"
    )
    patch_dir(tmp_path / "r2", "sglang", "dsa", source)
    code, doc = cli.json("patch", "--site", site, "--patch-dir", tmp_path / "r2", "--only", patch_id)
    assert code == 0, doc
    assert (site / FORWARD_MHA).read_bytes() == wheel_bytes("0.5.23", FORWARD_MHA)
    code, doc = cli.json("status", "--site", site, "--patch-dir", tmp_path / "r2", "--only", patch_id)
    assert code == 0 and doc["results"][0]["outcome"] == "fixed-upstream"
