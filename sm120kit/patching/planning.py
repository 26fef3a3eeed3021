"""Planning: what each patch is on a target, and the new bytes of each file to change.

Reads the target files once per file, the wheels' RECORD and the ledgers; writes nothing
but the outcome cache. A plan is what `status` and `patch --check` show and what `patch`
writes (see apply.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.patching import jit_cache, transaction
from sm120kit.patching.ledger import DamagedLedger, FileEntry, Ledger, sha256
from sm120kit.patching.spec import MARKER, Outcome, Patch, Rewrite, marker_revisions
from sm120kit.patching.transform import Finding
from sm120kit.patching.verdicts import (
    FileState,
    Items,
    TargetFile,
    cached_verdicts,
    entry_from_backup,
    judge_foreign,
    other_revisions,
    qualify,
    rebuild,
)
from sm120kit.target import Distribution, Target, reinstall_command


@dataclass
class Lost:
    """A patch recorded in the ledger whose file now holds vendor bytes again."""

    package: str
    old_version: str
    new_version: str
    patch_id: str
    path: str


@dataclass
class Stale:
    """Ledger entries of a package that is not installed any more (`pip uninstall` leaves
    sm120kit's state behind): nothing to restore; `patch` and `unpatch` forget them."""

    package: str
    version: str  # the release its files were patched at
    ledger: Path  # the ledger.json that holds them
    paths: list[str]
    forgotten: bool = False  # `patch` dropped them


@dataclass
class Relearned:
    """A patched file whose ledger entry was lost, its entry rebuilt from the backups
    (verdicts.entry_from_backup): `patch` records it again."""

    site: Path
    key: str
    entry: FileEntry
    recorded: bool = False  # `patch` wrote it


@dataclass
class FileChange:
    dist: Distribution
    relpath: str
    before: bytes
    after: bytes
    vendor_sha256: str  # what `unpatch` must give back
    needs_backup: bool  # `before` is the original, not yet in the backups

    @property
    def abspath(self) -> Path:
        return self.dist.file(self.relpath)

    def diff(self) -> str:
        import difflib

        label = self.relpath
        return "".join(
            difflib.unified_diff(
                self.before.decode("utf-8", "replace").splitlines(keepends=True),
                self.after.decode("utf-8", "replace").splitlines(keepends=True),
                f"a/{label}",
                f"b/{label}",
            )
        )


@dataclass
class Plan:
    target: Target
    findings: list[Finding] = field(default_factory=list)
    changes: list[FileChange] = field(default_factory=list)
    lost: list[Lost] = field(default_factory=list)
    ledgers: dict[Path, Ledger] = field(default_factory=dict)
    drop: list[tuple[Ledger, str]] = field(default_factory=list)  # entries now describing vendor bytes
    warnings: list[str] = field(default_factory=list)
    jit_cache_removed: list[Path] = field(default_factory=list)
    # (site, patch id): an --allow-missing to record
    allowances: dict[tuple[Path, str], dict] = field(default_factory=dict)
    interrupted: list[Path] = field(default_factory=list)  # journals of a killed run, not recovered yet
    damaged: list[str] = field(default_factory=list)  # ledgers that failed validation (read without them)
    damaged_sites: set[Path] = field(default_factory=set)
    # Patched files that `unpatch` could not give back (no ledger entry, no backup): what
    # `patch --verify` would fail on, so `status` fails on it too.
    unrestorable: list[str] = field(default_factory=list)
    stale: list[Stale] = field(default_factory=list)  # entries of packages not installed (in `drop` too)
    relearned: list[Relearned] = field(default_factory=list)
    installed: int = 0  # packages of the patches that are installed (0: only stale entries are here)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.is_error]

    @property
    def pending(self) -> list[Finding]:
        """What `patch` would change: new patches and older revisions to bring up."""
        return [f for f in self.findings if f.outcome in (Outcome.WOULD_APPLY, Outcome.OUTDATED) and not f.stuck]

    @property
    def unproven(self) -> list[Finding]:
        return [
            f for f in self.findings if f.unproven and f.outcome not in (Outcome.FIXED_UPSTREAM, Outcome.NOT_APPLICABLE)
        ]

    @property
    def blockers(self) -> list[str]:
        """Errors of the whole plan, not of one finding: a damaged ledger, an unfinished run."""
        unfinished = [
            f"an interrupted sm120kit run left {j}: run `sm120kit patch` or `sm120kit unpatch` to finish it"
            for j in self.interrupted
        ]
        return [*self.damaged, *unfinished, *self.unrestorable]

    @property
    def state_pending(self) -> bool:
        """Whether `patch` would change the ledger alone: forget stale entries, record lost ones."""
        return any(not s.forgotten for s in self.stale) or any(not r.recorded for r in self.relearned)

    def exit_code(self, check: bool) -> int:
        if self.errors or self.blockers:
            return 2
        if check and (self.pending or self.state_pending):
            return 1
        return 0


@dataclass(frozen=True)
class _Options:
    force: bool
    cache: bool
    need_bytes: bool
    allow_missing: frozenset[str]
    tolerate_damage: bool
    quick: bool


def plan(
    target: Target,
    patches: list[Patch],
    force: bool = False,
    *,
    cache: bool = True,
    need_bytes: bool = True,
    allow_missing: frozenset[str] = frozenset(),
    tolerate_damage: bool = True,
    quick: bool = True,
) -> Plan:
    """What each patch is on the target, and (with need_bytes) the new bytes of each file
    to change. `cache` lets verdicts cached for these exact bytes stand in for running the
    transforms; `verify` turns it off to prove everything from disk. `quick`: the patches'
    quick reads may stand in too (off: every verdict from the transforms, as the shipped
    seed is computed). `allow_missing`: patch ids whose anchor-missing the user accepts
    (recorded in the ledger by `apply`). A damaged ledger is reported and the markers alone
    judge the code (`tolerate_damage`), except for a run that would write on top of it."""
    options = _Options(force, cache, need_bytes, allow_missing, tolerate_damage, quick)
    result = Plan(target)
    by_package: dict[str, list[Patch]] = defaultdict(list)
    for patch in patches:
        by_package[patch.package].append(patch)
    for package, group in by_package.items():
        dist = target.find(package)
        if dist is None:
            result.findings += [  # when upstream fixed it is the patch's, installed or not
                Finding(p, Outcome.NOT_APPLICABLE, f"{package} is not installed", fixed_in=p.fixed_in) for p in group
            ]
            _stale_entries(result, package, options)
            continue
        result.installed += 1
        _plan_package(result, dist, group, options)
    if patches and not result.installed and not result.stale:
        names = sorted(by_package)
        missing = f"{names[0]} is not installed" if len(names) == 1 else f"none of {', '.join(names)} is installed"
        what = "nothing sm120kit patches is here" if len(names) > 1 else "nothing the chosen patches change is here"
        raise UserError(  # almost always the wrong environment (no --python): an error, not "nothing to do"
            f"{missing} in {target.description}: {what}",
            "point at the serving environment: --python EXE or --site DIR; "
            "or try the whole cycle without a GPU: sm120kit try",
        )
    return result


def ledger_sites(target: Target, patches: list[Patch]) -> set[Path]:
    """The sites whose ledgers a run over `patches` reads and writes: where their packages
    are installed, and for a package that is not, every site of the target that holds a
    ledger (its entries there are stale)."""
    sites: set[Path] = set()
    for package in {p.package for p in patches}:
        dist = target.find(package)
        sites |= {dist.site} if dist else {s for s in target.site_dirs if Ledger(s).path.exists()}
    return sites


def _stale_entries(result: Plan, package: str, options: _Options) -> None:
    """The ledger entries of `package`, which is not installed: stale, for `patch` to drop."""
    for site in result.target.site_dirs:
        if not Ledger(site).path.exists():
            continue
        ledger = _ledger(result, site, options.tolerate_damage)
        entries = {key: e for key, e in ledger.files.items() if e.package == package}
        if not entries:
            continue
        versions = sorted({e.version for e in entries.values()})
        paths = sorted(e.path for e in entries.values())
        result.stale.append(Stale(package, ", ".join(versions), ledger.path, paths))
        result.drop += [(ledger, key) for key in entries]


def _plan_package(result: Plan, dist: Distribution, group: list[Patch], options: _Options) -> None:
    """Add one installed package's findings, changes, losses and warnings to the plan."""
    ledger = _ledger(result, dist.site, options.tolerate_damage)
    per_file: dict[str, Items] = defaultdict(list)
    for patch in group:
        to_run = patch.rewrites_to_run(dist.version)
        for rewrite in to_run:
            per_file[rewrite.path].append((patch, rewrite))
        result.findings += _not_run(patch, dist, to_run)
    allowed = {**ledger.allowed_for(dist.name, dist.version), **dict.fromkeys(options.allow_missing, "--allow-missing")}
    for relpath, items in per_file.items():
        _add_file(result, ledger, _plan_file(dist, ledger, relpath, items, options, allowed))
    for f in result.findings:
        if f.outcome is Outcome.ANCHOR_MISSING and f.patch.package == dist.name and f.patch.id in options.allow_missing:
            result.allowances[(dist.site, f.patch.id)] = {
                "package": dist.name,
                "version": dist.version,
                "reason": f.detail.rsplit(" (allowed:", 1)[0],
            }
    for key, lost in _untargeted_entries(dist, ledger, set(per_file)):
        result.lost += lost
        result.drop.append((ledger, key))
    result.warnings += _package_warnings(result.target, dist, ledger)


def _ledger(result: Plan, site: Path, tolerate_damage: bool) -> Ledger:
    """The site's ledger, loaded once per plan (sglang and flashinfer usually share one)."""
    if site in result.ledgers:
        return result.ledgers[site]
    try:
        ledger = Ledger.load(site)
    except DamagedLedger as exc:
        if not tolerate_damage:
            raise
        result.damaged.append(str(exc))
        result.damaged_sites.add(site)
        ledger = Ledger(site)
    result.ledgers[site] = ledger
    result.interrupted += transaction.pending([site])
    return ledger


def _not_run(patch: Patch, dist: Distribution, to_run: list[Rewrite]) -> list[Finding]:
    """The finding of a patch that runs no transform on this release (past the proven
    window every part runs, by the shape of the code): outside every range, the patch is
    fixed or not applicable."""
    if to_run:
        return []
    if patch.is_fixed_in(dist.version):
        outcome = Outcome.FIXED_UPSTREAM
        detail = f"fixed upstream in {patch.fixed_in} (by version; beyond the releases it was proven on)"
    else:
        windows = "; ".join(sorted({r.versions for r in patch.rewrites}))
        outcome, detail = Outcome.NOT_APPLICABLE, f"{dist.name} {dist.version} is outside {windows}"
    return [Finding(patch, outcome, detail, dist.version, fixed_in=patch.fixed_in)]


@dataclass
class _FilePlan:
    """What planning one file adds to the plan."""

    findings: list[Finding]
    lost: list[Lost] = field(default_factory=list)
    drop: str | None = None  # the key of its ledger entry, when that now describes vendor bytes
    change: FileChange | None = None
    unrestorable: list[str] = field(default_factory=list)
    relearned: Relearned | None = None


def _add_file(result: Plan, ledger: Ledger, file_plan: _FilePlan) -> None:
    result.findings += file_plan.findings
    result.lost += file_plan.lost
    if file_plan.relearned is not None:
        result.relearned.append(file_plan.relearned)
    if file_plan.drop is not None:
        result.drop.append((ledger, file_plan.drop))
    if file_plan.change is not None:
        result.changes.append(file_plan.change)
    if ledger.site not in result.damaged_sites:  # a damaged ledger is the one problem to report there
        result.unrestorable += file_plan.unrestorable


def _plan_file(
    dist: Distribution, ledger: Ledger, relpath: str, items: Items, options: _Options, allowed: dict[str, str]
) -> _FilePlan:
    path = dist.file(relpath)
    try:
        before = path.read_bytes()
    except FileNotFoundError:
        return _FilePlan(qualify(_absent(dist, ledger, relpath, path, items), dist, allowed))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read the environment") from None

    file = TargetFile(dist, ledger, relpath, before, ledger.files.get(dist.key(relpath)))
    relearned = _relearn(file, items)
    if relearned is not None:  # from here on, the file is what sm120kit wrote, as its ledger would say
        file = TargetFile(dist, ledger, relpath, before, relearned.entry)
    older = other_revisions(before, items)
    if older:
        after, findings = rebuild(file, items, older, options.need_bytes)
    else:
        after, findings = cached_verdicts(file, items, options.cache, options.need_bytes, options.quick)
    if file.state is FileState.FOREIGN and not older:  # before qualify: no anchor-missing for a local edit
        judge_foreign(findings, file, options.force)
    result = _FilePlan(qualify(findings, dist, allowed), unrestorable=_unrestorable(file, findings, items))
    result.relearned = relearned
    entry = file.entry
    if entry and file.state is FileState.PRISTINE:  # an upgrade or reinstall put the vendor's bytes back
        result.lost = [Lost(dist.name, entry.version, dist.version, pid, entry.path) for pid in entry.patches]
        result.drop = dist.key(relpath)
    if after is None or after == before or any(f.is_error for f in findings):
        return result
    result.relearned = None  # the change records the file's entry
    ours = file.state is FileState.OURS
    result.change = FileChange(
        dist,
        relpath,
        before,
        after,
        vendor_sha256=entry.vendor_sha256 if entry and ours else file.digest,
        needs_backup=not ours,
    )
    return result


def _relearn(file: TargetFile, items: Items) -> Relearned | None:
    """The rebuilt entry of a file that holds sm120kit's write but has no ledger entry (the
    ledger was lost), when the backups prove it (verdicts.entry_from_backup)."""
    if file.entry is not None or file.state is not FileState.FOREIGN:
        return None
    text = file.before.decode("utf-8", "replace")
    in_place = [(p, r) for p, r in items if p.revision in marker_revisions(text, p.id)]
    entry = entry_from_backup(file, in_place) if in_place else None
    if entry is None or entry.patched_sha256 != file.digest:
        return None
    return Relearned(file.dist.site, file.dist.key(file.relpath), entry)


def _absent(dist: Distribution, ledger: Ledger, relpath: str, path: Path, items: Items) -> list[Finding]:
    """The findings on a target file that is not there: removed by hand when the wheel's
    RECORD lists it (a local edit), else not in this release (the anchor moved)."""
    recorded = dist.recorded_sha256(relpath)
    if recorded is None:
        reason = f"{relpath} is absent from {dist.name} {dist.version} ({path})"
        return [Finding(p, Outcome.ANCHOR_MISSING, reason, dist.version, relpath, p.fixed_in_for(r)) for p, r in items]
    reason = f"{relpath} is in the wheel's RECORD but absent ({path}): it was removed outside sm120kit"
    reinstall = (
        f"reinstall {dist.name} {dist.version} to get the vendor's bytes back "
        f"({reinstall_command(dist.name, dist.version)}), then run `sm120kit patch`"
    )
    if ledger.backup(recorded) is not None:  # what `unpatch` restores it from
        reinstall = (
            "`sm120kit unpatch` restores it from sm120kit's backup, which matches the wheel's RECORD, "
            f"then run `sm120kit patch`; or {reinstall}"
        )
    findings = [Finding(p, Outcome.FOREIGN_EDIT, reason, dist.version, relpath, p.fixed_in_for(r)) for p, r in items]
    for f in findings:
        f.hint = reinstall
    return findings


def _unrestorable(file: TargetFile, findings: list[Finding], items: Items) -> list[str]:
    """Why `unpatch` could not give back this file's vendor bytes (`patch --verify` fails on
    the same): patched code that no ledger entry records (and that the backups do not prove
    sm120kit's: _relearn), or an entry whose backup is gone."""
    dist, entry = file.dist, file.entry
    reinstall = reinstall_command(dist.name, dist.version)
    if entry is None:
        if not any(f.outcome is Outcome.ALREADY_APPLIED for f in findings):
            return []
        recorded = dist.recorded_sha256(file.relpath)
        text = file.before.decode("utf-8", "replace")
        others = sorted({m["id"] for m in MARKER.finditer(text)} - {p.id for p, _ in items})
        if recorded and file.ledger.backup(recorded) is not None and others:
            return [  # what it holds cannot be told from the backup without them
                f"{file.relpath}: patched code without a ledger entry; it also carries {', '.join(others)}, "
                "which this run does not load: run without --only, or pass the --patch-dir that has it"
            ]
        if recorded and file.ledger.backup(recorded) is not None:
            return [
                f"{file.relpath}: patched code without a ledger entry, and not the bytes the patches in place "
                "write on the vendor's (edited since, or an older revision), so nothing proves them sm120kit's "
                "alone; the backup of the vendor's bytes matches the wheel's RECORD: `sm120kit unpatch --force` "
                "restores them (an edit is lost), then run `sm120kit patch`"
            ]
        return [
            f"{file.relpath}: patched code without a ledger entry, so `unpatch` cannot restore it; "
            f"reinstall: {reinstall}"
        ]
    stuck = any(f.stuck for f in findings)  # an outdated revision that says so already
    if file.state is FileState.OURS and not stuck and file.ledger.backup(entry.vendor_sha256) is None:
        return [
            f"{dist.key(file.relpath)}: the backup of its vendor bytes is missing or damaged, "
            f"so `unpatch` could not restore it; reinstall: {reinstall}"
        ]
    return []


def _untargeted_entries(dist: Distribution, ledger: Ledger, targeted: set[str]) -> list[tuple[str, list[Lost]]]:
    """Ledger entries for files that no rewrite covers any more (the upgrade moved or
    fixed the code): when the file is back to vendor bytes, the patch was lost. (the
    entry's key, its patches lost) for each entry to drop."""
    dropped = []
    for key, entry in ledger.files.items():
        if entry.package != dist.name or entry.path in targeted:
            continue
        data = read_entry(ledger, dist.file(entry.path))
        current = sha256(data) if data is not None else None
        if current == entry.patched_sha256:
            continue
        dropped.append((key, [Lost(dist.name, entry.version, dist.version, pid, entry.path) for pid in entry.patches]))
    return dropped


def read_entry(ledger: Ledger, path: Path | None) -> bytes | None:
    """A ledger entry's file now, or None when it is absent."""
    if path is None:
        return None
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ledger.damaged(f"{path} is a directory") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read the environment") from None


def _package_warnings(target: Target, dist: Distribution, ledger: Ledger) -> list[str]:
    """What may undo or hide the patches without being an error of any one of them."""
    warnings = []
    if dist.record_damaged:
        warnings.append(
            f"{dist.dist_info / 'RECORD'} is not valid UTF-8 (a damaged installation): the rows of the files "
            "sm120kit patches were read, the rest ignored; repair it: "
            f"{reinstall_command(dist.name, dist.version)}"
        )
    warnings += _stale_jit_caches(dist, ledger)
    prebuilt = jit_cache.prebuilt_package(dist)
    if prebuilt and (aot := target.find(prebuilt)):
        warnings.append(
            f"{aot.name} {aot.version} is installed: flashinfer loads its prebuilt kernels instead of "
            f"building from the sources that sm120kit patches (pip uninstall {aot.name} to use the fixes)"
        )
    return warnings


def _stale_jit_caches(dist: Distribution, ledger: Ledger) -> list[str]:
    import datetime as dt

    times = [e.patched_at for e in ledger.files.values() if e.package == dist.name and e.patched_at]
    if not times or not jit_cache.cache_dirs(dist):
        return []
    patched = max(dt.datetime.fromisoformat(t) for t in times)
    return [
        f"{dist.name} {dist.version}: the JIT cache {d} holds kernels built before sm120kit "
        f"patched the sources ({patched:%Y-%m-%d %H:%M} UTC); remove it (rm -rf {d}) so they are rebuilt"
        for d in jit_cache.built_before(dist, patched.timestamp())
    ]
