"""flashinfer's JIT cache is dropped when its sources change, kept on request, and a cache
older than the patch is reported by status."""

from __future__ import annotations

import os
import time

import pytest
from support.sites import install


@pytest.fixture
def jit_home(tmp_path, monkeypatch):
    base = tmp_path / "workspace"
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(base))
    return base / ".cache" / "flashinfer"


def build_cache(root, version: str):
    """What flashinfer 0.6.x leaves after building a kernel: <version>/<archs>/cached_ops/..."""
    so = root / version / "120a" / "cached_ops" / "fused_moe_120" / "fused_moe_120.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF")
    old = time.time() - 3600
    os.utime(so, (old, old))
    return root / version


def test_patch_and_unpatch_drop_the_cache(cli, site, jit_home):
    install(site, "0.5.9")  # flashinfer 0.6.3, which lacks the SM120 fixes
    cache = build_cache(jit_home, "0.6.3")
    other = build_cache(jit_home, "0.6.12")  # another version's cache is not ours to touch
    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and doc["jit_cache_removed"] == [str(cache)]
    assert not cache.exists() and other.exists()

    cache = build_cache(jit_home, "0.6.3")  # rebuilt from the patched sources, then...
    code, out, _ = cli("unpatch", "--site", site, "--wide")  # each message on one line
    assert code == 0 and f"removed the JIT cache {cache}" in out and not cache.exists()


def test_kept_cache_is_reported_by_status(cli, site, jit_home):
    install(site, "0.5.9")
    cache = build_cache(jit_home, "0.6.3")
    code, _out, err = cli("patch", "--site", site, "--keep-jit-cache")
    assert code == 0 and cache.exists() and "kept the JIT cache" in err
    code, _out, err = cli("status", "--site", site)
    assert code == 0
    assert f"the JIT cache {cache} holds kernels built before sm120kit patched the sources" in err
    # A cache built after the patch is current: no warning.
    for f in cache.rglob("*.so"):
        os.utime(f, None)
    assert "JIT cache" not in cli("status", "--site", site)[2]


def test_sglang_only_changes_leave_the_cache(cli, site, jit_home):
    install(site, "0.5.13")  # flashinfer 0.6.12 has the fixes upstream: nothing of it changes
    cache = build_cache(jit_home, "0.6.12")
    code, doc = cli.json("patch", "--site", site)
    assert code == 0 and doc["jit_cache_removed"] == [] and cache.exists()


def test_prebuilt_kernel_package_is_reported(cli, site, tmp_path):
    install(site, "0.5.9")
    dist_info = site / "flashinfer_jit_cache-0.6.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-jit-cache\nVersion: 0.6.3\n\n")
    _code, doc = cli.json("status", "--site", site)
    assert any("flashinfer-jit-cache 0.6.3 is installed" in w for w in doc["warnings"])


def test_doctor_warns_of_the_prebuilt_package_only_when_it_is_installed(cli, site):
    """flashinfer alone: no warning (pip would say "not installed"); with it: the warning."""
    from sm120kit.node import registry, snapshot
    from sm120kit.target import resolve_target

    install(site, "0.5.9")

    def jit_check():
        node = snapshot.Snapshot(site, {}, dict, resolve_target(site=str(site)))
        return registry.CHECKS["jit cache"](registry.CheckInputs(node))

    assert jit_check().status.value == "ok" and "flashinfer-jit-cache" not in jit_check().detail
    dist_info = site / "flashinfer_jit_cache-0.6.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-jit-cache\nVersion: 0.6.3\n\n")
    found = jit_check()
    assert found.status.value == "warn" and "flashinfer-jit-cache 0.6.3 is installed" in found.detail
