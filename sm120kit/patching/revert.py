"""`unpatch`: give back the vendor's bytes of every file the ledger says carries a patch.

Each file is proven against RECORD (or, for an editable install, the bytes seen before
patching); the file's other patches are re-applied to the original. A file removed by hand
comes back from the backup of the bytes RECORD lists; patched code whose ledger entry was
lost, from that backup too (its entry rebuilt as planning rebuilds it); the entry of a
package that is not installed any more only goes (stale). Without --only, the changes of
other commands that the ledger records go too, in the same transaction: the MoE config
tables tune-moe installed, through the TrackedChange that sm120kit.tune.removal registers
(patching imports no command). Nothing is written if any file cannot be restored.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from sm120kit.patching import planning, transaction, transform, writing
from sm120kit.patching.ledger import FileEntry, Ledger, ReadOnly, sha256
from sm120kit.patching.planning import read_entry
from sm120kit.patching.spec import Outcome, Patch, Rewrite
from sm120kit.patching.verdicts import TargetFile, entry_from_backup
from sm120kit.target import Distribution, Target, reinstall_command


class RestoreOutcome(str, enum.Enum):
    RESTORED = "restored"
    WOULD_RESTORE = "would-restore"
    PRISTINE = "pristine"  # already the vendor's bytes: only the ledger entry goes
    STALE = "stale"  # no installed file any more (uninstalled, gone in an upgrade): only the ledger entry goes
    FOREIGN_EDIT = "foreign-edit"
    NO_BACKUP = "no-backup"  # nothing to restore from (or to re-apply the other patches with)

    @property
    def is_error(self) -> bool:
        return self in (RestoreOutcome.FOREIGN_EDIT, RestoreOutcome.NO_BACKUP)


@dataclass
class Restore:
    package: str
    version: str
    path: str
    patch_ids: list[str]
    outcome: RestoreOutcome
    detail: str = ""

    @property
    def is_error(self) -> bool:
        return self.outcome.is_error

    def as_json(self) -> dict:
        return {
            "package": self.package,
            "version": self.version,
            "path": self.path,
            "patch_ids": self.patch_ids,
            "outcome": self.outcome.value,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class TrackedChange:
    """Files another command writes through patching's lock, transaction and ledger, as
    unpatch takes them out. That command's package registers it (`register`)."""

    name: str  # e.g. "tune-moe"
    sites: Callable[[Target], set[Path]]  # whose ledgers hold its files (locked with the others)
    # (target, the ledgers as they will be written, --force) -> (rows, writes, warnings); updates the ledgers
    plan_removal: Callable[
        [Target, Mapping[Path, Ledger], bool], tuple[list[Restore], list[transaction.FileWrite], list[str]]
    ]


TRACKED: list[TrackedChange] = []


def register(change: TrackedChange) -> None:
    """unpatch (without --only) takes `change`'s files out too. Registering twice is once."""
    if all(c.name != change.name for c in TRACKED):
        TRACKED.append(change)


@dataclass
class Unpatched:
    rows: list[Restore] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    jit_cache_removed: list[Path] = field(default_factory=list)


