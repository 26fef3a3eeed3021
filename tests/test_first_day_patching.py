"""Issue 25, the patch engine's verdicts as a new operator meets them: hand edits are local
edits whatever the code looks like (2); a package that is not installed keeps its upstream
fix (3); an upgrade's notices name the file, and a downgrade is one (4); past the proven
window the code decides, never the release number (6); the state directory goes with the
last patch (15); `status` is never clean where `patch --verify` fails (27); a warm check of
a patched environment does not import pydantic (33)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.sites import install, raise_version, replace_installed, wheel_bytes
from support.tree import tree_snapshot

DSA = "sglang-dsa-page-table-guard"
SMEM = "sglang-triton-smem-sm120"
AUTOTUNE = "sglang-moe-autotune-flashinfer-cutlass"
ARCH = "flashinfer-sm120-arch-suffix"
FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
PREFILL = "sglang/kernels/ops/attention/prefill_attention.py"
GATE = "sglang/srt/model_executor/runner/flashinfer_autotune.py"
MOE_CONFIG = "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"
ARCH_FILE = "flashinfer/compilation_context.py"
REINSTALL = "pip install --force-reinstall --no-deps sglang==0.5.23"

# The anchor of the page-table guard, and the hand fix from the issue (a sed on that line).
ANCHOR = b"kv_indices = backend.forward_metadata.page_table_1_flattened"
HAND_FIX = (
    b'kv_indices = getattr(backend.forward_metadata, "page_table_1_flattened", None) '
    b"or forward_batch.fetch_mha_one_shot_kv_indices()"
)


def rows(doc: dict) -> dict[tuple[str, str | None], dict]:
    return {(r["patch"], r["path"]): r for r in doc["results"]}


def sed(site, relpath: str, old: bytes, new: bytes) -> None:
    """A hand edit: the file changes, RECORD does not."""
    data = (site / relpath).read_bytes()
    assert old in data
    (site / relpath).write_bytes(data.replace(old, new))


@pytest.fixture
def site23(site):
    install(site, "0.5.23", flashinfer=False)
    return site


# -- 2: a hand edit is a local edit, whatever its code looks like ----------------------------


HAND_EDITS = {
    # On HEAD: anchor-missing, "the code is not the shape we know", --allow-missing.
    "on the anchor line": (ANCHOR, ANCHOR.replace(b"page_table_1_flattened", b"page_table_flat")),
    # On HEAD: foreign-edit already (the one case that said so).
    "elsewhere in the file": (b"def ", b"def  "),
    # On HEAD: fixed-upstream, "already falls back", FIXED IN open.
    "that looks like the fix": (ANCHOR, HAND_FIX),
}


@pytest.mark.parametrize("edit", HAND_EDITS.values(), ids=HAND_EDITS.keys())
def test_a_hand_edit_is_a_foreign_edit_that_names_the_file_and_the_way_back(site23, cli, edit):
    sed(site23, FORWARD_MHA, *edit)
    before = tree_snapshot(site23)
    code, doc = cli.json("status", "--site", site23, "--only", DSA)
    [row] = doc["results"]
    assert code == 2 and row["outcome"] == "foreign-edit" and row["error"], row
    assert row["fixed_in"] is None  # `open`: the bug is not fixed upstream
    assert f"{FORWARD_MHA} differs from the wheel's RECORD: it was edited outside sm120kit" in row["detail"]
    assert REINSTALL in row["hint"] and "--allow-missing" not in row["hint"]
    assert "fixed upstream" not in row["detail"]

    code, out, _ = cli("patch", "--site", site23, "--only", DSA, "--wide")
    assert code == 2 and "foreign-edit" in out and "nothing was written" in out
    assert "anchor-missing" not in out and "fixed-upstream" not in out
    assert f"next: {DSA}: reinstall sglang 0.5.23 to get the vendor's bytes back ({REINSTALL})" in out
    assert tree_snapshot(site23) == before


def test_only_a_hand_edit_the_patch_still_applies_to_can_be_forced(site23, cli):
    sed(site23, FORWARD_MHA, *HAND_EDITS["elsewhere in the file"])
    code, doc = cli.json("patch", "--check", "--site", site23, "--only", DSA)
    assert code == 2 and doc["results"][0]["hint"].endswith("or patch over the edit: --force")
    assert cli("patch", "--site", site23, "--only", DSA, "--force")[0] == 0

    install(site23, "0.5.23", flashinfer=False)
    sed(site23, FORWARD_MHA, *HAND_EDITS["that looks like the fix"])
    code, doc = cli.json("patch", "--site", site23, "--only", DSA, "--force")
    assert code == 2 and doc["results"][0]["outcome"] == "foreign-edit"  # nothing to patch over
    assert "--force\n" not in doc["results"][0]["hint"] + "\n"


def test_the_vendors_bytes_keep_anchor_missing_and_fixed_upstream(site23, cli):
    """The same code with RECORD's hash for it is the vendor's: a release that moved the
    anchor, or one that fixed the bug."""
    moved = wheel_bytes("0.5.23", FORWARD_MHA).replace(ANCHOR, HAND_EDITS["on the anchor line"][1])
    replace_installed(site23, "sglang", FORWARD_MHA, moved)
    code, doc = cli.json("status", "--site", site23, "--only", DSA)
    assert code == 2 and doc["results"][0]["outcome"] == "anchor-missing"
    assert "--allow-missing" in doc["results"][0]["hint"]

    fixed = wheel_bytes("0.5.23", FORWARD_MHA).replace(ANCHOR, HAND_FIX)
    replace_installed(site23, "sglang", FORWARD_MHA, fixed)
    code, doc = cli.json("status", "--site", site23, "--only", DSA)
    assert code == 0 and doc["results"][0]["outcome"] == "fixed-upstream"
    assert "already falls back" in doc["results"][0]["detail"]


def test_a_file_removed_by_hand_is_a_local_edit_not_a_moved_anchor(site23, cli):
    (site23 / FORWARD_MHA).unlink()  # RECORD still lists it
    code, doc = cli.json("status", "--site", site23, "--only", DSA)
    [row] = doc["results"]
    assert code == 2 and row["outcome"] == "foreign-edit" and "removed outside sm120kit" in row["detail"]
    assert REINSTALL in row["hint"]


def test_a_patched_file_edited_later_is_a_foreign_edit(site23, cli):
    """HEAD: already-applied, exit 0, while `patch --verify` failed on the same file."""
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    with open(site23 / FORWARD_MHA, "a") as fh:
        fh.write("# a local hotfix\n")
    code, doc = cli.json("status", "--site", site23, "--only", DSA)
    [row] = doc["results"]
    assert code == 2 and row["outcome"] == "foreign-edit"
    assert "edited outside sm120kit after it was patched (the patch is in place)" in row["detail"]
    # spelled for this site, as the text says it
    assert f"`sm120kit unpatch --force --site {site23}` gives back the vendor's bytes" in row["hint"]
    assert REINSTALL in row["hint"]
    assert cli("patch", "--verify", "--site", site23, "--only", DSA)[0] == 2
    assert cli("unpatch", "--site", site23, "--force")[0] == 0
    assert (site23 / FORWARD_MHA).read_bytes() == wheel_bytes("0.5.23", FORWARD_MHA)


# -- 3: not installed keeps the upstream fix --------------------------------------------------


def test_a_package_that_is_not_installed_keeps_its_upstream_fix(site23, cli):
    """HEAD: FIXED IN `open` for the flashinfer patches, and fixed_in null."""
    _, doc = cli.json("status", "--site", site23)
    flashinfer = {r["patch"]: r for r in doc["results"] if r["package"] == "flashinfer-python"}
    assert {p: (r["outcome"], r["fixed_in"]) for p, r in flashinfer.items()} == {
        ARCH: ("not-applicable", "0.6.7"),
        "flashinfer-sm120-gemm-gdc": ("not-applicable", "0.6.7"),
        "flashinfer-sm120-fused-moe-gdc": ("not-applicable", "0.6.8"),
    }
    for command in (["status"], ["patch", "--verify"]):
        _, out, _ = cli(*command, "--site", site23, "--wide")
        table = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("flashinfer-")}
        assert {p: cells[4] for p, cells in table.items()} == {
            ARCH: "0.6.7",
            "flashinfer-sm120-gemm-gdc": "0.6.7",
            "flashinfer-sm120-fused-moe-gdc": "0.6.8",
        }, out


def test_a_patch_outside_its_releases_says_when_each_part_was_fixed(site, cli):
    install(site, "0.5.9", flashinfer=False)
    _, out, _ = cli("status", "--site", site, "--only", "sglang-nvfp4-moe-runner-sm120", "--wide")
    [line] = [line for line in out.splitlines() if line.startswith("sglang-nvfp4-moe-runner-sm120")]
    assert line.split()[3:5] == ["not-applicable", "open"]  # no release fixed it: open is right


# -- 4: upgrade notices name the file; a downgrade is one ------------------------------------


def test_upgrade_and_downgrade_notices_name_the_file(site, cli):
    """HEAD: one patch was "lost …; re-applied" and "lost …; not needed any more" without
    the file either line is about, and 0.5.14 -> 0.5.10 was "lost in the upgrade"."""
    install(site, "0.5.11", flashinfer=False)
    assert cli("patch", "--site", site)[0] == 0
    install(site, "0.5.14", flashinfer=False)
    code, out, _ = cli("patch", "--site", site, "--wide")  # each notice on one line
    assert code == 0, out
    head = f"sglang 0.5.11 -> 0.5.14: patch {SMEM} was lost from"
    assert f"{head} sglang/srt/layers/attention/triton_ops/prefill_attention.py in the upgrade; re-applied" in out
    assert f"{head} {MOE_CONFIG} in the upgrade; not needed any more (fixed upstream in 0.5.14)" in out
    assert (
        f"patch {AUTOTUNE} was lost from sglang/srt/model_executor/model_runner.py in the upgrade; "
        "its code is now in sglang/srt/model_executor/runner/base_runner.py: not needed any more" in out
    )

    install(site, "0.5.10", flashinfer=False)
    code, out, _ = cli("status", "--site", site, "--wide")
    assert code == 1 and "in the upgrade" not in out
    assert (
        f"sglang 0.5.14 -> 0.5.10: patch {DSA} was lost from {FORWARD_MHA} in the downgrade; "
        f"run `sm120kit patch --site {site}` to re-apply it" in out
    )


def test_a_reinstall_notice_names_the_file(site23, cli):
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    install(site23, "0.5.23", flashinfer=False)
    _, out, _ = cli("status", "--site", site23, "--only", DSA, "--wide")
    assert (
        f"sglang 0.5.23: patch {DSA} was lost ({FORWARD_MHA} was reinstalled); run `sm120kit patch --site {site23}`"
        in out
    )


# -- 6: past the proven window, the code decides ---------------------------------------------


@pytest.fixture
def dev(site):
    """0.5.23 and the flashinfer-python it pins as the next releases past both windows."""
    install(site, "0.5.23")
    raise_version(site, "sglang", "0.5.24.dev0")
    raise_version(site, "flashinfer-python", "0.7.5")
    return site


# The regressions: the autotune list without flashinfer_cutlass, the low-shared-
# memory MoE default switched off; and flashinfer's 120f rule gone.
REGRESSIONS = {
    (AUTOTUNE, GATE): (b'        "flashinfer_cutlass",\n        "flashinfer_megamoe"', b'        "flashinfer_megamoe"'),
    (SMEM, MOE_CONFIG): (b"if _use_low_smem_fp8_default():", b"if False:"),
    (ARCH, ARCH_FILE): (b'"0f"', b'"0a"'),
}


def regress(site, record: bool) -> None:
    for (_, path), (old, new) in REGRESSIONS.items():
        if record:  # as the release's own wheel would have it
            data = (site / path).read_bytes()
            assert old in data
            package = "flashinfer-python" if path.startswith("flashinfer/") else "sglang"
            replace_installed(site, package, path, data.replace(old, new))
        else:
            sed(site, path, old, new)


def test_past_the_window_fixed_upstream_is_read_from_the_code(dev, cli):
    """HEAD: "fixed upstream in 0.5.13 (by version; proven …)", and proven: true."""
    code, doc = cli.json("status", "--site", dev)
    assert code == 1
    fixed = {k: r for k, r in rows(doc).items() if r["outcome"] == "fixed-upstream"}
    assert set(fixed) >= {(AUTOTUNE, GATE), (SMEM, MOE_CONFIG), (ARCH, ARCH_FILE)}
    for (_, path), r in fixed.items():
        assert not r["proven"] and "by version" not in r["detail"], r
        package, version = (
            ("flashinfer-python", "0.7.5") if path.startswith("flashinfer/") else ("sglang", "0.5.24.dev0")
        )
        assert f"(read from the code of {package} {version}; proven " in r["detail"], r
    assert "is in the autotune list" in fixed[(AUTOTUNE, GATE)]["detail"]
    assert {f["patch"] for f in doc["unproven"]} == {
        r["patch"] for r in doc["results"] if r["outcome"] == "would-apply"
    }


def test_past_the_window_a_regression_is_never_verified(dev, cli):
    """The issue's release: HEAD said fixed-upstream by version for all three, exit 0, verified."""
    regress(dev, record=True)
    before = tree_snapshot(dev)
    code, out, _ = cli("patch", "--verify", "--site", dev, "--wide")
    assert code == 2 and "verified" not in out and "nothing was written" in out
    assert tree_snapshot(dev) == before
    code, doc = cli.json("status", "--site", dev)
    found = rows(doc)
    assert {k: (found[k]["outcome"], found[k]["proven"]) for k in REGRESSIONS} == {
        (AUTOTUNE, GATE): ("anchor-missing", False),  # not the shape it knows: cannot decide
        (SMEM, MOE_CONFIG): ("would-apply", False),  # the old shape: applied by shape, unproven
        (ARCH, ARCH_FILE): ("anchor-missing", False),
    }
    assert "the bug may or may not be fixed in this release" in found[(AUTOTUNE, GATE)]["detail"]
    assert not any(r["outcome"] == "fixed-upstream" and r["proven"] for r in doc["results"])


