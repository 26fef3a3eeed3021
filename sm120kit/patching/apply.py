"""`patch`: write a plan as one transaction and record it in the ledger; `--verify`: prove
from disk that everything is in place.

A run that writes plans under the lock, and writes only if nothing is an error: every new
file was computed and self-checked first (transform.py); if a write fails, the files
already written are put back (transaction.py).
"""

from __future__ import annotations

from sm120kit.patching import planning, transaction, writing
from sm120kit.patching.ledger import FileEntry, ReadOnly, sha256
from sm120kit.patching.planning import FileChange, Plan
from sm120kit.patching.spec import Outcome, Patch
from sm120kit.patching.verdicts import WILL_REBUILD
from sm120kit.target import Target, reinstall_command


def apply(
    target: Target,
    patches: list[Patch],
    force: bool = False,
    keep_jit_cache: bool = False,
    allow_missing: frozenset[str] = frozenset(),
) -> Plan:
    """Plan under the lock; if nothing is an error, write every change as one transaction,
    prove it from disk, and record it in the ledger (with any --allow-missing accepted);
    then drop the JIT caches built from the old sources. Returns the plan, with the written
    findings (would-apply, and outdated revisions rebuilt) turned into applied. A read-only
    environment is fine as long as there is nothing to write."""
    sites = planning.ledger_sites(target, patches)
    try:
        with writing.locked(target, sites, patches) as recovered:
            result = planning.plan(target, patches, force, allow_missing=allow_missing, tolerate_damage=False)
            result.warnings[:0] = recovered
            if not (result.errors or result.blockers):  # exit 2 means nothing was written
                _write_plan(result, keep_jit_cache)
    except ReadOnly:
        result = planning.plan(target, patches, force, allow_missing=allow_missing, tolerate_damage=False)
        if not (result.errors or result.blockers) and (
            result.changes or result.drop or result.allowances or result.relearned
        ):
            raise
    return result


def _write_plan(result: Plan, keep_jit_cache: bool) -> None:
    for ledger, key in result.drop:
        ledger.files.pop(key, None)
    for change in result.changes:
        _record(result, change)
    for (site, patch_id), allowance in result.allowances.items():
        result.ledgers[site].allow_missing(patch_id, allowance)
    for relearned in result.relearned:
        result.ledgers[relearned.site].record(relearned.key, relearned.entry)
    if result.changes or result.drop or result.allowances or result.relearned:
        writes = [
            transaction.FileWrite(c.dist.site, c.dist.name, c.relpath, c.abspath, c.before, c.after)
            for c in result.changes
        ]
        writing.write(result.ledgers, writes, "patch")
        for stale in result.stale:
            stale.forgotten = True
        for relearned in result.relearned:
            relearned.recorded = True
    warnings, removed = writing.drop_jit_caches({c.dist for c in result.changes}, keep_jit_cache)
    result.warnings += warnings
    result.jit_cache_removed += removed
    written = {(c.dist.name, c.relpath) for c in result.changes}
    for f in result.findings:
        if f.outcome is Outcome.WOULD_APPLY:
            f.outcome = Outcome.APPLIED
        elif f.outcome is Outcome.OUTDATED and (f.patch.package, f.path) in written:
            f.outcome = Outcome.APPLIED
            f.detail = f.detail.removesuffix(WILL_REBUILD) + ": rebuilt from the vendor's bytes"


def _record(result: Plan, change: FileChange) -> None:
    """The ledger entry of a changed file: the patches in place and both digests."""
    ledger = result.ledgers[change.dist.site]
    in_place = {
        f.patch.id: f.patch.revision
        for f in result.findings
        if f.path == change.relpath
        and f.patch.package == change.dist.name
        and f.outcome in (Outcome.WOULD_APPLY, Outcome.ALREADY_APPLIED, Outcome.OUTDATED)
    }
    if not in_place:  # the current revisions leave the vendor's bytes: nothing to record
        ledger.files.pop(change.dist.key(change.relpath), None)
        return
    ledger.record(
        change.dist.key(change.relpath),
        FileEntry(
            package=change.dist.name,
            version=change.dist.version,
            path=change.relpath,
            vendor_sha256=change.vendor_sha256,
            patched_sha256=sha256(change.after),
            patches=in_place,
        ),
    )


def verify(target: Target, patches: list[Patch]) -> list[str]:
    """Re-read everything from disk: every patch must be in place, fixed upstream or not
    applicable, and every ledger entry must match the bytes on disk. Returns problems."""
    result = planning.plan(target, patches, cache=False)
    problems = [
        f"{f.patch.id}: {f.outcome.value} {f.detail}".rstrip()
        for f in result.findings
        if f.is_error or f.outcome in (Outcome.WOULD_APPLY, Outcome.OUTDATED)
    ]
    problems += result.blockers  # patched code without a ledger entry included (planning's unrestorable)
    problems += [f"{r.key}: no ledger entry (it was lost): `sm120kit patch` records it again" for r in result.relearned]
    for ledger in result.ledgers.values():
        for key, entry in ledger.files.items():
            dist = target.find(entry.package)
            path = dist.file(entry.path) if dist else None
            if dist is None or path is None:
                problems.append(
                    f"{key}: {entry.package} is not installed any more: "
                    "a stale ledger entry (`sm120kit patch` forgets it)"
                )
            elif not path.exists():
                problems.append(f"{key}: the file sm120kit patched is gone (removed outside sm120kit)")
            elif sha256(path.read_bytes()) != entry.patched_sha256:
                problems.append(f"{key}: the bytes on disk are not the ones sm120kit recorded")
            elif ledger.backup(entry.vendor_sha256) is None:
                problems.append(
                    f"{key}: the backup of its vendor bytes is missing or damaged, so `unpatch` could not restore it; "
                    f"reinstall: {reinstall_command(dist.name, dist.version)}"
                )
    return list(dict.fromkeys(problems))  # planning reports an unrestorable file too
