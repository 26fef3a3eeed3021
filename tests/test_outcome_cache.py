"""The outcome cache stands in for reading a file (the patches' quick reads, or the
transforms) only for the exact bytes it saw."""

from __future__ import annotations

import pytest
from support.sites import install

from sm120kit.patching import apply, transform
from sm120kit.patching.registry import load_patches
from sm120kit.target import resolve_target

GATE = "sglang/srt/model_executor/model_runner.py"
ONLY = ("--only", "sglang-moe-autotune-flashinfer-cutlass")

pytestmark = pytest.mark.cold_cache  # each test counts the parses a cold cache makes


@pytest.fixture
def counted(monkeypatch):
    """The files whose verdicts were read from their bytes: by the transforms, or by the
    quick reads where those told every verdict."""
    calls = []
    real, quick = transform.run_rewrites, transform.quick_verdicts

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    def quick_counting(*args, **kwargs):
        found = quick(*args, **kwargs)
        if found is not None:
            calls.append(args[3])
        return found

    monkeypatch.setattr(transform, "run_rewrites", counting)
    monkeypatch.setattr(transform, "quick_verdicts", quick_counting)
    return calls


def test_warm_status_parses_nothing(cli, site, counted):
    install(site, "0.5.10")
    first = cli.json("status", "--site", site, *ONLY)
    assert counted == [GATE]
    assert cli.json("status", "--site", site, *ONLY) == first and counted == [GATE]
    assert cli("patch", "--check", "--site", site, *ONLY)[0] == 1 and counted == [GATE]


def test_changed_bytes_miss_the_cache(cli, site, counted):
    install(site, "0.5.10")
    assert cli("patch", "--site", site, *ONLY)[0] == 0  # parses; the result is cached
    counted.clear()
    assert cli.json("status", "--site", site, *ONLY)[1]["results"][0]["outcome"] == "already-applied"
    assert counted == []
    install(site, "0.5.11")  # new bytes
    assert cli.json("status", "--site", site, *ONLY)[1]["results"][0]["outcome"] == "would-apply"
    assert counted == [GATE]


def test_apply_and_verify_do_not_trust_the_cache(cli, site, counted):
    install(site, "0.5.10")
    cli("status", "--site", site, *ONLY)
    counted.clear()
    assert cli("patch", "--site", site, *ONLY)[0] == 0  # would-apply needs the new bytes
    assert counted == [GATE]
    counted.clear()
    target = resolve_target(site=str(site))
    patches = [p for p in load_patches() if p.id == ONLY[1]]
    assert apply.verify(target, patches) == [] and counted == [GATE]
