"""Writes that fail for real: a persistent I/O error while rolling back, a read-only
environment (a read-only bind mount, as a container layer is), and a full disk (a small
tmpfs at several fill levels). Each ends in a clear message, exit 2, and every file whole:
what could be rolled back is, and the next run finishes the rest."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.sites import install, wheel_bytes
from support.tree import tree_snapshot

from sm120kit.patching import transaction

FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
PREFILL = "sglang/kernels/ops/attention/prefill_attention.py"
FILES = (FORWARD_MHA, PREFILL)  # what the shipped patches write on sglang 0.5.23

# What these tests prove is the engine around the rewrite, at every step of a write.
pytestmark = pytest.mark.usefixtures("rewrites_once")


def vendor(site) -> dict[str, bytes]:
    return {f: wheel_bytes("0.5.23", f) for f in FILES}


def target_files(site) -> dict[str, bytes]:
    return {f: (site / f).read_bytes() for f in FILES}


def no_leftovers(site) -> bool:
    return not list(site.rglob("*.sm120kit-tmp")) and not (site / ".sm120kit" / "journal.json").exists()


def test_a_persistent_io_error_while_rolling_back(site, cli, monkeypatch):
    install(site, "0.5.23", flashinfer=False)
    real = transaction.write_atomic
    targets = []

    def failing(path, data):
        if ".sm120kit" not in path.parts:
            targets.append(path)
            if len(targets) >= 2:  # the second file, and from then on every write (the rollback too)
                raise OSError(errno.EIO, "Input/output error", str(path))
        real(path, data)

    monkeypatch.setattr(transaction, "write_atomic", failing)
    code, out, err = cli("patch", "--site", site)
    first, second = targets[0], targets[1]
    assert code == 2, out + err
    assert f"writing {second} failed ([Errno 5] Input/output error)" in err
    assert (
        f"{first}: maybe written ([Errno 5] Input/output error): the next `sm120kit patch --site {site}` or `unpatch` "
        "rolls it back" in err
    )
    assert f"{second}: unchanged" in err and "an interrupted run is recorded in the state directory" in err
    assert "Traceback" not in out + err
    assert (site / ".sm120kit" / "journal.json").exists()

    monkeypatch.setattr(transaction, "write_atomic", real)  # the disk is back
    code, out, err = cli("status", "--site", site)
    assert code == 2 and "an interrupted sm120kit run left" in err  # no false green meanwhile
    code, out, err = cli("patch", "--verify", "--site", site)
    assert code == 0 and "rolled back an interrupted sm120kit run" in err and "verified" in out, out + err
    code, _doc = cli.json("unpatch", "--site", site)
    assert code == 0 and target_files(site) == vendor(site) and no_leftovers(site)


@contextlib.contextmanager
def mounted(*argv):
    """Run `mount ARGV`, unmount afterwards; skip where this machine does not let us."""
    target = argv[-1]
    proc = subprocess.run(["mount", *map(str, argv)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()}): needs root")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@contextlib.contextmanager
def read_only_view(site, where):
    where.mkdir()
    with mounted("--bind", site, where):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True)
        yield where


def test_read_only_environment_unpatched(site, tmp_path, cli):
    install(site, "0.5.23", flashinfer=False)
    with read_only_view(site, tmp_path / "ro-site-packages") as ro:
        assert cli("status", "--site", ro)[0] == 1  # read-only commands keep working
        assert cli("patch", "--check", "--site", ro)[0] == 1
        code, out, err = cli("patch", "--verify", "--site", ro)
        assert (
            code == 2
            and "is not writable (Read-only file system): "
            "this environment is read-only for this user; nothing was changed"
            in err
        )
        assert "patch where the environment is built" in err and "Traceback" not in out + err
        code, out, _ = cli("unpatch", "--site", ro)
        assert code == 0 and "nothing to restore" in out
    assert target_files(site) == vendor(site)


def test_read_only_environment_patched(site, tmp_path, cli):
    """Patched at build time, then run from a read-only layer: verified, not refused."""
    install(site, "0.5.23", flashinfer=False)
    assert cli("patch", "--site", site)[0] == 0
    with read_only_view(site, tmp_path / "ro-site-packages") as ro:
        code, out, err = cli("patch", "--verify", "--site", ro)
        assert code == 0 and "verified" in out, out + err
        assert cli("status", "--site", ro)[0] == 0
        code, out, err = cli("unpatch", "--site", ro)
        assert code == 2 and "is not writable (Read-only file system)" in err and "Traceback" not in out + err
    assert target_files(site) != vendor(site)


@pytest.mark.parametrize("free_kib", [0, 4, 16, 64, 96, 104, 112, 128, 1024])
def test_a_full_disk_changes_nothing_or_everything(tmp_path, cli, free_kib):
    disk = tmp_path / "disk"
    disk.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=24m", "tmpfs", disk):
        site = disk / "site-packages"
        site.mkdir()
        install(site, "0.5.23", flashinfer=False)
        before = {k: v for k, v in tree_snapshot(site).items() if not k.startswith(".sm120kit")}
        _fill(disk / "filler", free_kib * 1024)
        code, out, err = cli("patch", "--site", site)
        assert "Traceback" not in out + err and "internal error" not in err
        if code == 0:
            assert all(target_files(site)[f] != vendor(site)[f] for f in FILES)
        else:
            assert code == 2, out + err
            assert "nothing was changed" in err
            assert (
                f"not enough space on {disk} (the filesystem holding" in err
                or f"the disk holding it, {disk}, is full" in err
            )
            assert str(disk) in err
            assert {k: v for k, v in tree_snapshot(site).items() if not k.startswith(".sm120kit")} == before
        assert no_leftovers(site)
        (disk / "filler").unlink()
        assert cli("patch", "--verify", "--site", site)[0] == 0  # with room again, it goes through
        assert cli("unpatch", "--site", site)[0] == 0 and target_files(site) == vendor(site)


def _fill(path, leave: int) -> None:
    """Take the free space of path's filesystem down to `leave` bytes."""
    with open(path, "wb") as fh:
        while (free := shutil.disk_usage(path.parent).free) > leave:
            try:
                fh.write(b"\0" * min(free - leave, 1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
            except OSError:
                break


def test_a_user_who_does_not_own_the_environment(tmp_path_factory):
    """Another user's venv (here: root's, run as nobody): status works, a write is refused
    with what is not writable, and nothing changes."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    root = Path(tempfile.mkdtemp(prefix="sm120kit-owner-"))  # outside pytest's 0700 tree
    try:
        root.chmod(0o755)
        site = root / "site-packages"
        site.mkdir()
        install(site, "0.5.23", flashinfer=False)
        subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
        env = {**os.environ, "HOME": str(root / "home"), "SM120KIT_CACHE_DIR": str(root / "cache")}
        if subprocess.run([*nobody, "-c", "import sm120kit"], env=env, cwd=root, capture_output=True).returncode:
            pytest.skip("this interpreter cannot run as another user here")

        def run(*argv):
            proc = subprocess.run(
                [*nobody, "-m", "sm120kit", *argv, "--site", str(site)],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
            )
            return proc.returncode, proc.stdout + proc.stderr

        before = tree_snapshot(site)
        assert run("status")[0] == 1
        code, out = run("patch", "--verify")
        assert (
            code == 2 and f"{site / '.sm120kit'} is not writable (Permission denied)" in out and "Traceback" not in out
        )
        assert tree_snapshot(site) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_file_written_but_reported_failed_is_rolled_back_too(site, cli, monkeypatch):
    """The write went through and then an error came (the read-back failed): the file holds
    the new bytes, so it is rolled back with the others, never left "unchanged"."""
    install(site, "0.5.23", flashinfer=False)
    real = transaction.write_atomic
    targets = []

    def written_then_failed(path, data):
        real(path, data)
        if ".sm120kit" not in path.parts:
            targets.append(path)
            if len(targets) == 2:
                raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(transaction, "write_atomic", written_then_failed)
    code, _out, err = cli("patch", "--site", site)
    assert (
        code == 2
        and f"{targets[1]}: rolled back" in err
        and f"{targets[0]}: rolled back" in err
        and "nothing was changed" in err
    )
    assert target_files(site) == vendor(site) and no_leftovers(site)


def test_when_the_second_sites_ledger_fails_the_first_sites_is_rolled_back(tmp_path, monkeypatch):
    """sglang and flashinfer in two site directories: one transaction, two ledgers."""
    from sm120kit.errors import UserError
    from sm120kit.patching import apply
    from sm120kit.patching.registry import load_patches
    from sm120kit.target import Target

    a, b = tmp_path / "a" / "site-packages", tmp_path / "b" / "site-packages"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    install(a, "0.5.9", flashinfer=False)
    from sm120kit import wheels

    wheels.install(
        b, "flashinfer-python", "0.6.3", ["flashinfer/*.py", "flashinfer/jit/*.py", "flashinfer/jit/gemm/*.py"]
    )
    before = {**tree_snapshot(a), **{f"b/{k}": v for k, v in tree_snapshot(b).items()}}
    real = transaction.write_atomic

    def failing(path, data):
        if path == b / ".sm120kit" / "ledger.json":
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path, data)

    monkeypatch.setattr(transaction, "write_atomic", failing)
    with pytest.raises(UserError) as raised:
        apply.apply(Target("two sites", [a, b]), load_patches())
    assert (
        f"writing {b / '.sm120kit' / 'ledger.json'} failed" in raised.value.message
        and "nothing was changed" in raised.value.message
    )
    after = {**tree_snapshot(a), **{f"b/{k}": v for k, v in tree_snapshot(b).items()}}
    strip = lambda snap: {k: v for k, v in snap.items() if ".sm120kit" not in k}  # noqa: E731
    assert strip(after) == strip(before)
    assert not (a / ".sm120kit" / "ledger.json").exists() and not (b / ".sm120kit" / "ledger.json").exists()
