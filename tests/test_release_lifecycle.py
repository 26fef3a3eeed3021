"""The whole patch lifecycle through the CLI, on every sglang release 0.5.9-0.5.23:
status, apply, idempotent re-run, --check and --diff clean, pip upgrade to the next
release wipes the patch and --verify says so and restores it, unpatch gives back the
wheel's bytes and RECORD agrees."""

from __future__ import annotations

import base64
import csv
import hashlib

import pytest
from conftest import WINDOW, install, next_release, wheel_bytes
from packaging.version import Version

PATCH_ID = "sglang-moe-autotune-flashinfer-cutlass"


def record_digest(dist_info, relpath: str) -> bytes:
    for row in csv.reader((dist_info / "RECORD").read_text().splitlines()):
        if row[0] == relpath:
            return base64.urlsafe_b64decode(row[1].split("=", 1)[1] + "==")
    raise KeyError(relpath)


def row(doc: dict) -> dict:
    [result] = [r for r in doc["results"] if r["patch"] == PATCH_ID]
    return result


def needs_patch(version: str) -> bool:
    return Version(version) < Version("0.5.13")


@pytest.mark.parametrize("version", WINDOW)
def test_lifecycle(version, site, cli):
    dist_info = install(site, version)
    code, doc = cli.json("status", "--site", site)
    expected = "would-apply" if needs_patch(version) else "fixed-upstream"
    assert (code, row(doc)["outcome"]) == ((1, expected) if needs_patch(version) else (0, expected))
    assert row(doc)["version"] == version
    path = row(doc)["path"]
    vendor = wheel_bytes(version, path)

    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and row(doc)["outcome"] == ("applied" if needs_patch(version) else "fixed-upstream")
    patched = (site / path).read_bytes()
    assert (patched != vendor) == needs_patch(version)

    # Idempotent: a second run changes nothing, --check and --diff are clean.
    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and row(doc)["outcome"] in ("already-applied", "fixed-upstream")
    assert (site / path).read_bytes() == patched
    assert cli("patch", "--check", "--site", site)[0] == 0
    code, out, _ = cli("patch", "--diff", "--site", site)
    assert (code, out) == (0, "")

    # pip install -U sglang: the new release's files replace ours.
    upgrade = next_release(version)
    if upgrade:
        install(site, upgrade)
        code, out, _ = cli("patch", "--verify", "--site", site)
        assert code == 0, out
        if needs_patch(version):
            tail = "re-applied" if needs_patch(upgrade) else "not needed any more (fixed upstream in 0.5.13)"
            assert f"sglang {version} -> {upgrade}: patch {PATCH_ID} was lost in the upgrade; {tail}" in out
        else:
            assert "was lost" not in out
        assert "verified: every patch is in place" in out
        version, dist_info = upgrade, next(site.glob("sglang-*.dist-info"))

    # unpatch: back to the wheel's bytes, as RECORD says; no state left behind.
    code, doc = cli.json("unpatch", "--site", site)
    assert code == 0
    assert [r["outcome"] for r in doc["results"]] == (["restored"] if needs_patch(version) else [])
    path = row(cli.json("status", "--site", site)[1])["path"]
    data = (site / path).read_bytes()
    assert data == wheel_bytes(version, path)
    assert hashlib.sha256(data).digest() == record_digest(dist_info, path)
    assert not list(site.glob(".sm120kit/backups/*"))
