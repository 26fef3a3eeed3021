"""Issue 25, items 24-26 and 28-30: I/O errors at every step of a transaction, a failure
after the commit, a patch module that exits at import, paths too long for the system,
deeply nested JSON and source files, binary and non-UTF-8 target files. Each is a clear
message naming the file (or option) with the exit code it documents, and nothing changed
unless the message says what was.

The I/O errors are injected where the run makes them: the operating-system calls of the
process (os.open that creates, the write of a new file's bytes, fsync, rename, unlink,
mkdir, rmdir, chmod) on paths under the target, the N-th of them failing once with the
errno; strace's `inject=` does the same from outside, on the real CLI, where it is
installed; a tmpfs with a few inodes left is the real thing."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.sites import install, patch_dir
from support.tree import tree_snapshot

from sm120kit.exit_codes import ExitCode

FORWARD_MHA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
PREFILL = "sglang/kernels/ops/attention/prefill_attention.py"
FILES = (FORWARD_MHA, PREFILL)
ONLY = ("--only", "sglang-dsa-page-table-guard", "--only", "sglang-triton-smem-sm120")  # the two that write FILES
KINDS = ("create", "write", "fsync", "rename", "unlink", "mkdir", "rmdir", "chmod")
ERRNOS = (errno.EIO, errno.ENOSPC, errno.EROFS)

# What these tests prove is the engine around the rewrite, at every step of a write.
pytestmark = pytest.mark.usefixtures("rewrites_once")


class Faults:
    """Counts the I/O steps of this process under `root`, by kind, and fails the `n`-th of
    `kind` once with `err` (as the kernel would: an OSError with that errno)."""

    def __init__(self, root: Path, kind: str | None = None, n: int = 0, err: int = errno.EIO) -> None:
        self.root, self.kind, self.n, self.err = str(root), kind, n, err
        self.counts = dict.fromkeys(KINDS, 0)
        self.failed: str | None = None  # the path of the step that failed

    def step(self, kind: str, path) -> None:
        path = os.fsdecode(path) if path is not None else ""
        if not path.startswith(self.root):
            return
        self.counts[kind] += 1
        if kind == self.kind and self.counts[kind] == self.n:
            self.failed = path
            raise OSError(self.err, os.strerror(self.err), path)

    @contextlib.contextmanager
    def active(self):
        real = {name: getattr(os, name) for name in ("open", "fdopen", "fsync", "replace", "rename", "unlink")}
        real |= {name: getattr(os, name) for name in ("mkdir", "rmdir", "chmod")}

        def fd_path(fd: int) -> str:
            with contextlib.suppress(OSError):
                return os.readlink(f"/proc/self/fd/{fd}")
            return ""

        def open_(path, flags, *args, **kwargs):
            if flags & os.O_CREAT:
                self.step("create", path)
            return real["open"](path, flags, *args, **kwargs)

        def fdopen(fd, mode="r", *args, **kwargs):
            fh = real["fdopen"](fd, mode, *args, **kwargs)
            if "w" in mode:
                path, write = fd_path(fd), fh.write

                def checked_write(data):
                    self.step("write", path)
                    return write(data)

                fh.write = checked_write
            return fh

        def fsync(fd):
            path = fd_path(fd)
            if not os.path.isdir(path):  # a directory's fsync: suppressed by design, nothing to report
                self.step("fsync", path)
            return real["fsync"](fd)

        def renamer(name):
            def rename(src, dst, **kwargs):
                self.step("rename", dst)
                return real[name](src, dst, **kwargs)

            return rename

        def simple(name, kind):
            def call(path, *args, **kwargs):
                # the kernel answers EEXIST / ENOENT before it touches the disk: only a real step can fail
                if (name == "mkdir") != os.path.lexists(path):
                    self.step(kind, path)
                return real[name](path, *args, **kwargs)

            return call

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "open", open_)
            mp.setattr(os, "fdopen", fdopen)
            mp.setattr(os, "fsync", fsync)
            mp.setattr(os, "replace", renamer("replace"))
            mp.setattr(os, "rename", renamer("rename"))
            for name in ("unlink", "mkdir", "rmdir", "chmod"):
                mp.setattr(os, name, simple(name, name))
            yield self


def points(counts: dict[str, int]) -> list[tuple[str, int, int]]:
    """Every counted step, each with one of ERRNOS (in turn, so each kind meets each)."""
    steps = [(kind, n) for kind in KINDS for n in range(1, counts[kind] + 1)]
    return [(kind, n, ERRNOS[i % len(ERRNOS)]) for i, (kind, n) in enumerate(steps)]


def vendor_files(site: Path) -> dict[str, bytes]:
    return {f: (site / f).read_bytes() for f in FILES}


def outside_state(site: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_snapshot(site).items() if not k.startswith(".sm120kit")}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """sglang 0.5.23, unpatched and with the two patches of ONLY applied."""
    root = tmp_path_factory.mktemp("faults")
    vendor = root / "vendor" / "site-packages"
    vendor.mkdir(parents=True)
    install(vendor, "0.5.23", flashinfer=False)
    patched = root / "patched" / "site-packages"
    shutil.copytree(vendor, patched)
    from sm120kit.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["patch", "--site", str(patched), *ONLY]) == 0
    assert all(vendor_files(vendor)[f] != vendor_files(patched)[f] for f in FILES)
    return vendor, patched


def fresh(template: Path, where: Path) -> Path:
    shutil.rmtree(where, ignore_errors=True)
    site = where / "site-packages"
    shutil.copytree(template, site, symlinks=True)
    return site


def count_steps(template: Path, tmp_path: Path, cli, argv: list[str]) -> dict[str, int]:
    site = fresh(template, tmp_path / "count")
    with Faults(site).active() as counted:
        assert cli(*argv, "--site", site, *ONLY)[0] == 0
    return counted.counts


def assert_clear(code: int, err: str, faults: Faults, where: str) -> None:
    """Exit 2 or 4, no internal error, and the message names what failed and why."""
    assert code in (ExitCode.ERROR, ExitCode.AFTER_CHANGE), f"{where}: exit {code}\n{err}"
    assert "internal error" not in err and "Traceback" not in err, f"{where}:\n{err}"
    assert os.strerror(faults.err) in err, f"{where}:\n{err}"  # "[Errno 28] ..." or, read-only, in words
    assert re.search(r"/\S+", err), f"{where}: no file named\n{err}"
    if code == ExitCode.AFTER_CHANGE:
        assert "the change was made (`" in err, f"{where}:\n{err}"
    else:
        assert "nothing was changed" in err, f"{where}:\n{err}"


# -- item 24: every injected I/O failure of a transaction --------------------------------


def test_every_io_failure_of_patch_is_a_clear_error_and_changes_nothing(templates, tmp_path, cli):
    """On HEAD a failure while the backups or the journal are written was `internal error:
    AttributeError: 'list' object has no attribute 'get'`, and one removing the journal
    after the commit an internal OSError."""
    vendor, patched = templates
    counts = count_steps(vendor, tmp_path, cli, ["patch"])
    assert counts["write"] >= 6 and counts["rename"] >= 6  # 2 backups, the journal, 2 files, the ledger
    for kind, n, err in points(counts):
        site = fresh(vendor, tmp_path / "run")
        where = f"patch: {errno.errorcode[err]} at {kind} #{n}"
        with Faults(site, kind, n, err).active() as faults:
            code, _out, stderr = cli("patch", "--site", site, *ONLY)
        if faults.failed is None:  # a step that only some runs take (the lock file exists by then)
            assert code == 0, where
            continue
        assert_clear(code, stderr, faults, where)
        if code == ExitCode.ERROR:
            assert outside_state(site) == outside_state(vendor), where
            assert not (site / ".sm120kit" / "ledger.json").exists(), where
        else:  # after the commit: every file patched, and the next run finishes the cleanup
            assert vendor_files(site) == vendor_files(patched), where
        code, out, stderr = cli("patch", "--verify", "--site", site, *ONLY)
        assert code == 0 and "verified" in out, f"{where}: the next run\n{out}{stderr}"
        assert vendor_files(site) == vendor_files(patched), where
        assert not list(site.rglob("*.sm120kit-tmp")) and not (site / ".sm120kit" / "journal.json").exists()


def test_every_io_failure_of_unpatch_is_a_clear_error_and_changes_nothing(templates, tmp_path, cli):
    vendor, patched = templates
    counts = count_steps(patched, tmp_path, cli, ["unpatch"])
    assert counts["unlink"] >= 3  # the journal and the two backups nothing needs any more
    for kind, n, err in points(counts):
        site = fresh(patched, tmp_path / "run")
        where = f"unpatch: {errno.errorcode[err]} at {kind} #{n}"
        with Faults(site, kind, n, err).active() as faults:
            code, _out, stderr = cli("unpatch", "--site", site, *ONLY)
        if faults.failed is None:
            assert code == 0, where
            continue
        if code == ExitCode.OK:  # a step whose failure costs nothing: a leftover empty directory
            assert vendor_files(site) == vendor_files(vendor), where
            continue
        assert_clear(code, stderr, faults, where)
        if code == ExitCode.ERROR:
            assert outside_state(site) == outside_state(patched), where
        else:
            assert vendor_files(site) == vendor_files(vendor), where
        code, out, stderr = cli("unpatch", "--site", site, *ONLY)
        assert code == 0, f"{where}: the next run\n{out}{stderr}"
        assert vendor_files(site) == vendor_files(vendor), where


def test_a_failed_backup_write_names_the_backup_and_the_errno(templates, tmp_path, cli):
    """The case of the issue, in words: `strace -e inject=write:error=ENOSPC` on the first
    backup. Before: internal error: AttributeError: 'list' object has no attribute 'get'."""
    vendor, _ = templates
    site = fresh(vendor, tmp_path / "run")
    with Faults(site, "write", 1, errno.ENOSPC).active() as faults:
        code, _out, err = cli("patch", "--site", site, *ONLY)
    assert "/.sm120kit/backups/" in faults.failed  # the temp file beside the backup: the message names the backup
    backup = re.escape(str(site / ".sm120kit" / "backups")) + r"/[0-9a-f]{64}"
    assert code == 2 and re.search(rf"writing {backup} failed \(\[Errno 28\] No space left on device\)", err), err
    assert "nothing was changed" in err and "free some space" in err
    assert outside_state(site) == outside_state(vendor) and not (site / ".sm120kit" / "journal.json").exists()


def test_a_full_lock_directory_is_no_read_only_environment(templates, tmp_path, cli):
    """Out of inodes for the lock file: said as it is, not as "read-only for this user"."""
    vendor, _ = templates
    site = fresh(vendor, tmp_path / "run")
    with Faults(site, "create", 1, errno.ENOSPC).active():
        code, _out, err = cli("patch", "--site", site, *ONLY)
    assert code == 2 and "cannot be written ([Errno 28] No space left on device)" in err, err
    assert "read-only" not in err and "df -i" in err


@pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed")
def test_strace_injected_write_errors_on_the_real_cli(templates, tmp_path):
    """The reproduction of the issue: `strace -f -e inject=write:error=E:when=N sm120kit
    patch --site SITE`, N each write the run makes under the site."""
    vendor, _ = templates
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SM120KIT_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "sm120kit", "patch", *ONLY, "--site"]
    warm = fresh(vendor, tmp_path / "warm")  # the outcome cache filled: the runs below write only the site
    subprocess.run([*command, str(warm)], env=env, check=True, capture_output=True)
    site = fresh(vendor, tmp_path / "count")
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-y", "-o", trace, "-e", "trace=write", *command, site],
        env=env,
        check=True,
        capture_output=True,
    )
    writes = [line for line in trace.read_text().splitlines() if re.search(r"\bwrite\(\d+<", line)]
    under = [i + 1 for i, line in enumerate(writes) if f"<{site}/" in line]
    assert len(under) >= 6, writes
    for n in under:
        for err in ("EIO", "ENOSPC"):
            site = fresh(vendor, tmp_path / "run")
            proc = subprocess.run(
                [
                    "strace",
                    "-f",
                    "-o",
                    os.devnull,
                    "-e",
                    "trace=write",
                    "-e",
                    f"inject=write:error={err}:when={n}",
                    *command,
                    str(site),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            where = f"{err} at write #{n}"
            assert proc.returncode in (2, 4), f"{where}: exit {proc.returncode}\n{proc.stderr}"
            assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, f"{where}\n{proc.stderr}"
            assert str(site) in proc.stderr and f"[Errno {getattr(errno, err)}]" in proc.stderr, where
            if proc.returncode == 2:
                assert outside_state(site) == outside_state(vendor), where


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("inodes_left", range(8))
def test_out_of_inodes_changes_nothing_or_everything(tmp_path, cli, inodes_left):
    """A real tmpfs, its inodes used up but `inodes_left`."""
    with tmpfs(tmp_path / "disk", "size=64m,nr_inodes=4000") as disk:
        site = disk / "site-packages"
        site.mkdir()
        install(site, "0.5.23", flashinfer=False)
        before = outside_state(site)
        filler = disk / "filler"
        filler.mkdir()
        made = []
        with contextlib.suppress(OSError):
            while True:
                (filler / str(len(made))).touch()
                made.append(len(made))
        for i in made[len(made) - inodes_left :]:
            (filler / str(i)).unlink()
        code, out, err = cli("patch", "--site", site, *ONLY)
        assert "internal error" not in err and "Traceback" not in out + err
        if code == 0:
            assert all(vendor_files(site)[f] != before[f] for f in FILES)
        else:
            assert code == 2 and "No space left on device" in err and str(site) in err, err
            assert outside_state(site) == before
        shutil.rmtree(filler)
        assert cli("patch", "--verify", "--site", site, *ONLY)[0] == 0


# -- item 25: a failure after the commit -------------------------------------------------


def test_output_that_cannot_be_written_after_the_commit_says_the_change_was_made(templates, tmp_path):
    """`sm120kit patch > /dev/full`: before, the patches were applied and the run exited 2
    with `internal error: OSError: [Errno 28] No space left on device`."""
    vendor, patched = templates
    site = fresh(vendor, tmp_path / "run")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "sm120kit", "patch", "--site", str(site), *ONLY],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert proc.returncode == ExitCode.AFTER_CHANGE, proc.stderr
    assert f"the change was made (`patch` wrote 2 files and the ledger in {site})" in proc.stderr
    assert "then this failed: writing the output failed ([Errno 28] No space left on device)" in proc.stderr
    assert f"next: run `sm120kit status --site {site}`" in proc.stderr
    assert "internal error" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert vendor_files(site) == vendor_files(patched)


@pytest.mark.parametrize("argv", [["status"], ["patches"], ["status", "--json"], ["patch", "--check"]])
def test_output_that_cannot_be_written_by_a_read_only_command_is_exit_2(templates, argv):
    vendor, _ = templates
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "sm120kit", *argv, *([] if argv == ["patches"] else ["--site", str(vendor)])],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert proc.returncode == 2, proc.stderr
    assert "sm120kit: error: writing the output failed ([Errno 28] No space left on device)" in proc.stderr
    assert "internal error" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_removing_the_journal_fails_after_the_commit(templates, tmp_path, cli):
    """EIO on the journal's unlink: the change stands (exit 4, said so, in --json too); the
    journal stays, `status` says the run is unfinished, the next `patch` finishes it."""
    vendor, patched = templates
    site = fresh(vendor, tmp_path / "run")
    journal = site / ".sm120kit" / "journal.json"
    with Faults(site, "unlink", 1, errno.EIO).active() as faults:
        code, out, err = cli("patch", "--site", site, *ONLY, "--json")
    assert faults.failed == str(journal)
    doc = json.loads(out)
    assert code == doc["exit_code"] == ExitCode.AFTER_CHANGE == 4
    assert doc["changed"] == [f"`patch` wrote 2 files and the ledger in {site}"]
    assert f"then this failed: removing {journal} failed ([Errno 5] Input/output error)" in doc["error"]
    assert f"the next `sm120kit patch --site {site}` or `unpatch` finishes the cleanup" in doc["hint"]
    assert "Traceback" not in err
    assert vendor_files(site) == vendor_files(patched) and journal.exists()
    assert cli("status", "--site", site, *ONLY)[0] == 2  # never green while the journal is there
    code, out, err = cli("patch", "--verify", "--site", site, *ONLY)
    assert code == 0 and "it had committed" in err and "verified" in out and not journal.exists()


def test_the_exit_code_table_has_4():
    from sm120kit.cli import build_parser

    assert ExitCode.AFTER_CHANGE == 4
    parser = build_parser()
    assert "4 the change was made" in " ".join(parser.epilog.split())


# -- item 26: a patch module that exits at import ----------------------------------------


@pytest.mark.parametrize(
    "body, says",
    [
        ("import sys\nsys.exit(0)\n", "it calls sys.exit(0) at import"),
        ("raise SystemExit('bye')\n", "it calls sys.exit('bye') at import"),
        ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
        ("raise GeneratorExit\n", "GeneratorExit"),
    ],
)
@pytest.mark.parametrize("argv", [["patch", "--verify"], ["patches"], ["status"]])
def test_a_patch_module_that_exits_at_import_is_exit_2_naming_it(templates, tmp_path, body, says, argv):
    """Before: `patch --verify` exited 0 with no output and nothing patched (sys.exit(0)),
    130 (KeyboardInterrupt); `patches` exited 0."""
    vendor, _ = templates
    site = fresh(vendor, tmp_path / "run")
    mine = patch_dir(tmp_path / "mine", "sglang", "exits", body)
    target = [] if argv == ["patches"] else ["--site", str(site)]
    proc = subprocess.run(
        [sys.executable, "-m", "sm120kit", *argv, "--patch-dir", str(mine), *target], capture_output=True, text=True
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert f"{mine / 'sglang' / 'exits.py'}: the patch module failed to load ({says})" in proc.stderr.replace("\n", " ")
    assert "next: fix the module or remove its directory from --patch-dir" in proc.stderr
    assert outside_state(site) == outside_state(vendor)


# -- item 28: paths too long for the system ----------------------------------------------

LONG_NAME = "/tmp/" + "n" * 300
LONG_PATH = "/tmp/" + "d/" * 2100


@pytest.mark.parametrize(
    "argv, option",
    [
        (["status", "--site", LONG_NAME], "--site"),
        (["status", "--site", LONG_PATH], "--site"),
        (["status", "--python", LONG_NAME], "--python"),
        (["status", "--python", LONG_PATH], "--python"),
        (["profile", "check", "glm5-nvfp4", "--site", LONG_NAME], "--site"),
        (["profile", "check", "glm5-nvfp4", "--python", LONG_PATH], "--python"),
        (["patch", "--site", LONG_NAME], "--site"),
        (["unpatch", "--site", LONG_PATH], "--site"),
        (["serve", "glm5-nvfp4", "--dry-run", "--site", LONG_NAME], "--site"),
        (["patches", "--patch-dir", LONG_NAME], "--patch-dir"),
        (["profiles", "--profile-dir", LONG_PATH], "--profile-dir"),
    ],
)
def test_a_path_too_long_for_the_system_is_a_user_error_naming_the_option(cli, argv, option):
    """Before: internal error: OSError: [Errno 36] File name too long, and no --json document."""
    code, _out, err = cli(*argv)
    assert code == 2 and f"sm120kit: error: {option} /tmp/" in err, err
    assert re.search(r"(the name n+\.\.\. in it is 300 bytes long|the path is \d+ bytes long)", err), err
    assert "internal error" not in err and "next: give a shorter path" in err
    code, doc = cli.json(*argv)
    assert code == 2 and doc["exit_code"] == 2 and doc["error"].startswith(f"{option} /tmp/"), doc


def test_a_long_path_from_any_other_option_names_that_option(cli, tmp_path):
    """The catch-all: an ENAMETOOLONG from an option no check knows names it too."""
    code, _out, err = cli("diagnose", LONG_NAME + "/server.log")
    assert code == 2 and "internal error" not in err, err
    code, _out, err = cli("doctor", "--nvml", LONG_PATH + "x.json")
    assert code == 2 and "--nvml" in err and "internal error" not in err, err


# -- item 29: deeply nested JSON and source files ----------------------------------------

DEEP_LIST = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a": ' * 50_000 + "1" + "}" * 50_000
NESTED = "nested 100000 levels deep"


def test_a_deeply_nested_ledger_is_reported_damaged(templates, tmp_path, cli):
    _, patched = templates
    site = fresh(patched, tmp_path / "run")
    (site / ".sm120kit" / "ledger.json").write_text(DEEP_LIST)
    before = tree_snapshot(site)
    for argv in (["status"], ["patch"], ["unpatch"], ["patch", "--verify"]):
        code, out, err = cli(*argv, "--site", site)
        assert code == 2 and "the sm120kit ledger is damaged: unreadable (nested 100000 levels deep" in out + err
        assert "internal error" not in err and "RecursionError" not in out + err
    assert tree_snapshot(site) == before


def test_a_deeply_nested_journal_is_reported_unreadable(templates, tmp_path, cli):
    _, patched = templates
    site = fresh(patched, tmp_path / "run")
    (site / ".sm120kit" / "journal.json").write_text(DEEP_OBJECT)
    before = tree_snapshot(site)
    code, _out, err = cli("patch", "--site", site)
    assert code == 2 and "the journal of an interrupted sm120kit run is unreadable (nested 50000 levels" in err, err
    assert tree_snapshot(site) == before


def test_a_deeply_nested_run_record_is_listed_damaged(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    record = tmp_path / "state" / "serve" / "glm5-nvfp4"
    record.mkdir(parents=True)
    (record / "state.json").write_text(DEEP_LIST)
    code, out, err = cli("ps")
    assert code == 2 and "damaged" in out and "internal error" not in err
    assert NESTED in err or NESTED in out
    code, doc = cli.json("ps")
    assert code == 2 and NESTED in json.dumps(doc)


def test_a_deeply_nested_nvml_document_is_refused(tmp_path, cli):
    path = tmp_path / "nvml.json"
    path.write_text(DEEP_LIST)
    code, _out, err = cli("doctor", "--nvml", path)
    assert code == 2 and f"--nvml {path}: cannot read an NVML document ({NESTED}" in err, err


def test_a_deeply_nested_model_config_is_refused(tmp_path):
    from sm120kit.errors import UserError
    from sm120kit.model_config import read_model_config

    path = tmp_path / "config.json"
    path.write_text(DEEP_OBJECT)
    with pytest.raises(UserError) as refused:
        read_model_config(path)
    assert f"{path} is not readable JSON: nested 50000 levels deep" in refused.value.message


def test_shallow_json_bounds_the_depth_outside_strings_only():
    from sm120kit import shallow_json

    assert shallow_json.depth('{"a": [1, {"b": "[[[[{{{"}]}') == 3
    assert shallow_json.loads('{"a": "' + "[" * 1000 + '"}') == {"a": "[" * 1000}
    assert shallow_json.loads("[" * 64 + "]" * 64) is not None
    with pytest.raises(ValueError, match="nested 65 levels deep"):
        shallow_json.loads("[" * 65 + "]" * 65)


DEEP_SOURCES = {
    "parentheses": b"x = " + b"(" * 50_000 + b"1" + b")" * 50_000 + b"\n",
    "a chain of operators": b"x = " + b"+".join([b"1"] * 50_000) + b"\n",
    "a chain of lambdas": b"x = " + b"lambda: " * 5_000 + b"1\n",
    "a syntax error, then nesting": b"def (:\n" + b"x = " + b"-" * 50_000 + b"1\n",
}


@pytest.mark.parametrize("case", DEEP_SOURCES)
def test_a_deeply_nested_target_file_is_reported_not_parsed_with_sigsegv(templates, tmp_path, case):
    """Before: `status` died by SIGSEGV (exit -11) inside libcst's native parser. Run in a
    subprocess: a SIGSEGV here would take pytest with it."""
    vendor, _ = templates
    site = fresh(vendor, tmp_path / "run")
    (site / FORWARD_MHA).write_bytes((site / FORWARD_MHA).read_bytes() + DEEP_SOURCES[case])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sm120kit",
            "status",
            "--site",
            str(site),
            "--only",
            "sglang-dsa-page-table-guard",
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "SM120KIT_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    [row] = json.loads(proc.stdout)["results"]
    assert row["error"] and FORWARD_MHA in row["detail"], row
    assert "nested deeper than Python's parser allows" in row["detail"] or "does not parse" in row["detail"], row


def test_the_parse_gate_lets_every_real_target_file_through():
    """The gate refuses nothing the releases ship: every file a shipped patch rewrites, in
    the newest and the oldest release of the window."""
    from support.sites import WINDOW, wheel_bytes

    from sm120kit.patching import transform
    from sm120kit.patching.registry import load_patches

    for version in (WINDOW[0], WINDOW[-1]):
        for relpath in sorted({r.path for p in load_patches() if p.package == "sglang" for r in p.rewrites}):
            try:
                source = wheel_bytes(version, relpath)
            except KeyError:
                continue
            assert transform._refused_by_python(source, relpath) is None, (version, relpath)


# -- item 30: binary and non-UTF-8 target files ------------------------------------------

UNREADABLE = {
    "a binary file": (os.urandom(4096).replace(b"\0", b"") + b"\0\x01\x02", "holds NUL bytes: not Python source"),
    "NUL bytes in the source": (b"x = 1\n\0y = 2\n", "holds NUL bytes: not Python source"),
    "latin-1 in a comment": (b"x = 1\n# caf\xe9\n", "is not Python source text ('utf-8' codec can't decode byte 0xe9"),
    "latin-1 on the first line": (b"x = 'caf\xe9'\n", "is not Python source text (invalid or missing encoding"),
    "a bad encoding cookie": (b"# -*- coding: nosuch -*-\nx = 1\n", "is not Python source text (unknown encoding"),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_an_unreadable_target_file_is_named_in_status(templates, tmp_path, cli, case):
    """Before: `internal error: SyntaxError: invalid or missing encoding declaration` (binary)
    or `UnicodeDecodeError` (latin-1)."""
    vendor, _ = templates
    site = fresh(vendor, tmp_path / "run")
    data, says = UNREADABLE[case]
    (site / FORWARD_MHA).write_bytes(data)
    before = tree_snapshot(site)
    for argv in (["status"], ["patch"], ["patch", "--check"]):
        code, doc = cli.json(*argv, "--site", site, "--only", "sglang-dsa-page-table-guard")
        [row] = doc["results"]
        assert code == 2 and row["error"] and f"{FORWARD_MHA} {says}" in row["detail"], (argv, row)
    assert tree_snapshot(site) == before


def test_a_binary_server_args_is_named_by_serve_dry_run(tmp_path, cli):
    """serve --dry-run reads the release's server_args.py for its flags."""
    from support.standin import make_env_python

    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", "0.5.23")
    server_args = tmp_path / "env" / "site-packages" / "sglang" / "srt" / "server_args.py"
    for data in (b"\x7fELF\x02\x01\x01\0\0\0" + os.urandom(2048), b"x = 'caf\xe9'\n"):
        server_args.write_bytes(data)
        code, _out, err = cli("serve", "glm5-nvfp4", "--dry-run", "--python", python)
        assert code == 2 and str(server_args) in err and "internal error" not in err, err
