"""The built wheel, installed in a fresh venv, carries the patch set and works from there."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.paths import ROOT
from support.sites import install

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work), str(ROOT)], check=True)
    [wheel] = work.glob("sm120kit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sm120kit/_shipped/patches/sglang/moe_autotune_flashinfer_cutlass.py" in names
    assert "sm120kit/_shipped/profiles/glm5-nvfp4.toml" in names
    assert "sm120kit/_shipped/patches/outcomes.json" in names  # the outcome seed: a first check parses nothing
    assert "sm120kit/_shipped/patches/kernels.toml" in names  # the kernel table every launch is judged by
    assert "sm120kit/resolution/probe.py" in names  # runs in the target's interpreter
    assert "sm120kit/_shipped/profiles/variants/glm5-nvfp4.toml" in names  # bench --variants glm5-nvfp4
    assert not any(n.startswith("tests/") for n in names)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", str(wheel)], check=True)
    return venv / "bin" / "sm120kit"


def test_patches_ship(installed):
    out = subprocess.run([installed, "patches", "--json"], capture_output=True, text=True, check=True).stdout
    shipped = {p.name for p in (ROOT / "patches").glob("*/*.py")}
    listed = json.loads(out)["patches"]
    assert len(listed) == len(shipped) and {p["source"] for p in listed} == {"shipped"}
    assert "sglang-moe-autotune-flashinfer-cutlass" in {p["id"] for p in listed}


def test_profiles_ship(installed):
    out = subprocess.run([installed, "profiles", "--json"], capture_output=True, text=True, check=True).stdout
    shipped = {p.stem for p in (ROOT / "profiles").glob("*.toml")}
    assert {p["name"] for p in json.loads(out)["profiles"]} == shipped


def test_status_on_a_site(installed, site):
    install(site, "0.5.10")
    done = subprocess.run([installed, "status", "--site", site], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    rows = [line.split()[:5] for line in done.stdout.splitlines()]
    assert ["sglang-moe-autotune-flashinfer-cutlass", "sglang", "0.5.10", "would-apply", "0.5.13"] in rows
    done = subprocess.run([installed, "patch", "--verify", "--site", site], capture_output=True, text=True)
    assert done.returncode == 0 and "verified" in done.stdout, done.stderr


def test_failure_signatures_ship(installed, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("AttributeError: 'PrefillMetadata' object has no attribute 'page_table_1_flattened'\n")
    done = subprocess.run([installed, "diagnose", log], capture_output=True, text=True)
    assert done.returncode == 1 and "dsa-page-table" in done.stdout, done.stderr
