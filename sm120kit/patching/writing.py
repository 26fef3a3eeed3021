"""Around every run that writes (`patch`, `unpatch`): the lock of each site and the
recovery of a killed run under it, the refusal of read-only files, the commit through
transaction.py, and what new sources make stale (bytecode, JIT caches).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.patching import jit_cache, transaction
from sm120kit.patching.ledger import Ledger
from sm120kit.patching.ledger_entries import is_table_path
from sm120kit.patching.spec import Patch
from sm120kit.target import Distribution, Target


@contextlib.contextmanager
def locked(target: Target, sites: set[Path], patches: list[Patch]) -> Iterator[list[str]]:
    """The lock of every site, and first of all: finish what a killed run left there.
    Yields what the recovery did. A state directory left with nothing to restore goes
    (after `unpatch` of the last patch, or a run that wrote nothing or was refused: one
    that says "nothing was changed" leaves no lock file behind)."""
    declared = {(p.package, r.path) for p in patches for r in p.rewrites}
    with contextlib.ExitStack() as stack:
        recovered: list[str] = []
        held: list[Path] = []
        try:
            for site in sorted(sites):
                stack.enter_context(Ledger(site).locked())
                held.append(site)
                recovered += transaction.recover(site, functools.partial(resolve, target, declared, site))
            yield recovered
        finally:
            for site in held:  # still under the lock
                _drop_unused_state(site)


def _drop_unused_state(site: Path) -> None:
    """Remove <site>/.sm120kit when it holds nothing to restore or remember: no ledger
    entry (a patched file, a tuned table, an accepted --allow-missing, a config dir), no
    journal, no backup. The lock file goes last, still held: a run that opened it before
    fails on the lock as it would have; one that comes after makes a new one. Anything
    else there (a ledger moved aside as `ledger.json.bad`) keeps the directory."""
    state = Ledger(site).state_dir
    if state.is_symlink() or not state.is_dir() or transaction.pending([site]):
        return
    try:
        ledger = Ledger.load(site)
    except UserError:
        return
    if ledger.files or ledger.tuned or ledger.moe_config_dirs or ledger.allowed_missing:
        return
    with contextlib.suppress(OSError):
        ledger.collect_backups()  # those of a run that failed before its journal (or only copies: they stay)
        (state / "backups").rmdir()  # only when empty
    if (state / "backups").exists():
        return
    for name in ("ledger.json", "lock"):
        with contextlib.suppress(OSError):
            (state / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        state.rmdir()


def resolve(target: Target, declared: set[tuple[str, str]], site: Path, package: str, relpath: str) -> Path | None:
    """A journal's file: only one a loaded patch rewrites, or a config table tune-moe
    writes (in the package, or in a config dir: the site that is no package's), inside."""
    dist = target.find(package)
    if dist is None or dist.site != site:
        path = site / relpath
        table = package == "sglang" and is_table_path(relpath, "config-dir")
        return path if table and path.parent.resolve().is_relative_to(site.resolve()) else None
    if (package, relpath) not in declared and not (package == "sglang" and is_table_path(relpath, "package")):
        return None
    path = dist.file(relpath)
    return path if inside(dist, path) else None


def inside(dist: Distribution, path: Path) -> bool:
    """Whether `path` stays inside the package's install root (no symbolic link out)."""
    root = (dist.editable_root or dist.site).resolve()
    return path.parent.resolve().is_relative_to(root)


def write(ledgers: dict[Path, Ledger], writes: list[transaction.FileWrite], op: str) -> None:
    """Every file and ledger as one crash-safe transaction; then the stale bytecode goes."""
    _check_writable([w.path for w in writes])
    transaction.commit(ledgers, writes, op)
    for w in writes:
        _clear_pycache(w.path)


def _check_writable(paths: list[Path]) -> None:
    """Refuse before writing anything. A file without write bits was made read-only on
    purpose (an image layer, a pinned install): honour that even when running as root."""
    blocked = dict.fromkeys(_read_only_part(p) for p in paths if not _writable(p))
    if blocked:
        listing = ", ".join(f"{p} (mode {p.stat().st_mode & 0o777:04o}{why})" for p, why in blocked)
        chmod = shlex.join(["chmod", "u+w", *(str(p) for p, _ in blocked)])
        raise UserError(
            f"read-only: {listing}; nothing was changed",
            f"make them writable ({chmod}) or patch where the environment is built",
        )


def _read_only_part(path: Path) -> tuple[Path, str]:
    """What makes `path` unwritable: the file (no write bits), or the directory that holds
    it or would (a new file goes in beside the old one). (that path, what it is to `path`)"""
    if path.exists() and not path.stat().st_mode & 0o222:
        return path, ""
    directory = _existing(path.parent)
    return directory, f", the directory {'of' if directory == path.parent else 'above'} {path.name}"


def _writable(path: Path) -> bool:
    """A file: its write bits and its directory's; a file to create: the directory that
    will hold it, or the nearest one there is."""
    if path.exists():
        return bool(path.stat().st_mode & 0o222) and os.access(path.parent, os.W_OK)
    return os.access(_existing(path.parent), os.W_OK)


def _existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def _clear_pycache(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc"):
        with contextlib.suppress(OSError):
            pyc.unlink()


def drop_jit_caches(dists: Iterable[Distribution], keep_jit_cache: bool) -> tuple[list[str], list[Path]]:
    """After the sources of `dists` changed: remove the JIT caches built from the old
    ones, or with --keep-jit-cache say that they were kept. (warnings, removed)"""
    warnings: list[str] = []
    removed: list[Path] = []
    for dist in sorted(dists, key=lambda d: d.name):
        if keep_jit_cache:
            warnings += [
                f"{dist.name}: kept the JIT cache {d} (--keep-jit-cache): it was built from the old sources"
                for d in jit_cache.cache_dirs(dist)
            ]
        else:
            removed += jit_cache.remove(dist)
    return warnings, removed
