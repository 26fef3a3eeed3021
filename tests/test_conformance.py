"""scripts/conformance.py: over the proven window from the wheel cache alone (the index out
of reach), `--latest` from an index offline, and its refusals: a release that does not
exist, a name that is not a release, no network. Past the window it fails, cell by cell."""

from __future__ import annotations

import os
import subprocess
import sys

import conformance
import pytest
from conftest import ROOT, WINDOW, flashinfer_pin, install, raise_version

from sm120kit import wheels

SCRIPT = ROOT / "scripts" / "conformance.py"
# pip with no configuration and an index on a closed port: nothing can be downloaded.
OFFLINE = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_RETRIES": "1",
    "PIP_TIMEOUT": "2",
    "PIP_FIND_LINKS": "",
}


def run(tmp_path, *args, env=None) -> tuple[int, str, str]:
    report = tmp_path / "report.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout + proc.stderr, report.read_text() if report.exists() else ""


def test_the_proven_window_conforms_from_the_cache_alone(tmp_path):
    for version in WINDOW:  # what the other tests fetch anyway; then the index is out of reach
        wheels.fetch("sglang", version)
        wheels.fetch("flashinfer-python", flashinfer_pin(version))
    code, out, report = run(tmp_path, "--window", env=OFFLINE)
    assert code == 0, out
    assert "(every cell settled and proven)" in out
    table = [line for line in report.splitlines() if line.startswith("| 0.5.")]
    assert len(table) == 3 * len(WINDOW)  # outcomes, lifecycle, profiles
    assert (
        "| 0.5.23 | 0.7.2 | fixed-upstream | fixed-upstream | fixed-upstream | would-apply | fixed-upstream "
        "| fixed-upstream ×2, would-apply |" in report
    )
    assert "| 0.5.9 | ok | ok | ok | ok |" in report
    profiles = report.split("## Profiles")[1].split("## Verdict")[0]
    row = {line.split(" | ")[0]: line for line in profiles.splitlines() if line.startswith("| 0.5.")}
    assert (
        "| ok (26 args) |" in row["| 0.5.9"] and "| ok (29 args) |" in row["| 0.5.14"]
    )  # glm5-nvfp4: per-phase CUDA-graph flags
    assert "| n/a (needs sglang >=0.5.11) |" in row["| 0.5.9"]  # kimi-k2-int4-triton below its floor
    assert (
        "Every cell is settled and proven." in report
        and "**" not in report.split("## Verdict")[0].split("## Patch outcomes")[1]
    )


def test_latest_is_the_newest_release_the_index_offers(tmp_path):
    links = tmp_path / "index"
    links.mkdir()
    for package, version in (("sglang", "0.5.22"), ("sglang", "0.5.23"), ("flashinfer-python", "0.7.2")):
        wheel = wheels.fetch(package, version)
        (links / wheel.name).symlink_to(wheel)
    empty_cache = tmp_path / "cache"
    env = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), "SM120KIT_WHEEL_CACHE": str(empty_cache)}
    code, out, report = run(tmp_path, "--patched-files-only", env=env)
    assert code == 0, out
    assert "sglang 0.5.23 (flashinfer 0.7.2): ok" in out and "| 0.5.23 | 0.7.2 |" in report
    assert "0.5.22" not in report


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["9.9.9"], {"PIP_NO_INDEX": "1"}, "sglang==9.9.9 is not on the package index (its newest releases there: "),
        (["0.5.x"], {}, "'0.5.x' is not a release number (e.g. 0.5.23)"),
        (["--latest"], {}, "cannot reach the package index for sglang (no network?)"),
        (["0.5.9"], {}, "cannot reach the package index for sglang==0.5.9 (no network?)"),
    ],
)
def test_refusals_are_clear(tmp_path, args, env, says):
    links = tmp_path / "index"
    links.mkdir()
    (links / "sglang-0.5.23-py3-none-any.whl").symlink_to(wheels.fetch("sglang", "0.5.23"))
    env = {**OFFLINE, "SM120KIT_WHEEL_CACHE": str(tmp_path / "empty"), **env}
    if env.get("PIP_NO_INDEX"):
        env["PIP_FIND_LINKS"] = str(links)
    code, out, report = run(tmp_path, *args, env=env)
    assert code == 2 and f"conformance: error: {says}" in out, out
    assert "Traceback" not in out and not report


def test_a_release_past_the_window_fails_cell_by_cell(site):
    """What --latest reports the day upstream publishes 0.5.24 with the bugs still open."""
    install(site, "0.5.23", flashinfer=True)
    raise_version(site, "sglang", "0.5.24")
    raise_version(site, "flashinfer-python", "0.7.3")
    release = conformance.Release("0.5.24", "0.7.3")
    conformance.check_release(release, site, ["glm5-nvfp4"])
    assert sorted(release.failures) == [
        "sglang-dsa-page-table-guard: **would-apply (unproven)**",
        "sglang-triton-smem-sm120: **fixed-upstream ×2, would-apply (unproven)**",
    ]
    assert release.steps == dict.fromkeys(["status", "patch --verify", "idempotent", "unpatch = RECORD"], "ok")
    assert release.profiles["glm5-nvfp4"].startswith("ok (") and "1 warning(s)" in release.profiles["glm5-nvfp4"]
    report = conformance.report([release], sorted(release.cells), ["glm5-nvfp4"])
    assert "- sglang 0.5.24: sglang-dsa-page-table-guard: **would-apply (unproven)**" in report
