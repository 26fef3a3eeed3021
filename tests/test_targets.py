"""Targets other than a plain --site: another interpreter (--python) and an editable
install whose sources live in a checkout (sglang's docker images install it so)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import FIXTURE_PATCHES
from support.sites import install, wheel_bytes

GATE = "sglang/srt/model_executor/model_runner.py"
AUTOTUNE = ("--only", "sglang-moe-autotune-flashinfer-cutlass")


def test_python_target(cli, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    install(site, "0.5.10")
    code, doc = cli.json("status", "--python", python, *AUTOTUNE)
    assert code == 1 and doc["results"][0]["outcome"] == "would-apply"
    assert doc["target"]["site_dirs"] == [str(site.resolve())]
    assert cli("patch", "--python", python)[0] == 0
    assert (site / GATE).read_bytes() != wheel_bytes("0.5.10", GATE)
    assert cli("unpatch", "--python", python)[0] == 0
    assert (site / GATE).read_bytes() == wheel_bytes("0.5.10", GATE)


def test_python_target_that_does_not_run(cli, tmp_path):
    code, _, err = cli("status", "--python", tmp_path / "no-python")
    assert code == 2 and "cannot run it (No such file or directory)" in err


def said(cli, *args) -> tuple[int, str, str]:
    """The command's exit code, output and error, with the error's wrapping undone."""
    code, out, err = cli(*args)
    return code, out, " ".join(err.split())


def test_python_target_that_is_a_plain_file_said_with_its_full_path(cli, tmp_path, monkeypatch):
    """`--python server.log`: a file in the current directory, not on PATH, without execute
    permission: not "No such file or directory", and the message names the file in full."""
    (tmp_path / "server.log").write_text("INFO started\n")
    monkeypatch.chdir(tmp_path)
    for name in ("server.log", "./server.log"):
        code, _, err = said(cli, "status", "--python", name)
        assert code == 2 and "not an executable python (a file without execute permission)" in err, err
        assert str(tmp_path / "server.log") in err and "No such file" not in err
    code, _, err = said(cli, "status", "--python", tmp_path)
    assert code == 2 and "not an executable python (a directory)" in err


def test_python_target_that_is_not_python(cli, tmp_path):
    """A program that runs but is no Python interpreter (/bin/true prints nothing): said so,
    not a JSON decoder's "Expecting value"."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho hello\n")
    fake.chmod(0o755)
    for program, printed in ((shutil.which("true"), "nothing"), (fake, "'hello'")):
        code, _, err = said(cli, "status", "--python", program)
        assert code == 2 and "did not answer as a Python interpreter would" in err and printed in err, err
        assert "Expecting value" not in err and "give the environment's python" in err


def test_site_target_that_is_a_file(cli, tmp_path):
    (tmp_path / "server.log").write_text("")
    code, _, err = said(cli, "status", "--site", tmp_path / "server.log")
    assert code == 2 and "is not a directory" in err and "no such directory" not in err
    code, _, err = said(cli, "status", "--site", tmp_path / "nope")
    assert code == 2 and "no such directory" in err


def editable_install(site: Path, checkout: Path, version: str) -> None:
    """What `pip install -e python/` leaves: a dist-info whose RECORD lists no sources,
    a direct_url.json (PEP 610) naming the checkout, and the sources in the checkout."""
    dist_info = install(site, version, flashinfer=False)
    for relpath in [p.relative_to(site) for p in (site / "sglang").rglob("*.py")]:
        target = checkout / "python" / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(site / relpath, target)
    shutil.rmtree(site / "sglang")
    rows = [r for r in (dist_info / "RECORD").read_text().splitlines() if r.startswith(dist_info.name)]
    (site / f"__editable__.sglang-{version}.pth").write_text(str(checkout / "python") + "\n")
    (dist_info / "RECORD").write_text("\n".join([*rows, f"__editable__.sglang-{version}.pth,,"]) + "\n")
    (dist_info / "direct_url.json").write_text(
        json.dumps({"url": (checkout / "python").as_uri(), "dir_info": {"editable": True}})
    )


def test_editable_install(cli, site, tmp_path):
    checkout = tmp_path / "sglang"
    editable_install(site, checkout, "0.5.10")
    source = checkout / "python" / GATE
    code, doc = cli.json("status", "--site", site, *AUTOTUNE)
    assert code == 1 and doc["results"][0]["outcome"] == "would-apply"

    code, out, _ = cli("patch", "--verify", "--site", site)
    assert code == 0 and "verified" in out
    assert source.read_bytes() != wheel_bytes("0.5.10", GATE)
    assert (site / ".sm120kit" / "ledger.json").exists()  # state stays with the environment
    assert cli("patch", "--check", "--site", site)[0] == 0

    # A later hand edit in the checkout is a foreign edit there too.
    original = source.read_bytes()
    source.write_bytes(original + b"# local change\n")
    code, out, _ = cli("patch", "--check", "--site", site, "--wide")  # each detail on one line
    assert code == 2 and "foreign-edit" in out and "edited outside sm120kit after it was patched" in out
    code, out, _ = cli("unpatch", "--site", site)
    assert code == 2 and "foreign-edit" in out
    source.write_bytes(original)

    code, out, _ = cli("unpatch", "--site", site, "--wide")
    assert code == 0 and "matches the bytes recorded before patching" in out
    assert source.read_bytes() == wheel_bytes("0.5.10", GATE)


def test_unpatch_one_of_two_patches_on_the_same_file(cli, site):
    install(site, "0.5.10")
    args = ("--site", site, "--patch-dir", FIXTURE_PATCHES)
    both = (*AUTOTUNE, "--only", "test-version-marker")
    assert cli("patch", *args, *both)[0] == 0
    code, doc = cli.json("unpatch", *args, *AUTOTUNE)
    assert code == 0 and [r["path"] for r in doc["results"]] == [GATE]
    text = (site / GATE).read_text()
    assert "# sm120kit: test-version-marker r1" in text and "get_device_capability()[0] == 12" not in text
    code, doc = cli.json("status", *args, *both)
    outcomes = {(r["patch"], r["path"]): r["outcome"] for r in doc["results"]}
    assert outcomes == {
        ("sglang-moe-autotune-flashinfer-cutlass", GATE): "would-apply",
        ("test-version-marker", GATE): "already-applied",
        ("test-version-marker", "sglang/version.py"): "already-applied",
    }
    assert cli("patch", "--check", *args, *both)[0] == 1
    # The rest comes off too, and both files are the wheel's again.
    assert cli("unpatch", *args)[0] == 0
    for relpath in (GATE, "sglang/version.py"):
        assert (site / relpath).read_bytes() == wheel_bytes("0.5.10", relpath)
