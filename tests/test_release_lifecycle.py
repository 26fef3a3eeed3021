"""The whole patch lifecycle through the CLI, for every shipped sglang patch, on every
sglang release 0.5.9-0.5.23: status, apply, idempotent re-run, --check and --diff clean,
pip upgrade to the next release wipes the patches and --verify says so and restores them,
unpatch gives back the wheel's bytes and RECORD agrees."""

from __future__ import annotations

import base64
import csv
import hashlib

import pytest
from conftest import WINDOW, install, next_release, wheel_bytes
from packaging.version import Version

AUTOTUNE = "sglang-moe-autotune-flashinfer-cutlass"
SETTLED = {"fixed-upstream", "not-applicable"}


def record_digest(dist_info, relpath: str) -> bytes:
    for row in csv.reader((dist_info / "RECORD").read_text().splitlines()):
        if row[0] == relpath:
            return base64.urlsafe_b64decode(row[1].split("=", 1)[1] + "==")
    raise KeyError(relpath)


def outcomes(doc: dict) -> dict[tuple[str, str], str]:
    return {(r["patch"], r["path"]): r["outcome"] for r in doc["results"]}


@pytest.mark.parametrize("version", WINDOW)
def test_lifecycle(version, site, cli):
    dist_info = install(site, version)
    code, doc = cli.json("status", "--site", site)
    before = outcomes(doc)
    assert set(before.values()) <= SETTLED | {"would-apply"}, before
    pending = sorted(path for (_, path), outcome in before.items() if outcome == "would-apply")
    assert code == (1 if pending else 0)
    assert all(r["version"] == version for r in doc["results"])

    code, doc = cli.json("patch", "--site", site)
    assert code == 0
    assert outcomes(doc) == {k: ("applied" if v == "would-apply" else v) for k, v in before.items()}
    for path in pending:
        assert (site / path).read_bytes() != wheel_bytes(version, path)
    patched = {path: (site / path).read_bytes() for path in pending}

    # Idempotent: a second run changes nothing, --check and --diff are clean.
    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and set(outcomes(doc).values()) <= SETTLED | {"already-applied"}
    assert {path: (site / path).read_bytes() for path in pending} == patched
    assert cli("patch", "--check", "--site", site)[0] == 0
    assert cli("patch", "--diff", "--site", site)[:2] == (0, "")

    # pip install -U sglang: the new release's files replace ours.
    upgrade = next_release(version)
    if upgrade:
        install(site, upgrade)
        code, out, _ = cli("patch", "--verify", "--site", site)
        assert code == 0, out
        for patch_id, path in sorted(k for k, v in before.items() if v == "would-apply"):
            assert f"sglang {version} -> {upgrade}: patch {patch_id} was lost in the upgrade;" in out
        if before.get((AUTOTUNE, "sglang/srt/model_executor/model_runner.py")) == "would-apply":
            tail = "re-applied" if Version(upgrade) < Version("0.5.13") else "not needed any more (fixed upstream in 0.5.13)"
            assert f"sglang {version} -> {upgrade}: patch {AUTOTUNE} was lost in the upgrade; {tail}" in out
        assert "verified: every patch is in place" in out
        version, dist_info = upgrade, next(site.glob("sglang-*.dist-info"))

    # unpatch: back to the wheel's bytes, as RECORD says; no state left behind.
    code, doc = cli.json("unpatch", "--site", site)
    assert code == 0 and {r["outcome"] for r in doc["results"]} <= {"restored"}
    for path in {r["path"] for r in doc["results"]}:
        data = (site / path).read_bytes()
        assert data == wheel_bytes(version, path)
        assert hashlib.sha256(data).digest() == record_digest(dist_info, path)
    code, doc = cli.json("status", "--site", site)
    assert set(outcomes(doc).values()) <= SETTLED | {"would-apply"}
    assert not list(site.glob(".sm120kit/backups/*"))
