"""What each patch is on one target file, judged from its bytes, the ledger and RECORD.

The transforms (or the outcome cache, for bytes it has seen, or the patches' quick reads,
where they can tell) give the first verdict; then it is qualified: a file that carries
another revision of a patch is outdated and rebuilt from the vendor's bytes, a file someone
else edited is a foreign edit (whatever its code looks like: fixed-upstream and
anchor-missing are said only of the vendor's bytes), and past the proven window every
verdict is unproven. Reads backups and the cache; writes only the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

from sm120kit.patching import cache as outcome_cache
from sm120kit.patching import seed, transform
from sm120kit.patching.ledger import FileEntry, Ledger, sha256
from sm120kit.patching.spec import Outcome, Patch, Rewrite, marker_revisions
from sm120kit.patching.transform import Finding
from sm120kit.target import Distribution, reinstall_command

Items = list[tuple[Patch, Rewrite]]  # the rewrites of one file, in the order they run

WILL_REBUILD = ": `sm120kit patch` rebuilds it from the vendor's bytes"


class FileState(str, enum.Enum):
    """Whose bytes a target file holds."""

    PRISTINE = "pristine"  # the vendor's
    OURS = "ours"  # what sm120kit last wrote
    FOREIGN = "foreign"  # neither


@dataclass(frozen=True)
class TargetFile:
    """One target file as planning found it."""

    dist: Distribution
    ledger: Ledger
    relpath: str
    before: bytes
    entry: FileEntry | None  # its ledger entry

    @cached_property
    def digest(self) -> str:
        return sha256(self.before)

    @cached_property
    def state(self) -> FileState:
        if self.entry and self.digest == self.entry.patched_sha256:
            return FileState.OURS
        recorded = self.dist.recorded_sha256(self.relpath)
        if recorded is not None:
            return FileState.PRISTINE if self.digest == recorded else FileState.FOREIGN
        # No RECORD hash (editable source tree): the bytes we first saw are the baseline.
        return (
            FileState.PRISTINE if self.entry is None or self.digest == self.entry.vendor_sha256 else FileState.FOREIGN
        )


# -- the first verdict: the transforms, or the cache ---------------------------------------


def _cache_key(patch: Patch, rewrite: Rewrite, version: str, digest: str) -> str:
    return outcome_cache.key(patch.id, str(patch.revision), patch.source_sha256, rewrite.path, version, digest)


def cached_verdicts(
    file: TargetFile, items: Items, cache: bool, need_bytes: bool, quick: bool = True
) -> tuple[bytes | None, list[Finding]]:
    """(new bytes or None when not needed, findings): from the cache (or the shipped seed)
    when it has every verdict and no new bytes are needed, else (with `quick`) from the
    quick reads when they tell every verdict and no new bytes are needed (and then cached),
    else from the transforms (and then cached). Without `cache` (`verify`), from the
    transforms alone."""
    version, relpath, digest = file.dist.version, file.relpath, file.digest
    if cache and _as_written(file, items):
        return None, [Finding(p, Outcome.ALREADY_APPLIED, "", version, relpath, p.fixed_in_for(r)) for p, r in items]
    keys = [_cache_key(p, r, version, digest) for p, r in items]
    if cache:
        hits = [h for k in keys if (h := outcome_cache.get(k) or seed.get(k))]
        if len(hits) == len(keys):
            if not (need_bytes and any(h["outcome"] == Outcome.WOULD_APPLY.value for h in hits)):
                return None, [
                    Finding(p, Outcome(h["outcome"]), h["detail"], version, relpath, p.fixed_in_for(r))
                    for (p, r), h in zip(items, hits)
                ]
        elif quick and (read := transform.quick_verdicts(file.before, items, version, relpath)) is not None:
            wanted = need_bytes and any(f.outcome is Outcome.WOULD_APPLY for f in read)  # bytes only libcst writes
            if not wanted:
                _put(keys, read)
                return None, read
    after, findings = transform.run_rewrites(file.before, items, version, relpath)
    after_digest = sha256(after)
    _put(keys, findings)
    for (p, r), f in zip(items, findings):
        if f.outcome is Outcome.WOULD_APPLY:  # the self-check proved it on the new bytes
            already = {"outcome": Outcome.ALREADY_APPLIED.value, "detail": ""}
            outcome_cache.put(_cache_key(p, r, version, after_digest), already)
    return after, findings


def _put(keys: list[str], findings: list[Finding]) -> None:
    for key, f in zip(keys, findings):
        if f.outcome is not Outcome.FAILED:  # a failure may be an environment accident; retry it
            outcome_cache.put(key, {"outcome": f.outcome.value, "detail": f.detail})


def _as_written(file: TargetFile, items: Items) -> bool:
    """Whether the file holds the bytes sm120kit wrote with exactly these patches at their
    current revisions, their markers in place: each was proven already-applied on these
    bytes before they were written (transform.py's self-check), and a rewrite that changes
    bumps its revision. So a read-only run with an empty outcome cache parses no file that
    sm120kit patched; `verify` (no cache) proves them from disk."""
    entry = file.entry
    if entry is None or file.state is not FileState.OURS or entry.patches != {p.id: p.revision for p, _ in items}:
        return False
    text = file.before.decode("utf-8", "replace")
    return all(p.revision in marker_revisions(text, p.id) for p, _ in items)


# -- a lost ledger entry -------------------------------------------------------------------


def entry_from_backup(file: TargetFile, in_place: Items) -> FileEntry | None:
    """The ledger entry of a patched file whose entry was lost (the ledger deleted or moved
    aside), rebuilt from the backups: when they still hold the bytes the wheel's RECORD
    lists for the file, those are the vendor's, and the patches in place run on them give
    sm120kit's write. The file holds other bytes when it was edited since (or carries an
    older revision): then nothing proves them sm120kit's alone. None without such a backup."""
    recorded = file.dist.recorded_sha256(file.relpath)
    vendor = file.ledger.backup(recorded) if recorded else None
    if recorded is None or vendor is None or not in_place:
        return None
    ours = transform.run_rewrites(vendor, in_place, file.dist.version, file.relpath)[0]
    return FileEntry(
        package=file.dist.name,
        version=file.dist.version,
        path=file.relpath,
        vendor_sha256=recorded,
        patched_sha256=sha256(ours),
        patches={p.id: p.revision for p, _ in in_place},
    )