@pytest.mark.parametrize("version", ["0.5.23", "0.5.24.dev0"])
def test_a_relabelled_copy_with_hand_edits_is_judged_alike_in_and_past_the_window(site, cli, version):
    install(site, "0.5.23")
    if version != "0.5.23":
        raise_version(site, "sglang", version)
    regress(site, record=False)
    code, doc = cli.json("patch", "--check", "--site", site)
    found = rows(doc)
    assert code == 2
    assert found[(AUTOTUNE, GATE)]["outcome"] == found[(SMEM, MOE_CONFIG)]["outcome"] == "foreign-edit"


# -- 15: the state directory goes with the last patch -----------------------------------------


def test_unpatch_of_the_last_patch_leaves_no_state_directory(site23, cli):
    """HEAD: <site>/.sm120kit/ stayed, with an empty ledger, the lock and backups/."""
    assert cli("patch", "--site", site23, "--only", DSA, "--only", SMEM)[0] == 0
    assert cli("unpatch", "--site", site23, "--only", DSA)[0] == 0
    assert (site23 / ".sm120kit" / "ledger.json").exists()  # SMEM is still there to restore
    assert cli("unpatch", "--site", site23)[0] == 0
    assert not (site23 / ".sm120kit").exists()
    assert cli("status", "--site", site23)[0] == 1  # and nothing misses it

    # A run that writes nothing leaves none either (HEAD: a directory holding the lock).
    assert cli("patch", "--site", site23, "--only", AUTOTUNE)[0] == 0
    assert not (site23 / ".sm120kit").exists()


