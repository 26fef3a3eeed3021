"""doctor's nvcc check: the CUDA toolkit flashinfer's JIT compiles with, and its release."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("release", "status"), [("12.8.1", "warn"), ("12.9.0", "ok"), ("13.0.2", "ok")])
def test_doctor_shows_the_nvcc_flashinfer_compiles_with(tmp_path, site, release, status):
    """Found as flashinfer's get_cuda_path finds it ($CUDA_HOME first), its release from the
    toolkit's version.json: below 12.9 the JIT builds compute_120a (flashinfer-compute-120a)."""
    import json

    from sm120kit.node.registry import CHECKS, CheckInputs
    from sm120kit.node.snapshot import Snapshot
    from sm120kit.target import Target

    info = site / "flashinfer_python-0.7.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.7.2\n")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    (home / "version.json").write_text(json.dumps({"cuda": {"name": "CUDA SDK", "version": release}}))
    node = Snapshot(tmp_path, {"CUDA_HOME": str(home)}, dict, Target("site", [site]))
    check = CHECKS["nvcc"](CheckInputs(node))
    assert check.status.value == status and f"CUDA {release[:4].rstrip('.')}" in check.detail
    assert ("flashinfer-compute-120a" in check.detail) == (status == "warn")