# -- outdated revisions --------------------------------------------------------------------


def other_revisions(source: bytes, items: Items) -> dict[str, set[int]]:
    """Patch id -> the revisions other than its current one whose markers the file carries."""
    text = source.decode("utf-8", "replace")
    found = {p.id: marker_revisions(text, p.id) - {p.revision} for p, _ in items}
    return {pid: revs for pid, revs in found.items() if revs}


def rebuild(
    file: TargetFile, items: Items, older: dict[str, set[int]], need_bytes: bool
) -> tuple[bytes | None, list[Finding]]:
    """A file that carries another revision of a patch. That patch is outdated (never judged
    by its transform, which would mistake the old revision's code for upstream's); the new
    bytes are the current transforms run on the vendor's bytes (the backup), never on top
    of the old code. (new bytes or None, findings in the order of `items`)"""
    findings = _outdated(file, items, older)
    outdated = [f for f in findings if f.outcome is Outcome.OUTDATED]
    vendor, problem, hint = _vendor_bytes(file, items)
    if vendor is None:
        for f in outdated:
            f.detail, f.stuck, f.hint = f"{f.detail}, and cannot be rebuilt: {problem}", True, hint
        return None, findings
    for f in outdated:
        f.detail += WILL_REBUILD
    if not need_bytes:
        return None, findings
    after, rebuilt = transform.run_rewrites(vendor, items, file.dist.version, file.relpath)
    for i, f in enumerate(rebuilt):  # the current revision must apply to the vendor's bytes
        if f.outcome.is_error or (findings[i].outcome is Outcome.OUTDATED and f.outcome is not Outcome.WOULD_APPLY):
            findings[i] = f
    return after, findings


