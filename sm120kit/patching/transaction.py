"""The writing transaction: target files, their backups and the ledger change together.

A run that writes (patch, unpatch) goes through `commit`, in this order, each step durable
(fsync) before the next starts:

  1. a backup of the bytes every file holds now (content-addressed, in the state dir);
  2. the intent journal, <state>/journal.json: which files go from which bytes to which,
     and the digest of the ledger the run will leave;
  3. the files, one atomic replace each;
  4. the ledger (one atomic replace: the commit point);
  5. the journal is removed, then backups nothing refers to any more are collected (but
     the only copy of a file's vendor bytes: Ledger.collect_backups).

A file may also be absent before (a config table tune-moe adds) or after (one unpatch
removes): its digest in the journal is null, and the write is a create or an unlink.

A run killed anywhere leaves every file with its old or its new bytes (atomic replaces)
and, from step 2 on, a journal. The next run that writes (`recover`, under the lock)
finishes it: a ledger that is the one the journal names means the run committed; else
every file that holds its new bytes gets its old bytes back from the backups, and the old
ledger stands. Either way each file is what its ledger says. `status` and `--verify`
report a pending journal instead of a false green.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import glob
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sm120kit import __version__, shallow_json
from sm120kit.atomic_write import TMP_SUFFIX, write_atomic
from sm120kit.errors import UserError, record_change
from sm120kit.patching.ledger import Ledger, sha256

JOURNAL = "journal.json"


@dataclass
class FileWrite:
    site: Path  # whose ledger records this file
    package: str
    relpath: str
    path: Path  # where it lives (the site, or an editable install's source tree)
    before: bytes | None  # None: absent
    after: bytes | None


def _digest(data: bytes | None) -> str | None:
    return None if data is None else sha256(data)


def journal_path(site: Path) -> Path:
    return Ledger(site).state_dir / JOURNAL


def pending(sites: Iterable[Path]) -> list[Path]:
    """The journals an interrupted run left behind."""
    return [p for site in sites if (p := journal_path(site)).exists()]


# -- committing ---------------------------------------------------------------------------


def commit(ledgers: dict[Path, Ledger], writes: list[FileWrite], op: str) -> None:
    """Write every file and every ledger as one transaction (see the module docstring).
    Raises UserError, after rolling back what it can, when a write fails."""
    sites = sorted(ledgers)
    docs = {site: ledgers[site].document() for site in sites}
    try:
        _check_space(ledgers, docs, writes)
        for w in writes:
            if w.before is not None:
                ledgers[w.site].store_backup(w.before)
        for site in sites:
            mine = [w for w in writes if w.site == site]
            journal = {
                "schema": 1,
                "tool": f"sm120kit {__version__}",
                "op": op,
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "files": [
                    {"package": w.package, "path": w.relpath, "before": _digest(w.before), "after": _digest(w.after)}
                    for w in mine
                ],
                "ledger_after": sha256(docs[site]),
            }
            write_atomic(journal_path(site), (json.dumps(journal, indent=2) + "\n").encode())
    except OSError as exc:
        for site in sites:  # nothing was replaced yet: the journal can go
            with contextlib.suppress(OSError):
                journal_path(site).unlink(missing_ok=True)
        raise _write_error(exc, exc.filename or ledgers[sites[0]].state_dir, {}, writes) from None

    touched: list[FileWrite] = []  # a file counts as written from the moment its write starts
    committed: list[Path] = []
    failed: Path | None = None
    try:
        for w in writes:
            failed = w.path
            touched.append(w)
            _replace(w.path, w.after)
        for site in sites:
            failed = ledgers[site].path
            write_atomic(ledgers[site].path, docs[site])
            committed.append(site)
    except OSError as exc:
        assert failed is not None, "each write names its file before it starts"
        states = _roll_back(touched, sites, {site: ledgers[site] for site in committed})
        raise _write_error(exc, failed, states, writes) from None
    # The commit point: from here on the change stands, and a failure says so (exit 4).
    files = f"{len(writes)} file{'' if len(writes) == 1 else 's'}"
    record_change(f"`{op}` wrote {files} and the ledger in {', '.join(map(str, sites))}")
    failures = []
    for site in sites:
        try:
            _finish(ledgers[site])
        except OSError as exc:
            failures.append(f"removing {exc.filename or journal_path(site)} failed ({_reason(exc)})")
    if failures:
        raise UserError(
            "; ".join(failures),
            "the next `sm120kit patch` or `unpatch` finishes the cleanup (`sm120kit status` says what is left)",
        )


def _replace(path: Path, data: bytes | None) -> None:
    """The new bytes in place, atomically; None: the file goes (and its directory, if that
    is left empty: a new table's triton_* directory is sm120kit's; a wheel ships none empty)."""
    if data is None:
        if path.exists() or path.is_symlink():
            path.unlink()
            _fsync_dir(path.parent)
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    if path.read_bytes() != data:
        raise OSError(errno.EIO, "does not read back as written", str(path))


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _roll_back(touched: list[FileWrite], sites: list[Path], committed: dict[Path, Ledger]) -> dict[Path, str]:
    """Put back the old bytes of every file whose write started (and the ledgers of sites
    that already committed); the state each file is in. The journals stay if anything
    could not be put back: the next run finishes the job."""
    states: dict[Path, str] = {}
    for w in reversed(touched):
        try:
            if _read(w.path) == w.before:
                states[w.path] = "unchanged"
                continue
            _replace(w.path, w.before)
            states[w.path] = "rolled back"
        except OSError as exc:
            states[w.path] = f"maybe written ({_reason(exc)}): the next `sm120kit patch` or `unpatch` rolls it back"
    for ledger in committed.values():
        try:
            if ledger.loaded is None:
                ledger.path.unlink(missing_ok=True)
            else:
                write_atomic(ledger.path, ledger.loaded)
            states[ledger.path] = "rolled back"
        except OSError as exc:
            states[ledger.path] = (
                f"maybe written ({_reason(exc)}): the next `sm120kit patch` or `unpatch` rolls it back"
            )
    if all(s in ("unchanged", "rolled back") for s in states.values()):
        for site in sites:
            with contextlib.suppress(OSError):
                _remove_journal(site)
    return states


def _write_error(exc: OSError, failed: str | Path, states: dict[Path, str], writes: list[FileWrite]) -> UserError:
    lines = [f"writing {failed} failed ({_reason(exc)})"]
    if exc.errno == errno.ENOSPC:
        lines[0] += f": the disk holding it, {_mount_point(Path(failed).parent)}, is full ({_free(Path(failed))} free)"
    for path in dict.fromkeys([*(w.path for w in writes), *states]):
        lines.append(f"  {path}: {states.get(path, 'unchanged')}")
    clean = all(s in ("unchanged", "rolled back") for s in states.values())
    lines.append("nothing was changed" if clean else "an interrupted run is recorded in the state directory")
    hint = (
        "free some space and run the command again"
        if exc.errno == errno.ENOSPC
        else "fix the cause and run the command again"
    )
    return UserError("\n".join(lines), hint)


def _reason(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)


def _free(path: Path) -> str:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            return _size(shutil.disk_usage(p).free)
    return "?"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _check_space(ledgers: dict[Path, Ledger], docs: dict[Path, bytes], writes: list[FileWrite]) -> None:
    """Refuse before anything is written when a filesystem cannot hold the run: a new file
    is written beside the old one, and each backup and ledger needs room too."""
    need: dict[int, tuple[Path, int]] = {}

    def add(where: Path, n: int) -> None:
        existing = next((p for p in (where, *where.parents) if p.exists()), where)
        dev = os.stat(existing).st_dev
        path, total = need.get(dev, (existing, 0))
        need[dev] = (path, total + n + 4096)  # a block of slack per file

    for w in writes:
        add(w.path.parent, len(w.after or b""))
        add(ledgers[w.site].state_dir, len(w.before or b""))
    for site, doc in docs.items():
        add(ledgers[site].state_dir, 2 * len(doc) + 8192)  # the ledger and the journal
    for path, total in need.values():
        free = shutil.disk_usage(path).free
        if free < total:
            raise UserError(
                f"not enough space on {_mount_point(path)} (the filesystem holding {path}): "
                f"{_size(free)} free, {_size(total)} needed; nothing was changed",
                "free some space and run the command again",
            )


def _mount_point(path: Path) -> Path:
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _finish(ledger: Ledger) -> None:
    _remove_journal(ledger.site)
    ledger.collect_backups()


def _remove_journal(site: Path) -> None:
    path = journal_path(site)
    path.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- recovering -----------------------------------------------------------------------------


def recover(site: Path, resolve: Callable[[str, str], Path | None]) -> list[str]:
    """Finish what an interrupted run left in `site` (call under the lock). `resolve(package,
    relpath)` gives the file's path inside the target, or None. Returns what was done. A
    write that fails meanwhile leaves the journal for the next run, and says so."""
    try:
        return _recover(site, resolve)
    except OSError as exc:
        journal = journal_path(site)
        left = f"its journal {journal} stays for the next run" if journal.exists() else "the journal is gone"
        raise UserError(
            f"finishing the interrupted sm120kit run in {site} failed at {exc.filename or site} "
            f"({_reason(exc)}); {left}",
            "fix the cause and run the command again: it finishes that run first",
        ) from None


def _recover(site: Path, resolve: Callable[[str, str], Path | None]) -> list[str]:
    ledger = Ledger(site)
    messages = _remove_temp_files(ledger.state_dir, ledger.state_dir / "backups")
    path = journal_path(site)
    if not path.exists():
        if (ledger.state_dir / "backups").is_dir():  # a run killed before its journal: its backups go
            Ledger.load(site).collect_backups()
        return messages
    try:
        journal = shallow_json.loads(path.read_text())
        files = [(str(f["package"]), str(f["path"]), _text(f["before"]), _text(f["after"])) for f in journal["files"]]
        committed = ledger.path.exists() and sha256(ledger.path.read_bytes()) == journal["ledger_after"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{path}: the journal of an interrupted sm120kit run is unreadable ({exc})",
            f"check the files it names by hand, then move it aside (mv {path} {path}.bad)",
        ) from None
    targets = []
    for package, relpath, before, after in files:
        target = resolve(package, relpath)
        if target is not None:
            messages += _remove_temp_files(target.parent, name=target.name)
            targets.append((target, before, after))
    if committed:
        messages.append(f"finished an interrupted sm120kit run in {site}: it had committed")
    else:
        for target, before, after in targets:
            messages.append(_restore(ledger, target, before, after))
        messages.append(f"rolled back an interrupted sm120kit run in {site}")
    _finish(Ledger.load(site))  # the ledger on disk says which backups are still needed
    return messages


def _text(digest: object) -> str | None:
    """A journal's digest: null for an absent file."""
    return None if digest is None else str(digest)


