"""SIGKILL at every durable step of a real `patch` and `unpatch` run: sglang 0.5.9 with the
flashinfer 0.6.3 it pins, where all six shipped patches write (seven files). After each
kill, every file holds the vendor's bytes or the fully patched ones, and the next run
finishes the job: `patch --verify` is green and `unpatch` gives back the bytes RECORD
names, with no temporary file and no backup left behind.

The kill comes from inside the run: a forked child counts the steps that make a write
durable under the target -- the fsync of a new file's bytes, and its rename into place --
and SIGKILLs itself right after the N-th."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import sys
from pathlib import Path

import libcst  # noqa: F401  (imported once here, not in every forked run)
import pytest
from support.sites import install, record_digest

from sm120kit.cli import main

TMP = ".sm120kit-tmp"
# Each killed run is a fork of this process: it inherits the rewrites already computed.
pytestmark = pytest.mark.usefixtures("rewrites_once")


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """The vendor install, and the same patched by a run nobody killed."""
    root = tmp_path_factory.mktemp("crash")
    vendor = root / "vendor" / "site-packages"
    vendor.mkdir(parents=True)
    install(vendor, "0.5.9")
    patched = root / "patched" / "site-packages"
    shutil.copytree(vendor, patched)
    assert run_killed(patched, ["patch"], kill_after=None) == 0
    files = sorted(
        str(p.relative_to(vendor))
        for p in vendor.rglob("*.py")
        if p.read_bytes() != (patched / p.relative_to(vendor)).read_bytes()
    )
    assert len(files) == 8
    return vendor, patched, files


def run_killed(site: Path, argv: list[str], kill_after: int | None, counter: Path | None = None) -> int:
    """sm120kit ARGV --site SITE in a forked child that SIGKILLs itself after its
    `kill_after`-th fsync or rename under SITE. Returns the exit code (-9 when killed);
    with `counter`, the child writes how many such steps it took."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 2
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            steps = [0]
            real_fsync, real_replace = os.fsync, os.replace

            def step(path: str) -> None:
                if str(path).startswith(str(site)):
                    steps[0] += 1
                    if steps[0] == kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)

            def fsync(fd):
                real_fsync(fd)
                if not os.path.isdir(f"/proc/self/fd/{fd}"):  # a directory's fsync changes nothing a kill can see
                    step(os.readlink(f"/proc/self/fd/{fd}"))

            def replace(src, dst, **kw):
                real_replace(src, dst, **kw)
                step(dst)

            os.fsync, os.replace = fsync, replace
            code = main([*argv, "--site", str(site)])
            if counter is not None:
                counter.write_text(str(steps[0]))
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def steps_of(template: Path, tmp_path: Path, argv: list[str]) -> int:
    site = fresh(template, tmp_path / "count")
    counter = tmp_path / "steps"
    assert run_killed(site, argv, kill_after=None, counter=counter) == 0
    return int(counter.read_text())


def fresh(template: Path, where: Path) -> Path:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(where)
    site = where / "site-packages"
    shutil.copytree(template, site, symlinks=True)
    return site


def leftovers(site: Path) -> list[str]:
    return [str(p) for p in site.rglob(f"*{TMP}")] + [str(p) for p in site.glob(".sm120kit/journal.json")]


def assert_each_file_whole(site: Path, vendor: Path, patched: Path, files: list[str], where: str) -> None:
    for f in files:
        data = (site / f).read_bytes()
        assert data in ((vendor / f).read_bytes(), (patched / f).read_bytes()), f"{where}: {f} is torn"


def assert_finishes(cli, site: Path, vendor: Path, patched: Path, files: list[str], where: str) -> None:
    """The next runs: --verify green with every file patched, then unpatch back to RECORD."""
    code, out, err = cli("patch", "--verify", "--site", site)
    assert code == 0 and "verified" in out, f"{where}: {out}{err}"
    assert all((site / f).read_bytes() == (patched / f).read_bytes() for f in files), where
    code, out, err = cli("unpatch", "--site", site)
    assert code == 0, f"{where}: {out}{err}"
    for f in files:
        data = (site / f).read_bytes()
        package = "flashinfer-python" if f.startswith("flashinfer/") else "sglang"
        assert data == (vendor / f).read_bytes() and hashlib.sha256(data).digest() == record_digest(site, package, f), (
            where
        )
    assert not leftovers(site) and not list(site.glob(".sm120kit/backups/*")), f"{where}: {leftovers(site)}"


# Each kill is followed by a verify that parses every file: the steps are dealt out to
# SHARDS tests (step n to shard n % SHARDS), which the suite's workers run side by side.
SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS))
def test_a_kill_at_any_step_of_patch_loses_nothing(templates, tmp_path, cli, shard):
    vendor, patched, files = templates
    total = steps_of(vendor, tmp_path, ["patch"])
    assert total >= 3 * len(files)  # a backup and a replace per file at least, and the ledger
    for n in range(1 + shard, total + 1, SHARDS):
        site = fresh(vendor, tmp_path / "run")
        assert run_killed(site, ["patch"], kill_after=n) == -signal.SIGKILL, f"step {n} of {total}"
        where = f"killed after step {n} of {total} of patch"
        assert_each_file_whole(site, vendor, patched, files, where)
        code, _doc = cli.json("status", "--site", site)
        if (site / ".sm120kit" / "journal.json").exists():
            assert code == 2, where  # never a false green while a run is unfinished
        assert_finishes(cli, site, vendor, patched, files, where)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_a_kill_at_any_step_of_unpatch_loses_nothing(templates, tmp_path, cli, shard):
    vendor, patched, files = templates
    total = steps_of(patched, tmp_path, ["unpatch"])
    assert total >= SHARDS
    for n in range(1 + shard, total + 1, SHARDS):
        site = fresh(patched, tmp_path / "run")
        assert run_killed(site, ["unpatch"], kill_after=n) == -signal.SIGKILL, f"step {n} of {total}"
        where = f"killed after step {n} of {total} of unpatch"
        assert_each_file_whole(site, vendor, patched, files, where)
        assert_finishes(cli, site, vendor, patched, files, where)