def _outdated(file: TargetFile, items: Items, older: dict[str, set[int]]) -> list[Finding]:
    """The transforms' verdicts for the patches at their current revision, and outdated
    for the others, in the order of `items`."""
    version, relpath = file.dist.version, file.relpath
    current = [item for item in items if item[0].id not in older]
    _, judged = transform.run_rewrites(file.before, current, version, relpath) if current else (None, [])
    verdicts = dict(zip(map(id, current), judged))
    findings = []
    for item in items:
        patch, rewrite = item
        if patch.id not in older:
            findings.append(verdicts[id(item)])
            continue
        revs = ", ".join(f"r{r}" for r in sorted(older[patch.id]))
        detail = f"carries {revs} of this patch; this sm120kit has r{patch.revision}"
        findings.append(Finding(patch, Outcome.OUTDATED, detail, version, relpath, patch.fixed_in_for(rewrite)))
    return findings


def _vendor_bytes(file: TargetFile, items: Items) -> tuple[bytes | None, str, str]:
    """(the vendor's bytes to rebuild from, "", "") or (None, why they cannot be had, what to do)."""
    dist, entry = file.dist, file.entry
    reinstall = f"{reinstall_command(dist.name, dist.version)}, then sm120kit patch"
    ours = file.state is FileState.OURS
    vendor = file.ledger.backup(entry.vendor_sha256) if entry and ours else None
    if entry is None:
        recorded = dist.recorded_sha256(file.relpath)
        if recorded and file.ledger.backup(recorded) is not None:  # sm120kit's alone, or edited since?
            return (
                None,
                "no ledger entry for this file (the state was lost), so nothing proves its bytes are sm120kit's alone",
                "`sm120kit unpatch --force` restores the vendor's bytes from the backup, which matches the wheel's "
                "RECORD (an edit since is lost), then run `sm120kit patch`",
            )
        return None, "no ledger entry for this file (the state was lost), so the vendor's bytes are gone", reinstall
    if not ours:
        return None, f"{file.relpath} changed since sm120kit wrote it", reinstall
    if unknown := sorted(set(entry.patches) - {p.id for p, _ in items}):
        return (
            None,
            f"it also carries {', '.join(unknown)}, which this run does not load",
            "run without --only, or pass the --patch-dir that has it",
        )
    if vendor is None:
        return None, f"the backup {entry.vendor_sha256[:12]} of the vendor's bytes is missing or damaged", reinstall
    return vendor, "", ""


# -- qualifying the verdicts ---------------------------------------------------------------


def qualify(findings: list[Finding], dist: Distribution, allowed: dict[str, str]) -> list[Finding]:
    """Past the proven window every outcome of a transform is unproven (fixed upstream
    there is what the code says, whatever the release number), and an anchor that moved may
    mean the bug was fixed or that the code changed around it: say so and what to do. An
    anchor-missing the user accepted (patch id -> how) is allowed, not an error. Qualifies
    the findings in place and returns them."""
    for f in findings:
        past = f.patch.is_past_window(dist.version)
        if past:
            f.unproven = f"unproven on {dist.name} {dist.version} (proven {f.patch.window})"
        if past and f.outcome is Outcome.FIXED_UPSTREAM:  # by the code, never by the release number
            f.detail += f" (read from the code of {dist.name} {dist.version}; proven {f.patch.window})"
        if f.outcome is not Outcome.ANCHOR_MISSING:
            continue
        go_on = f"to go on without this patch: --allow-missing {f.patch.id}"
        if past:
            f.detail = f"{f.unproven}: {f.detail}; the bug may or may not be fixed in this release"
            f.hint = f"{_pin(f.patch, dist)}, or check upstream's change to {f.path}{_refs(f.patch)}; {go_on}"
        else:
            reinstall = reinstall_command(dist.name, dist.version)
            f.hint = f"reinstall {dist.name} {dist.version} ({reinstall}); {go_on}"
        if f.patch.id in allowed:
            f.allowed = True
            f.detail += f" (allowed: {allowed[f.patch.id]})"
    return findings