def _restore(ledger: Ledger, target: Path, before: str | None, after: str | None) -> str:
    current = _digest(_read(target))
    if current == before:
        return f"  {target}: was not written yet"
    if current != after:
        return f"  {target}: {'absent' if current is None else 'changed since (an upgrade?)'}, left alone"
    if before is None:  # it did not exist before the run
        _replace(target, None)
        return f"  {target}: removed (rolled back)"
    old = ledger.backup(before)
    if old is None:
        raise UserError(
            f"{target} holds the bytes of an interrupted sm120kit run, "
            f"and the backup {before[:12]} of its old bytes is missing",
            "reinstall the package it belongs to (pip install --force-reinstall --no-deps ...), then remove "
            + str(journal_path(ledger.site)),
        )
    _replace(target, old)
    return f"  {target}: rolled back"


def _remove_temp_files(*dirs: Path, name: str = "") -> list[str]:
    """`write_atomic`'s temp files that a killed run left (only ours: the suffix says so)."""
    removed = []
    for directory in dirs:
        # escaped: a config table's name holds "[128, 128]", a character class to glob
        for tmp in directory.glob(f".{glob.escape(name)}.*{TMP_SUFFIX}" if name else f"*{TMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                if not tmp.is_symlink() and tmp.is_file():
                    tmp.unlink()
                    removed.append(f"removed {tmp}, left by an interrupted run")
    return removed
