"""A release past the proven window: the real sglang 0.5.23 and the flashinfer-python it
pins (0.7.2), with only their versions raised to 0.5.24 and 0.7.5 -- what the next upstream
release looks like for the bugs still open upstream. Every shipped patch gets its outcome,
read from the code as on any release: the open ones run by its shape, the fixed ones are
fixed-upstream as the code shows (never by the release number), every row unproven; a moved
anchor is an error that says what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support.sites import WINDOW, install, patch_dir, raise_version, replace_installed, wheel_bytes
from support.standin import free_port
from support.tree import tree_snapshot

from sm120kit import wheels
from sm120kit.patching.registry import load_patches

UNPROVEN = "unproven on sglang 0.5.24 (proven 0.5.9–0.5.23)"
DSA = "sglang-dsa-page-table-guard"
SMEM = "sglang-triton-smem-sm120"
MLA = "sglang-trtllm-mla-prefill-sm120"
FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
PREFILL = "sglang/kernels/ops/attention/prefill_attention.py"

# (patch, file) -> outcome before patching, and whether the row is unproven: past the window
# every row is, fixed-upstream included (what the code says, on a release nobody proved).
EXPECTED = {
    (DSA, FORWARD_MHA): ("would-apply", True),
    (SMEM, PREFILL): ("would-apply", True),
    (SMEM, "sglang/kernels/ops/attention/extend_attention.py"): ("fixed-upstream", True),
    (SMEM, "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"): ("fixed-upstream", True),
    ("sglang-moe-autotune-flashinfer-cutlass", "sglang/srt/model_executor/runner/flashinfer_autotune.py"): (
        "fixed-upstream",
        True,
    ),
    ("flashinfer-sm120-arch-suffix", "flashinfer/compilation_context.py"): ("fixed-upstream", True),
    ("flashinfer-sm120-gemm-gdc", "flashinfer/jit/gemm/core.py"): ("fixed-upstream", True),
    ("flashinfer-sm120-fused-moe-gdc", "flashinfer/jit/fused_moe.py"): ("fixed-upstream", True),
    ("sglang-trtllm-mla-prefill-sm120", "sglang/srt/arg_groups/overrides.py"): ("would-apply", True),
    ("sglang-nvfp4-moe-runner-sm120", "sglang/srt/layers/quantization/modelopt_quant.py"): ("would-apply", True),
    ("sglang-trtllm-mha-fp8-kv-sm120", "sglang/srt/mem_cache/kv_cache_dtype.py"): ("would-apply", True),
    ("sglang-dsa-kpool-sm120", "sglang/srt/layers/attention/dsa/dsa_backend_kpool.py"): ("would-apply", True),
}


def test_the_patches_end_their_window_where_the_tests_do():
    """A window extended in sm120kit/wheels.py and not in a patch (or the reverse)
    would call a tested release unproven, or an untested one proven."""
    last = {"sglang": WINDOW[-1], "flashinfer-python": wheels.FLASHINFER_PAST_PINS[-1]}
    assert {p.id: p.last_proven for p in load_patches()} == {p.id: last[p.package] for p in load_patches()}


@pytest.fixture
def future(site):
    install(site, "0.5.23")
    raise_version(site, "sglang", "0.5.24")
    raise_version(site, "flashinfer-python", "0.7.5")
    return site


def rows(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["patch"], r["path"]): r for r in doc["results"]}


# The function each open patch rewrites, and the file it lives in.
ANCHORS = {DSA: (FORWARD_MHA, b"_get_mla_kv_buffer_from_fp8_for_dsa"), SMEM: (PREFILL, b"context_attention_fwd")}


def move_anchor(site, patch_id: str = DSA) -> None:
    """0.5.24 as if upstream renamed the function the patch rewrites (RECORD agrees)."""
    path, name = ANCHORS[patch_id]
    replace_installed(site, "sglang", path, wheel_bytes("0.5.23", path).replace(name, name + b"_v2"))


def test_status_triages_a_release_past_the_window(future, cli):
    code, doc = cli.json("status", "--site", future)
    assert code == 1
    found = rows(doc)
    assert {k: (r["outcome"], not r["proven"]) for k, r in found.items()} == EXPECTED
    assert found[(DSA, FORWARD_MHA)]["unproven"] == UNPROVEN
    assert found[(DSA, FORWARD_MHA)]["proven_window"] == "0.5.9–0.5.23"
    assert found[("flashinfer-sm120-arch-suffix", "flashinfer/compilation_context.py")]["detail"] == (
        "fixed upstream in 0.6.7: CompilationContext._normalize_cuda_arch maps SM 12.0 to compute_120f "
        f"with CUDA >= 12.9 (`sm120kit doctor --site {future}` shows the nvcc flashinfer compiles with) "
        "(read from the code of flashinfer-python 0.7.5; proven 0.6.3–0.7.4)"
    )
    assert {(r["patch"], r["path"]) for r in doc["unproven"]} == {  # run by shape: fixed-upstream is not
        k for k, (outcome, _) in EXPECTED.items() if outcome == "would-apply"
    }
    code, out, _ = cli("status", "--site", future, "--wide")  # each line whole, as the assertions quote it
    assert code == 1
    assert f"{UNPROVEN}: {DSA}, {SMEM}, {MLA} (run by the shape of the code)" in out


def test_patch_verify_past_the_window_applies_by_shape_and_says_unproven(future, cli):
    code, out, err = cli("patch", "--verify", "--site", future, "--wide")
    assert code == 0, out + err
    assert "6 fixed-upstream, 6 applied" in out
    assert f"{UNPROVEN}: {DSA}, {SMEM}, {MLA} (run by the shape of the code)" in out
    assert (
        "verified: every patch is in place, fixed upstream or not applicable, and matches the ledger; "
        "unproven on this release" in out
    )
    for path in (FORWARD_MHA, PREFILL):
        assert (future / path).read_bytes() != wheel_bytes("0.5.23", path)

    code, doc = cli.json("status", "--site", future)
    assert code == 0
    assert {k: r["outcome"] for k, r in rows(doc).items() if not r["proven"]} == {
        k: "already-applied" if outcome == "would-apply" else outcome for k, (outcome, _) in EXPECTED.items()
    }

    code, doc = cli.json("unpatch", "--site", future)
    assert code == 0 and {r["outcome"] for r in doc["results"]} == {"restored"}
    assert all((future / path).read_bytes() == wheel_bytes("0.5.23", path) for path in (FORWARD_MHA, PREFILL))


def test_doctor_warns_of_patches_in_place_past_the_window(future, cli):
    """In place but unproven is a warning (as the old doctor said it), not an ok, nor a failure."""
    from pathlib import Path

    from sm120kit.node import registry
    from sm120kit.node.check import Status
    from sm120kit.node.snapshot import Snapshot
    from sm120kit.target import resolve_target

    assert cli("patch", "--site", future)[0] == 0
    node = Snapshot(Path("/"), {}, lambda: {"gpus": []}, resolve_target(site=str(future)))
    [check] = registry.run(("patches",), registry.CheckInputs(node))
    assert check.status is Status.WARN and f"{DSA}: {UNPROVEN}" in check.detail, check
    assert check.fix.startswith("run by the shape of the code") and "--no-patch-check" not in check.fix


@pytest.mark.parametrize("patch_id", sorted(ANCHORS))
def test_a_moved_anchor_past_the_window_is_an_error_and_writes_nothing(future, cli, patch_id):
    move_anchor(future, patch_id)
    path = ANCHORS[patch_id][0]
    before = tree_snapshot(future)
    code, out, _ = cli("patch", "--verify", "--site", future, "--wide")  # a row with its file and detail
    assert code == 2
    assert tree_snapshot(future) == before  # the other open patch, which would apply, is not written either
    row = next(line for line in out.splitlines() if line.startswith(patch_id) and path in line)
    assert (
        "anchor-missing" in row
        and f"{UNPROVEN}: no " in row
        and "the bug may or may not be fixed in this release" in row
    )
    assert (
        f"next: {patch_id}: pin the last proven release (pip install 'sglang==0.5.23'), "
        f"or check upstream's change to {path}" in out
    )
    assert f"to go on without this patch: --allow-missing {patch_id}" in out
    assert "verified" not in out and "nothing was written" in out

    code, doc = cli.json("patch", "--check", "--site", future)
    assert code == 2 and tree_snapshot(future) == before
    row = rows(doc)[(patch_id, path)]
    assert (
        row["outcome"] == "anchor-missing" and row["error"] and not row["proven"] and "--allow-missing" in row["hint"]
    )


def test_allow_missing_goes_on_and_is_recorded_for_that_release(future, cli):
    move_anchor(future)
    code, out, _ = cli("patch", "--verify", "--site", future, "--allow-missing", DSA)
    assert code == 0, out
    assert "6 fixed-upstream, 5 applied, 1 anchor-missing (allowed)" in out and "verified" in out
    assert (future / PREFILL).read_bytes() != wheel_bytes("0.5.23", PREFILL)

    # Recorded: later runs without the flag accept it on this release, and say since when.
    code, doc = cli.json("status", "--site", future)
    dsa = rows(doc)[(DSA, FORWARD_MHA)]
    assert (
        code == 0
        and dsa["allowed"]
        and not dsa["error"]
        and "allowed: `sm120kit patch --allow-missing` on 20" in dsa["detail"]
    )

    # Another release asks again.
    raise_version(future, "sglang", "0.5.25")
    code, doc = cli.json("status", "--site", future)
    assert code == 2 and rows(doc)[(DSA, FORWARD_MHA)]["error"]


@pytest.mark.parametrize("command", [["status"], ["patch", "--check"], ["patch", "--verify"]])
def test_allow_missing_an_unknown_id_is_refused(future, cli, command):
    before = tree_snapshot(future)
    code, _, err = cli(*command, "--site", future, "--allow-missing", "no-such-patch")
    assert code == 2 and "--allow-missing: unknown patch id 'no-such-patch'" in err and "sm120kit patches" in err
    assert tree_snapshot(future) == before


def env_python(root, site):
    """The serving environment's python: this interpreter with `site` on its path, whose
    sglang.launch_server imports nothing the preflight's imports check could miss (the
    trimmed install leaves the real one, which needs torch, out)."""
    (site / "sglang" / "launch_server.py").write_text("# TEST FIXTURE: never run by --check\n")
    shim = root / "python"
    shim.write_text(
        f"#!{sys.executable}\nimport os, sys\nos.environ['PYTHONPATH'] = {str(site)!r}\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    shim.chmod(0o755)
    return shim


def serve_check(python, state, *extra) -> tuple[int, str]:
    argv = [
        sys.executable,
        "-m",
        "sm120kit",
        "serve",
        "glm5-nvfp4",
        "--python",
        str(python),
        "--check",
        "--no-gpu-check",
        "--set",
        f"server.port={free_port()}",
        "--wide",  # each check on one line, as the assertions read it
        *extra,
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, "SM120KIT_STATE_DIR": str(state)}
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_serve_preflight_refuses_a_moved_anchor_with_the_same_words(future, tmp_path, cli):
    move_anchor(future)
    python = env_python(tmp_path, future)
    code, out = serve_check(python, tmp_path / "state")
    assert code == 1
    assert f"FAIL patches: not in place: {DSA}: anchor-missing ({UNPROVEN}: no method" in out
    assert "the bug may or may not be fixed in this release" in out
    assert "pin the last proven release (pip install 'sglang==0.5.23')" in out and f"--allow-missing {DSA}" in out
    assert (
        "profile glm5-nvfp4 is proven on sglang >=0.5.9,<0.5.24; installed 0.5.24 is not in that range"
        in re.sub(r"\n +", " ", out)  # the warning as one line, whatever it was wrapped to
    )  # kept

    code, out = serve_check(python, tmp_path / "state", "--allow-missing", "no-such-patch")
    assert code == 2 and "--allow-missing: unknown patch id 'no-such-patch'" in out

    # Allowed on the command line: the other patches still have to be in place.
    code, out = serve_check(python, tmp_path / "state", "--allow-missing", DSA)
    assert code == 1 and f"{SMEM}: would-apply" in out and "FAIL patches: not in place: " in out
    assert cli("patch", "--site", future, "--allow-missing", DSA)[0] == 0
    code, out = serve_check(python, tmp_path / "state")  # the allowance is in the ledger
    # Unproven past the window: a warning, as doctor says it, and serve still starts.
    assert code == 0 and "WARN patches: 6 in place, fixed upstream or not needed" in out, out
    assert "-> run by the shape of the code on a release newer than they were proven on" in out
    assert f"{SMEM}: {UNPROVEN}" in out and f"{DSA}: anchor-missing on sglang 0.5.24, allowed" in out


def test_an_upgrade_past_the_window_is_never_a_false_green(site, cli):
    """`pip install -U sglang` from the last proven release to the next one wipes the patches:
    `--verify` re-applies the open ones and says how far they are proven."""
    install(site, "0.5.23")
    assert cli("patch", "--site", site)[0] == 0
    install(site, "0.5.23")  # pip replaces every file of the package...
    raise_version(site, "sglang", "0.5.24")  # ...with those of 0.5.24
    code, out, _ = cli("patch", "--verify", "--site", site, "--wide")  # each message on one line
    assert code == 0, out
    lost = "sglang 0.5.23 -> 0.5.24: patch {} was lost from {} in the upgrade; re-applied ({})"
    assert lost.format(DSA, FORWARD_MHA, UNPROVEN) in out
    assert lost.format(SMEM, PREFILL, UNPROVEN) in out
    assert all((site / path).read_bytes() != wheel_bytes("0.5.23", path) for path in (FORWARD_MHA, PREFILL))


def test_unpatch_only_one_of_two_patches_past_the_window_keeps_the_other(future, tmp_path, cli):
    """Two patches on one file of 0.5.24: unpatching one re-applies the other to the
    vendor's bytes (by shape, as the plan ran it), never drops it silently."""
    source = (
        "from sm120kit.patching.cst_tools import marker_line\n"
        "from sm120kit.patching.spec import AlreadyApplied, Patch, Rewrite, Rewritten\n"
        "def mark(module, ctx):\n"
        "    if any(line.comment and ctx.is_marker(line.comment.value) for line in module.footer):\n"
        "        return AlreadyApplied()\n"
        "    return Rewritten(module.with_changes(footer=[*module.footer, marker_line(ctx.marker)]))\n"
        "PATCH = Patch(id='test-tail-marker', package='sglang', summary='s', why='w',\n"
        f"    rewrites=(Rewrite({FORWARD_MHA!r}, '>=0.5.9,<=0.5.23', mark),))\n"
    )
    args = ("--site", future, "--patch-dir", patch_dir(tmp_path / "mine", "sglang", "tail_marker", source))
    assert cli("patch", *args, "--only", DSA, "--only", "test-tail-marker")[0] == 0
    code, doc = cli.json("unpatch", *args, "--only", DSA)
    assert code == 0 and doc["results"][0]["detail"] == "re-applied on the original: test-tail-marker"
    code, doc = cli.json("status", *args, "--only", DSA, "--only", "test-tail-marker")
    assert {r["patch"]: r["outcome"] for r in doc["results"]} == {
        DSA: "would-apply",
        "test-tail-marker": "already-applied",
    }