def _pin(patch: Patch, dist: Distribution) -> str:
    if patch.last_proven:
        return f"pin the last proven release (pip install '{dist.name}=={patch.last_proven}')"
    return f"pin a release it was proven on ({patch.window})"


def _refs(patch: Patch) -> str:
    return f" ({', '.join(patch.refs)})" if patch.refs else ""


def judge_foreign(findings: list[Finding], file: TargetFile, force: bool) -> None:
    """A file whose bytes are neither the vendor's (its RECORD hash) nor what sm120kit last
    wrote: a local edit, and every verdict on it says so, naming the file and the way back.
    A would-apply there is a foreign edit (--force patches over it); so is code that looks
    fixed (only the vendor's bytes tell what upstream fixed), a missing anchor (upstream did
    not move it: the edit did), and a patch in place in a file edited since sm120kit wrote
    it (`unpatch` would refuse it). A patch in place whose ledger entry is gone keeps its
    outcome and says so; planning reports it as unrestorable. In place."""
    dist = file.dist
    reinstall = (
        f"reinstall {dist.name} {dist.version} to get the vendor's bytes back "
        f"({reinstall_command(dist.name, dist.version)}), then run `sm120kit patch`"
    )
    baseline = "the wheel's RECORD" if dist.recorded_sha256(file.relpath) else "the bytes sm120kit found there first"
    edited = f"{file.relpath} differs from {baseline}: it was edited outside sm120kit"
    rewritten = force and any(f.outcome is Outcome.WOULD_APPLY for f in findings)  # the ledger is rewritten too
    for f in findings:
        if f.outcome is Outcome.WOULD_APPLY:
            if force:
                f.detail = "over a foreign edit (--force): unpatch restores the edited bytes"
            else:
                _foreign(f, edited, f"{reinstall}; or patch over the edit: --force")
        elif f.outcome is Outcome.FIXED_UPSTREAM:
            reason = f.detail.split(": ", 1)[-1] if f.detail.startswith("fixed upstream in ") else f.detail
            _foreign(
                f,
                f"{edited}; its code looks fixed ({reason}), but these are not the vendor's bytes, "
                "and only those tell whether upstream fixed it",
                reinstall,
            )
        elif f.outcome is Outcome.ANCHOR_MISSING:
            _foreign(f, f"{edited}, and the code the patch changes is not there: {f.detail}", reinstall)
        elif f.outcome is Outcome.ALREADY_APPLIED and file.entry is None:
            recorded = dist.recorded_sha256(file.relpath)
            f.detail = "marker found, but no ledger entry: the state was lost, " + (
                "and the file is not what the patches in place write on the vendor's bytes, which sm120kit's "
                "backup still holds: `sm120kit unpatch --force` restores them"
                if recorded and file.ledger.backup(recorded) is not None
                else "so `unpatch` needs a reinstall"
            )
        elif f.outcome is Outcome.ALREADY_APPLIED and not rewritten:
            _foreign(
                f,
                f"{file.relpath} was edited outside sm120kit after it was patched (the patch is in place): "
                "it matches neither the wheel's RECORD nor sm120kit's last write",
                "`sm120kit unpatch --force` gives back the vendor's bytes (the edit is lost), "
                f"then run `sm120kit patch`; or {reinstall}",
            )


def _foreign(f: Finding, detail: str, hint: str) -> None:
    f.outcome, f.detail, f.hint = Outcome.FOREIGN_EDIT, detail, hint
