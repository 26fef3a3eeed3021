"""scripts/conformance.py: over the proven window from the wheel cache alone (the index out
of reach), flashinfer-python releases named on their own, `--latest` from an index offline,
and its refusals: a release that does not exist, a name that is not a release, no network.
Past the window it fails, cell by cell."""

from __future__ import annotations

import os
import subprocess
import sys

import conformance
import pytest
from support.paths import ROOT
from support.sites import WINDOW, flashinfer_pin, install, raise_version

from sm120kit import wheels
from sm120kit.patching.registry import load_patches

SCRIPT = ROOT / "scripts" / "conformance.py"
# pip with no configuration and an index on a closed port: nothing can be downloaded.
OFFLINE = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_RETRIES": "1",
    "PIP_TIMEOUT": "2",
    "PIP_FIND_LINKS": "",
}


def outcomes(report: str) -> dict[tuple[str, str], dict[str, str]]:
    """The report's patch table: (sglang, flashinfer) -> patch id -> cell."""
    table = report.split("## Patch outcomes")[1].split("## Lifecycle")[0].strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    ids = [c.strip("`") for c in cells[0][2:]]
    return {(row[0], row[1]): dict(zip(ids, row[2:], strict=True)) for row in cells[2:]}


def by_package(cells: dict[str, str]) -> dict[str, set[str]]:
    """package -> the distinct cells of its patches."""
    package = {p.id: p.package for p in load_patches()}
    found: dict[str, set[str]] = {}
    for patch_id, cell in cells.items():
        found.setdefault(package[patch_id], set()).add(cell)
    return found


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
    for version in conformance.FLASHINFER_PAST_PINS:
        wheels.fetch("flashinfer-python", version)
    code, out, report = run(tmp_path, "--window", env=OFFLINE)
    assert code == 0, out
    assert "(every cell settled and proven)" in out
    table = [line for line in report.splitlines() if line.startswith("| 0.5.")]
    assert len(table) == 3 * len(WINDOW)  # outcomes, lifecycle, profiles
    cells = outcomes(report)
    assert list(cells) == [(v, flashinfer_pin(v)) for v in WINDOW] + [
        ("-", v) for v in conformance.FLASHINFER_PAST_PINS
    ]
    assert {
        k: v
        for k, v in cells[("0.5.23", "0.7.2")].items()
        if k in ("sglang-dsa-page-table-guard", "sglang-triton-smem-sm120")
    } == {"sglang-dsa-page-table-guard": "would-apply", "sglang-triton-smem-sm120": "fixed-upstream ×2, would-apply"}
    # The flashinfer releases past the pins, alone: the fix found in their code, sglang's patches not run.
    for version in conformance.FLASHINFER_PAST_PINS:
        assert by_package(cells[("-", version)]) == {"flashinfer-python": {"fixed-upstream"}, "sglang": {"-"}}
        assert f"flashinfer-python {version}: ok" in out
        assert f"| - | {version} | ok | ok | ok | ok |" in report  # lifecycle
    assert by_package(cells[("0.5.23", "0.7.2")])["flashinfer-python"] == {"fixed-upstream"}
    assert by_package(cells[("0.5.9", "0.6.3")])["flashinfer-python"] == {"would-apply"}
    assert "| 0.5.9 | 0.6.3 | ok | ok | ok | ok |" in report
    profiles = report.split("## Profiles")[1].split("## Verdict")[0]
    row = {line.split(" | ")[0]: line for line in profiles.splitlines() if line.startswith("| 0.5.")}
    # glm5-nvfp4: per-phase CUDA-graph flags (the warnings, of the known failures, vary by release)
    assert "| ok (26 args" in row["| 0.5.9"] and "| ok (29 args" in row["| 0.5.14"]
    assert "| n/a (needs sglang >=0.5.11) |" in row["| 0.5.9"]  # kimi-k2-int4-triton below its floor
    assert (
        "Every cell is settled and proven." in report
        and "**" not in report.split("## Verdict")[0].split("## Patch outcomes")[1]
    )