def unpatch(
    target: Target,
    patches: list[Patch],
    only: set[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    keep_jit_cache: bool = False,
) -> Unpatched:
    """Give back the vendor's bytes for every file that carries one of the patches in
    `only` (all when None); other patches on the same file are re-applied to the original.
    Proven against RECORD (or, for an editable install, the bytes seen before patching).
    JIT caches built from the patched sources go too."""
    request = _Request(target, patches, only if only is not None else {p.id for p in patches}, force, only is None)
    sites = planning.ledger_sites(target, [p for p in patches if p.id in request.wanted])
    if request.tables:
        for change in TRACKED:
            sites |= change.sites(target)
    # a dry run takes no lock and finishes no interrupted run: it recovers nothing
    guard: contextlib.AbstractContextManager[list[str]] = (
        writing.locked(target, sites, patches) if not dry_run else contextlib.nullcontext([])
    )
    try:
        with guard as recovered:
            result, ledgers, writes = _plan_unpatch(request, sites)
            result.warnings[:0] = recovered
            if dry_run:
                result.warnings += [
                    f"an interrupted sm120kit run left {j}: `sm120kit unpatch` finishes it first, "
                    "so what it restores may differ"
                    for j in transaction.pending(sites)
                ]
            if dry_run or any(r.is_error for r in result.rows):
                return result
            if writes or any(ledger.changed for ledger in ledgers.values()):
                writing.write(ledgers, writes, "unpatch")
    except ReadOnly:
        result, ledgers, writes = _plan_unpatch(request, sites)
        if writes or any(ledger.changed for ledger in ledgers.values()):
            raise
        return result
    restored = [r for r in result.rows if r.outcome is RestoreOutcome.WOULD_RESTORE]
    for row in restored:
        row.outcome = RestoreOutcome.RESTORED
    restored_dists = {d for r in restored if (d := target.find(r.package))}
    warnings, removed = writing.drop_jit_caches(restored_dists, keep_jit_cache)
    result.warnings += warnings
    result.jit_cache_removed += removed
    return result


@dataclass(frozen=True)
class _Request:
    target: Target
    patches: list[Patch]  # every loaded patch
    wanted: set[str]  # the ids to take out
    force: bool
    tables: bool = False  # the TRACKED changes too (tune-moe's tables)

    @cached_property
    def by_id(self) -> dict[str, Patch]:
        return {p.id: p for p in self.patches}


@dataclass
class _FileRestore:
    """What unpatch does to one ledger entry's file."""

    row: Restore
    write: transaction.FileWrite | None = None
    forget: bool = False  # the entry goes from the ledger
    entry: FileEntry | None = None  # or is replaced by this one (other patches re-applied)


def _plan_unpatch(
    request: _Request, sites: set[Path]
) -> tuple[Unpatched, dict[Path, Ledger], list[transaction.FileWrite]]:
    """(the rows, the ledgers as they will be, the file writes) of an unpatch."""
    ledgers = {s: Ledger.load(s) for s in sorted(sites)}
    planned = [
        (ledger, key, _plan_restore(request, ledger, entry))
        for ledger in ledgers.values()
        for key, entry in ledger.files.items()
        if set(entry.patches) & request.wanted
    ]
    planned += _unrecorded(request, ledgers)
    rows = [p.row for _, _, p in planned]
    for ledger, key, p in planned:
        if p.forget:
            ledger.files.pop(key, None)
        elif p.entry is not None:
            ledger.files[key] = p.entry
    for ledger in ledgers.values():
        ledger.forget_allowances(request.wanted)
    writes = [p.write for _, _, p in planned if p.write is not None]
    if request.tables:
        warnings: list[str] = []
        for change in TRACKED:
            removed, written, said = change.plan_removal(request.target, ledgers, request.force)
            rows, writes, warnings = rows + removed, writes + written, warnings + said
        return Unpatched(rows, warnings), ledgers, writes
    return Unpatched(rows), ledgers, writes


def _plan_restore(request: _Request, ledger: Ledger, entry: FileEntry, lost: bool = False) -> _FileRestore:
    """What unpatch does to the file of one ledger entry (`lost`: an entry rebuilt from the
    backups, the ledger's own was lost: see _unrecorded)."""
    ids = sorted(set(entry.patches) & request.wanted)
    dist = request.target.find(entry.package)
    row = Restore(entry.package, dist.version if dist else entry.version, entry.path, ids, RestoreOutcome.WOULD_RESTORE)
    path = _entry_file(ledger, entry, [request.by_id[i] for i in ids], dist)
    if dist is None or path is None:
        row.outcome = RestoreOutcome.STALE
        row.detail = f"{entry.package} is not installed any more: nothing to restore; the ledger entry goes"
        return _FileRestore(row, forget=True)
    current = read_entry(ledger, path)
    if current is None:
        return _restore_removed(request, ledger, entry, ids, row, dist, path)
    recorded = dist.recorded_sha256(entry.path)
    digest = sha256(current)
    if digest in (recorded, entry.vendor_sha256):
        row.outcome, row.detail = RestoreOutcome.PRISTINE, "already the vendor's bytes (reinstalled or upgraded)"
        return _FileRestore(row, forget=True)
    if digest != entry.patched_sha256 and not request.force:
        row.outcome = RestoreOutcome.FOREIGN_EDIT
        row.detail = (
            "no ledger entry (the ledger was lost), and not the bytes the patches in place write on the vendor's, "
            "so nothing proves them sm120kit's alone; pass --force to restore the original anyway (an edit is lost)"
            if lost
            else "changed since sm120kit wrote it; pass --force to restore the original anyway"
        )
        return _FileRestore(row)
    original, keep, problem = _original(request, ledger, entry, ids, entry.vendor_sha256)
    if original is None:
        row.outcome, row.detail = RestoreOutcome.NO_BACKUP, problem
        return _FileRestore(row)
    new = transform.run_rewrites(original, keep, entry.version, entry.path)[0] if keep else original
    write = transaction.FileWrite(ledger.site, entry.package, entry.path, path, current, new)
    why = "no ledger entry (the ledger was lost); its backup " if lost else ""  # + "matches the wheel's RECORD"
    if new == original:
        row.detail = why + _proof(sha256(new), recorded, entry.vendor_sha256)
        return _FileRestore(row, write, forget=True)
    remaining = {p.id: p.revision for p, _ in keep}
    row.detail = f"{why}re-applied on the original: {', '.join(remaining)}"
    return _FileRestore(row, write, entry=replace(entry, patched_sha256=sha256(new), patches=remaining))


def _restore_removed(
    request: _Request, ledger: Ledger, entry: FileEntry, ids: list[str], row: Restore, dist: Distribution, path: Path
) -> _FileRestore:
    """A file the ledger records that is gone. One the wheel's RECORD lists was removed by
    hand: it comes back from the backup of the bytes RECORD names (the file's other patches
    re-applied), the only copy sm120kit has; without that backup nothing is written, and the
    backups stay. One RECORD does not list is no file of the installed release any more."""
    recorded = dist.recorded_sha256(entry.path)
    if recorded is None:
        row.outcome = RestoreOutcome.STALE
        row.detail = (
            f"gone from {dist.name}'s source tree: nothing to restore; the ledger entry goes"
            if dist.editable_root
            else f"not a file of {dist.name} {dist.version} (its RECORD does not list it): "
            "nothing to restore; the ledger entry goes"
        )
        return _FileRestore(row, forget=True)
    if ledger.backup(recorded) is None:
        row.outcome = RestoreOutcome.NO_BACKUP
        row.detail = (
            "removed outside sm120kit, and no backup holds the bytes the wheel's RECORD lists for it; "
            f"reinstall: {reinstall_command(dist.name, dist.version)}"
        )
        return _FileRestore(row)
    original, keep, problem = _original(request, ledger, entry, ids, recorded)
    if original is None:  # another patch of the file cannot be re-applied
        row.outcome, row.detail = RestoreOutcome.NO_BACKUP, f"removed outside sm120kit; {problem}"
        return _FileRestore(row)
    new = transform.run_rewrites(original, keep, dist.version, entry.path)[0] if keep else original
    write = transaction.FileWrite(ledger.site, entry.package, entry.path, path, None, new)
    row.detail = "removed outside sm120kit; its backup matches the wheel's RECORD"
    if new == original:
        return _FileRestore(row, write, forget=True)
    remaining = {p.id: p.revision for p, _ in keep}
    row.detail += f"; re-applied on it: {', '.join(remaining)}"
    restored = replace(entry, vendor_sha256=recorded, patched_sha256=sha256(new), patches=remaining)
    return _FileRestore(row, write, entry=restored)


def _original(
    request: _Request, ledger: Ledger, entry: FileEntry, ids: list[str], vendor_sha256: str
) -> tuple[bytes | None, list[tuple[Patch, Rewrite]], str]:
    """(the vendor's bytes: the backup named `vendor_sha256`, the rewrites of the file's
    other patches to re-apply on them, "") or (None, [], why they cannot be had)."""
    original = ledger.backup(vendor_sha256)
    if original is None:
        reinstall = reinstall_command(entry.package, entry.version)
        return None, [], f"the backup {vendor_sha256[:12]} is missing or damaged; reinstall: {reinstall}"
    others = [i for i in entry.patches if i not in ids]
    if unknown := [i for i in others if i not in request.by_id]:
        return None, [], f"it also carries {', '.join(unknown)}, which is not loaded: pass its --patch-dir"
    keep = [
        (request.by_id[i], r)
        for i in others
        for r in request.by_id[i].rewrites_to_run(entry.version)
        if r.path == entry.path
    ]
    if lost := sorted(set(others) - {p.id for p, _ in keep}):
        return (
            None,
            [],
            f"it also carries {', '.join(lost)}, which has no rewrite of it "
            f"for {entry.package} {entry.version}: unpatch them together",
        )
    return original, keep, ""


def _proof(digest: str, recorded: str | None, vendor_sha256: str) -> str:
    """What the restored bytes were proven against."""
    if digest == recorded:
        return "matches the wheel's RECORD"
    if digest == (recorded or vendor_sha256):
        return "matches the bytes recorded before patching"
    return "restored the pre-patch bytes (they differ from RECORD)"


def _entry_file(ledger: Ledger, entry: FileEntry, patches: list[Patch], dist: Distribution | None) -> Path | None:
    """Where a ledger entry's file is, only if a patch it names rewrites that file of that
    package and the path stays inside the target (no symbolic link out): else the ledger
    is damaged or hostile, and nothing is written."""
    declared = {(p.package, r.path) for p in patches for r in p.rewrites}
    if (entry.package, entry.path) not in declared:
        raise ledger.damaged(
            f"{entry.package}:{entry.path} is no file that {', '.join(p.id for p in patches)} rewrites"
        )
    if dist is None:
        return None
    path = dist.file(entry.path)
    if not writing.inside(dist, path):
        raise ledger.damaged(f"{entry.path} resolves to {path.resolve()}, outside {dist.name}'s install root")
    return path


def _unrecorded(request: _Request, ledgers: dict[Path, Ledger]) -> list[tuple[Ledger, str, _FileRestore]]:
    """Patched code with no ledger entry (the ledger was lost). Where the backups still hold
    the bytes the wheel's RECORD lists for the file, the entry is rebuilt from them
    (verdicts.entry_from_backup) and the file restored as any other; else nothing can
    restore it. (the ledger, the entry's key, what unpatch does) per such file."""
    result = planning.plan(request.target, request.patches, need_bytes=False)  # every patch: the file's others too
    in_place: dict[tuple[str, str], list[Patch]] = {}
    for f in result.findings:
        if f.outcome in (Outcome.ALREADY_APPLIED, Outcome.OUTDATED) and f.path is not None:
            in_place.setdefault((f.patch.package, f.path), []).append(f.patch)
    relearned = {r.key: r.entry for r in result.relearned}  # provably sm120kit's write
    planned = []
    for (package, relpath), found in in_place.items():
        dist = request.target.find(package)
        assert dist is not None, "applied code is in an installed package"
        ledger, key = ledgers.get(dist.site), dist.key(relpath)
        if ledger is None or key in ledger.files or not {p.id for p in found} & request.wanted:
            continue  # (no ledger loaded: the site of no wanted patch)
        entry = relearned.get(key) or _entry_from_backup(ledger, dist, relpath, found)
        if entry is None:
            planned.append((ledger, key, _no_entry(request, dist, relpath, found)))
        else:
            planned.append((ledger, key, _plan_restore(request, ledger, entry, lost=True)))
    return planned


def _entry_from_backup(ledger: Ledger, dist: Distribution, relpath: str, found: list[Patch]) -> FileEntry | None:
    """The entry of a file edited since it was patched (or outdated), rebuilt as planning
    does for one that holds sm120kit's write: its patched digest is not the file's."""
    current = read_entry(ledger, dist.file(relpath))
    assert current is not None, "patched code was read from it"
    items = [(p, r) for p in found for r in p.rewrites_to_run(dist.version) if r.path == relpath]
    return entry_from_backup(TargetFile(dist, ledger, relpath, current, None), items)


def _no_entry(request: _Request, dist: Distribution, relpath: str, found: list[Patch]) -> _FileRestore:
    ids = sorted({p.id for p in found} & request.wanted)
    reinstall = reinstall_command(dist.name, dist.version)
    detail = f"patched code without a ledger entry, so `unpatch` cannot restore it; reinstall: {reinstall}"
    return _FileRestore(Restore(dist.name, dist.version, relpath, ids, RestoreOutcome.NO_BACKUP, detail))