def test_a_state_directory_holding_something_else_stays(site23, cli):
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    (site23 / ".sm120kit" / "ledger.json.bad").write_text("{}")  # a ledger the user moved aside
    assert cli("unpatch", "--site", site23)[0] == 0
    assert sorted(p.name for p in (site23 / ".sm120kit").iterdir()) == ["ledger.json.bad"]


# -- 27: status is never clean where patch --verify fails --------------------------------------


def lose_ledger(site) -> None:
    """The ledger and the backups with it (a ledger alone is rebuilt from the backups:
    tests/test_truth_patch_cycle.py)."""
    (site / ".sm120kit" / "ledger.json").unlink()
    lose_backups(site)


def lose_backups(site) -> None:
    for backup in (site / ".sm120kit" / "backups").iterdir():
        backup.unlink()


@pytest.mark.parametrize(
    "damage, says",
    [
        (lose_ledger, f"{FORWARD_MHA}: patched code without a ledger entry, so `unpatch` cannot restore it"),
        (lose_backups, f"sglang:{FORWARD_MHA}: the backup of its vendor bytes is missing or damaged"),
    ],
    ids=["ledger and backups deleted", "backups deleted"],
)
def test_status_fails_where_verify_fails(site23, cli, damage, says):
    """HEAD: `status` exited 0 while `patch --verify` and `unpatch` refused."""
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    damage(site23)
    before = tree_snapshot(site23)
    code, out, err = cli("status", "--site", site23, "--only", DSA, "--wide")
    assert code == 2 and says in err and REINSTALL in err, out + err
    code, doc = cli.json("patch", "--check", "--site", site23, "--only", DSA)
    assert code == 2 and any(says in problem for problem in doc["unrestorable"])
    assert tree_snapshot(site23) == before
    assert cli("patch", "--verify", "--site", site23, "--only", DSA)[0] == 2
    assert cli("unpatch", "--site", site23)[0] == 2
    assert (site23 / FORWARD_MHA).read_bytes() == before[FORWARD_MHA]


