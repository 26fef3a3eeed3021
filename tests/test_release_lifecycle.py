"""The whole patch lifecycle through the CLI, for every shipped patch, on every sglang
release 0.5.9-0.5.23 installed with the flashinfer-python it pins: status, apply,
idempotent re-run, --check and --diff clean, pip upgrade to the next release wipes the
patches and --verify says so and restores them, unpatch gives back the wheels' bytes and
RECORD agrees."""

from __future__ import annotations

import hashlib

import pytest
from packaging.version import Version
from support.sites import WINDOW, flashinfer_pin, install, next_release, record_digest, wheel_bytes

AUTOTUNE = "sglang-moe-autotune-flashinfer-cutlass"
SETTLED = {"fixed-upstream", "not-applicable"}


def outcomes(doc: dict) -> dict[tuple[str, str], str]:
    return {(r["patch"], r["path"]): r["outcome"] for r in doc["results"]}


def versions(doc: dict) -> dict[str, str]:
    return {r["package"]: r["version"] for r in doc["results"] if r["version"]}


@pytest.mark.parametrize("version", WINDOW)
def test_lifecycle(version, site, cli):
    install(site, version)
    code, doc = cli.json("status", "--site", site)
    before, installed = outcomes(doc), versions(doc)
    assert installed == {"sglang": version, "flashinfer-python": flashinfer_pin(version)}
    assert set(before.values()) <= SETTLED | {"would-apply"}, before
    pending = {(r["package"], r["path"]) for r in doc["results"] if r["outcome"] == "would-apply"}
    assert code == (1 if pending else 0)

    code, doc = cli.json("patch", "--site", site)
    assert code == 0
    assert outcomes(doc) == {k: ("applied" if v == "would-apply" else v) for k, v in before.items()}
    patched = {}
    for package, path in pending:
        patched[path] = (site / path).read_bytes()
        assert patched[path] != wheel_bytes(installed[package], path, package)

    # Idempotent: a second run changes nothing, --check and --diff are clean.
    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and set(outcomes(doc).values()) <= SETTLED | {"already-applied"}
    assert {path: (site / path).read_bytes() for path in patched} == patched
    assert cli("patch", "--check", "--site", site)[0] == 0
    assert cli("patch", "--diff", "--site", site)[:2] == (0, "")

    # pip install -U sglang (and the flashinfer it pins): the new files replace ours.
    upgrade = next_release(version)
    if upgrade:
        install(site, upgrade)
        code, out, _ = cli("patch", "--verify", "--site", site, "--wide")  # each message on one line
        assert code == 0, out
        new = {"sglang": upgrade, "flashinfer-python": flashinfer_pin(upgrade)}
        for r in doc["results"]:
            package = r["package"]
            if r["outcome"] == "already-applied" and installed[package] != new[package]:
                head = (
                    f"{package} {installed[package]} -> {new[package]}: "
                    f"patch {r['patch']} was lost from {r['path']} in the upgrade;"
                )
                assert head in out
        if before.get((AUTOTUNE, "sglang/srt/model_executor/model_runner.py")) == "would-apply":
            tail = (
                "re-applied"
                if Version(upgrade) < Version("0.5.13")
                else "not needed any more (fixed upstream in 0.5.13)"
            )
            lost = f"patch {AUTOTUNE} was lost from sglang/srt/model_executor/model_runner.py in the upgrade"
            assert f"sglang {version} -> {upgrade}: {lost}; {tail}" in out
        assert "verified: every patch is in place" in out
        lost = [line for line in out.splitlines() if "was lost" in line]
        assert len(lost) == len(set(lost))  # one line per patch and outcome
        installed = new

    # unpatch: back to the wheels' bytes, as RECORD says; no state left behind.
    code, doc = cli.json("unpatch", "--site", site)
    assert code == 0 and {r["outcome"] for r in doc["results"]} <= {"restored"}
    for r in doc["results"]:
        data = (site / r["path"]).read_bytes()
        assert data == wheel_bytes(installed[r["package"]], r["path"], r["package"])
        assert hashlib.sha256(data).digest() == record_digest(site, r["package"], r["path"])
    code, doc = cli.json("status", "--site", site)
    assert set(outcomes(doc).values()) <= SETTLED | {"would-apply"}
    assert not (site / ".sm120kit").exists()