def test_flashinfer_releases_by_name_alone(tmp_path):
    """A buggy and a fixed flashinfer release, no sglang (none is fetched: the index is out of
    reach): the flashinfer patches apply, prove, repeat and undo on 0.6.3, and are found
    fixed in 0.7.4's code; the machine's flashinfer JIT cache is left alone."""
    for version in ("0.6.3", "0.7.4"):
        wheels.fetch("flashinfer-python", version)
    jit = tmp_path / "home" / ".cache" / "flashinfer" / "0.6.3" / "120a" / "cached_ops" / "fused_moe_120"
    jit.mkdir(parents=True)
    env = {**OFFLINE, "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "home")}
    code, out, report = run(tmp_path, "--flashinfer", "0.6.3", "0.7.4", "--patched-files-only", env=env)
    assert code == 0, out
    assert "flashinfer-python 0.6.3: ok" in out and "flashinfer-python 0.7.4: ok" in out
    assert "sglang" not in out
    cells = outcomes(report)
    assert list(cells) == [("-", "0.6.3"), ("-", "0.7.4")]
    assert by_package(cells[("-", "0.6.3")]) == {"flashinfer-python": {"would-apply"}, "sglang": {"-"}}
    assert by_package(cells[("-", "0.7.4")]) == {"flashinfer-python": {"fixed-upstream"}, "sglang": {"-"}}
    assert "| - | 0.6.3 | ok | ok | ok | ok |" in report
    assert "| - |" not in report.split("## Profiles")[1]  # a profile serves sglang: none rendered
    assert "flashinfer-python 0.6.3, 0.7.4 on their own" in report
    assert "Every cell is settled and proven." in report
    assert jit.is_dir()


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
        (["--flashinfer", "0.7.x"], {}, "--flashinfer '0.7.x' is not a release number (e.g. 0.7.4)"),
        (["0.5.23", "--flashinfer", "0.7.4", "latest"], {}, "--flashinfer 'latest' is not a release number"),
        (  # upstream went from 0.7.2.post1 to 0.7.4
            ["--flashinfer", "0.7.3"],
            {"PIP_NO_INDEX": "1"},
            "flashinfer-python==0.7.3 is not on the package index (its newest releases there: 0.7.2, "
            "0.7.2.post1, 0.7.4)",
        ),
        (["--flashinfer", "0.7.4"], {}, "cannot reach the package index for flashinfer-python==0.7.4 (no network?)"),
    ],
)
def test_refusals_are_clear(tmp_path, args, env, says):
    links = tmp_path / "index"
    links.mkdir()
    (links / "sglang-0.5.23-py3-none-any.whl").symlink_to(wheels.fetch("sglang", "0.5.23"))
    for version in ("0.7.2", "0.7.2.post1", "0.7.4"):
        wheel = wheels.fetch("flashinfer-python", version)
        (links / wheel.name).symlink_to(wheel)
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
    raise_version(site, "flashinfer-python", "0.7.5")
    release = conformance.Release("0.5.24", "0.7.5")
    conformance.check_release(release, site, ["glm5-nvfp4"])
    # Past the window every part is read from the code and unproven: the open ones would apply, the
    # fixed ones are fixed-upstream as their code shows, none of them counted proven.
    assert {
        "sglang-dsa-page-table-guard: **would-apply (unproven)**",
        "sglang-triton-smem-sm120: **fixed-upstream (unproven) ×2, would-apply (unproven)**",
        "flashinfer-sm120-arch-suffix: **fixed-upstream (unproven)**",
    } <= set(release.failures)
    assert all(f.endswith("(unproven)**") for f in release.failures)
    assert release.steps == dict.fromkeys(["status", "patch --verify", "idempotent", "unpatch = RECORD"], "ok")
    assert release.profiles["glm5-nvfp4"].startswith("ok (") and "1 warning(s)" in release.profiles["glm5-nvfp4"]
    report = conformance.report([release], sorted(release.cells), ["glm5-nvfp4"])
    assert "- sglang 0.5.24: sglang-dsa-page-table-guard: **would-apply (unproven)**" in report
