"""Tuned tables taken out by `unpatch`: a file that was new is removed, a file of sglang's
that a table replaced is put back from the backup. Registered with sm120kit.patching.revert
on import (its TRACKED changes), so that patching, which runs unpatch, imports no command."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sm120kit.patching import revert, transaction
from sm120kit.patching.ledger import Ledger, TunedEntry, sha256
from sm120kit.target import Distribution, Target, reinstall_command
from sm120kit.tune.installed import (
    CHANGE,
    PACKAGE,
    TableState,
    config_dirs,
    entry_path,
    file_state,
    read_table_file,
)
from sm120kit.tune.lookup import CONFIG_DIR_ENV


def removal_sites(target: Target) -> set[Path]:
    """The sites whose ledgers unpatch must take tables out of (locked with the others)."""
    sglang = target.find(PACKAGE)
    if sglang is None:
        return set()
    sites = {sglang.site}
    for directory in config_dirs(target):
        if Ledger(directory).state_dir.is_dir():
            sites.add(directory)
    return sites


@dataclass
class Removal:
    """What unpatch does to one table's file: a row of its table (package, version, path,
    outcome, detail; `error` when it cannot), the write, and whether the entry goes."""

    path: str
    outcome: str  # one of revert.RestoreOutcome's values
    detail: str
    write: transaction.FileWrite | None = None
    forget: bool = False


def plan_removal(target: Target, ledgers: Mapping[Path, Ledger], force: bool) -> tuple[list[Removal], list[str]]:
    """The tables of every ledger taken out: a file that was new is removed, a file of
    sglang's that a table replaced is put back from the backup (proven against RECORD),
    one changed since is a foreign edit (unless `force`). Updates the ledgers (entries and
    the pointers to config dirs left empty) as they will be written. (the removals, what
    the user must do: a server environment that still names an emptied config dir)"""
    sglang = target.find(PACKAGE)
    removals: list[Removal] = []
    warnings: list[str] = []
    for ledger in ledgers.values():
        had = bool(ledger.tuned)
        for key, entry in sorted(ledger.tuned.items()):
            removal = _remove(sglang, ledger, entry, force)
            removals.append(removal)
            if removal.forget:
                del ledger.tuned[key]
        if had and not ledger.tuned and (sglang is None or ledger.site != sglang.site):
            warnings.append(
                f"{ledger.site} holds no MoE config tables now: take {CONFIG_DIR_ENV}={ledger.site} out of the "
                "profile's env, or sglang finds none (its configs/ directory stays: 0.5.12+ fails without it)"
            )
    for ledger in ledgers.values():
        ledger.moe_config_dirs = [
            d for d in ledger.moe_config_dirs if (held := ledgers.get(Path(d))) is None or held.tuned
        ]
    return removals, warnings


def _remove(sglang: Distribution | None, ledger: Ledger, entry: TunedEntry, force: bool) -> Removal:
    path = entry_path(sglang, ledger, entry)
    shown = str(path) if entry.root == "config-dir" else entry.path
    current = read_table_file(path)
    state = file_state(sglang, entry, current)
    if state is TableState.ABSENT:
        return Removal(shown, "pristine", "the file is gone: nothing to remove", forget=True)
    if state is TableState.VENDOR:
        return Removal(shown, "pristine", "already sglang's own bytes (reinstalled or upgraded)", forget=True)
    if state is TableState.FOREIGN and not force:
        return Removal(
            shown, "foreign-edit", f"{path.name} changed since sm120kit wrote it; pass --force to take it out anyway"
        )
    if not entry.vendor_sha256:
        what = "the copy of sglang's own table" if entry.kind == "shipped" else "the tuned table"
        write = transaction.FileWrite(ledger.site, PACKAGE, entry.path, path, current, None)
        return Removal(shown, "would-restore", f"{what} removed (no file was there before)", write, forget=True)
    original = ledger.backup(entry.vendor_sha256)
    if original is None:
        reinstall = reinstall_command(PACKAGE, entry.version)
        return Removal(
            shown, "no-backup", f"the backup {entry.vendor_sha256[:12]} of the file it replaced is gone; {reinstall}"
        )
    recorded = sglang.recorded_sha256(entry.path) if sglang and entry.root == "package" else None
    proof = "matches the wheel's RECORD" if sha256(original) == recorded else "the bytes it replaced"
    write = transaction.FileWrite(ledger.site, PACKAGE, entry.path, path, current, original)
    return Removal(shown, "would-restore", f"the tuned table out, sglang's own file back ({proof})", write, True)


def unpatch_rows(
    target: Target, ledgers: Mapping[Path, Ledger], force: bool
) -> tuple[list[revert.Restore], list[transaction.FileWrite], list[str]]:
    """plan_removal as unpatch shows and writes it: (its rows, the writes, the warnings)."""
    sglang = target.find(PACKAGE)
    version = sglang.version if sglang else "-"
    removals, warnings = plan_removal(target, ledgers, force)
    rows = [
        revert.Restore(PACKAGE, version, r.path, [CHANGE], revert.RestoreOutcome(r.outcome), r.detail) for r in removals
    ]
    return rows, [r.write for r in removals if r.write], warnings


revert.register(revert.TrackedChange(CHANGE, removal_sites, unpatch_rows))