# -- 33: a warm check of a patched environment does not import pydantic ----------------------


def check_in_a_subprocess(site, cache) -> tuple[int, bool]:
    """`patch --check --only DSA` as a user runs it, with the outcome cache `cache`: (its
    exit code, whether it imported pydantic)."""
    code = (
        "import contextlib, io, sys\n"
        "from sm120kit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main(['patch', '--check', '--site', {str(site)!r}, '--only', {DSA!r}])\n"
        "print(code, 'pydantic' in sys.modules)\n"
    )
    env = {**os.environ, "SM120KIT_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    exit_code, imported = done.stdout.split()
    return int(exit_code), imported == "True"


def test_a_warm_check_of_a_patched_site_skips_the_schema_import(site23, cli, tmp_path):
    """HEAD: every run that found a ledger imported pydantic (~75 ms) to validate it."""
    assert cli("patch", "--site", site23, "--only", DSA)[0] == 0
    cache = tmp_path / "cold"
    assert check_in_a_subprocess(site23, cache) == (0, True)  # an empty cache: validated in full
    assert check_in_a_subprocess(site23, cache) == (0, False)

    # A ledger the schema has not seen is validated in full, and damage is still damage.
    ledger = site23 / ".sm120kit" / "ledger.json"
    doc = json.loads(ledger.read_text())
    doc["files"][f"sglang:{FORWARD_MHA}"]["patches"] = {DSA: "1"}
    ledger.write_text(json.dumps(doc))
    code, _, err = cli("status", "--site", site23)
    assert code == 2 and "the sm120kit ledger is damaged" in err and "patches" in err
    assert check_in_a_subprocess(site23, cache) == (2, True)
