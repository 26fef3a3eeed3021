"""The shipped outcome seed (patches/outcomes.json) answers a first `patch --check` on a
release of the window with the transforms' own verdicts, and is never stale in a release."""

from __future__ import annotations

import json

import pytest
from support.paths import ROOT
from support.sites import install

from sm120kit import __version__
from sm120kit.patching import seed, transform
from sm120kit.patching.registry import load_patches

SEED = ROOT / "patches" / seed.FILE_NAME


@pytest.fixture
def seeded(monkeypatch, tmp_path):
    """The seed on, and an outcome cache of this test's own: what is not parsed came from the seed."""
    monkeypatch.delenv("SM120KIT_NO_OUTCOME_SEED")
    monkeypatch.setenv("SM120KIT_CACHE_DIR", str(tmp_path / "empty-cache"))
    seed._outcomes.cache_clear()
    yield
    seed._outcomes.cache_clear()


def test_the_seed_is_current():
    """Every patch edit changes its key: a seed written before it misses (costs speed), so
    the release must carry one written after the last edit."""
    doc = json.loads(SEED.read_text())
    current = {p.id: p.source_sha256 for p in load_patches()}
    stale = sorted(pid for pid in current.keys() | doc["patches"].keys() if current.get(pid) != doc["patches"].get(pid))
    assert (doc["sm120kit"], stale) == (__version__, []), "stale: run `python scripts/seed_outcomes.py`"
    assert all(set(v) == {"outcome", "detail"} for v in doc["outcomes"].values())


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_a_cold_check_parses_nothing_and_says_what_the_transforms_say(cli, site, version, monkeypatch, request):
    install(site, version)
    computed = cli.json("patch", "--check", "--site", site)
    request.getfixturevalue("seeded")

    def no_parse(*args, **kwargs):
        raise AssertionError(f"parsed {args[3]}")

    monkeypatch.setattr(transform, "run_rewrites", no_parse)
    assert cli.json("patch", "--check", "--site", site) == computed


def test_a_changed_file_misses_the_seed(cli, site, seeded, monkeypatch):
    install(site, "0.5.23", flashinfer=False)
    target = site / "sglang/srt/layers/attention/dsa/dsa_backend_kpool.py"
    target.write_bytes(target.read_bytes() + b"\n# a local edit\n")
    read = []  # the files whose verdicts were read from their bytes (quick reads, else the transforms)
    real, quick = transform.run_rewrites, transform.quick_verdicts
    monkeypatch.setattr(transform, "run_rewrites", lambda *a, **k: read.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(transform, "quick_verdicts", lambda *a, **k: read.append(a[3]) or quick(*a, **k))
    cli("status", "--site", site)
    assert read == ["sglang/srt/layers/attention/dsa/dsa_backend_kpool.py"]


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"outcomes": []}', b'{"outcomes": {"k": 1}}'])
def test_a_damaged_seed_misses(tmp_path, monkeypatch, seeded, damage):
    (tmp_path / seed.FILE_NAME).write_bytes(damage)
    monkeypatch.setattr(seed, "shipped", lambda kind: tmp_path)
    seed._outcomes.cache_clear()
    assert seed.get("k") is None
