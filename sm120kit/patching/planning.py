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
from sm120kit.patching.ledger import DamagedLedger, Ledger, sha256
from sm120kit.patching.spec import Outcome, Patch, Rewrite
from sm120kit.patching.transform import Finding
from sm120kit.patching.verdicts import (
    FileState,
    Items,
    TargetFile,
    cached_verdicts,
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

    def exit_code(self, check: bool) -> int:
        if self.errors or self.blockers:
            return 2
        if check and self.pending:
            return 1
        return 0


@dataclass(frozen=True)
class _Options:
    force: bool
    cache: bool
    need_bytes: bool
    allow_missing: frozenset[str]
    tolerate_damage: bool


def plan(
    target: Target,
    patches: list[Patch],
    force: bool = False,
    *,
    cache: bool = True,
    need_bytes: bool = True,
    allow_missing: frozenset[str] = frozenset(),
    tolerate_damage: bool = True,
) -> Plan:
    """What each patch is on the target, and (with need_bytes) the new bytes of each file
    to change. `cache` lets verdicts cached for these exact bytes stand in for running the
    transforms; `verify` turns it off to prove everything from disk. `allow_missing`: patch
    ids whose anchor-missing the user accepts (recorded in the ledger by `apply`). A damaged
    ledger is reported and the markers alone judge the code (`tolerate_damage`), except
    for a run that would write on top of it."""
    options = _Options(force, cache, need_bytes, allow_missing, tolerate_damage)
    result = Plan(target)
    by_package: dict[str, list[Patch]] = defaultdict(list)
    for patch in patches:
        by_package[patch.package].append(patch)
    installed = 0
    for package, group in by_package.items():
        dist = target.find(package)
        if dist is None:
            result.findings += [  # when upstream fixed it is the patch's, installed or not
                Finding(p, Outcome.NOT_APPLICABLE, f"{package} is not installed", fixed_in=p.fixed_in) for p in group
            ]
            continue
        installed += 1
        _plan_package(result, dist, group, options)
    if patches and not installed:
        names = sorted(by_package)
        missing = f"{names[0]} is not installed" if len(names) == 1 else f"none of {', '.join(names)} is installed"
        what = "nothing sm120kit patches is here" if len(names) > 1 else "nothing the chosen patches change is here"
        raise UserError(  # almost always the wrong environment (no --python): an error, not "nothing to do"
            f"{missing} in {target.description}: {what}",
            "point at the serving environment: --python EXE or --site DIR; "
            "or try the whole cycle without a GPU: sm120kit try",
        )
    return result


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


def _add_file(result: Plan, ledger: Ledger, file_plan: _FilePlan) -> None:
    result.findings += file_plan.findings
    result.lost += file_plan.lost
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
        return _FilePlan(qualify(_absent(dist, relpath, path, items), dist, allowed))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read the environment") from None

    file = TargetFile(dist, ledger, relpath, before, ledger.files.get(dist.key(relpath)))
    older = other_revisions(before, items)
    if older:
        after, findings = rebuild(file, items, older, options.need_bytes)
    else:
        after, findings = cached_verdicts(file, items, options.cache, options.need_bytes)
    if file.state is FileState.FOREIGN and not older:  # before qualify: no anchor-missing for a local edit
        judge_foreign(findings, file, options.force)
    result = _FilePlan(qualify(findings, dist, allowed), unrestorable=_unrestorable(file, findings))
    entry = file.entry
    if entry and file.state is FileState.PRISTINE:  # an upgrade or reinstall put the vendor's bytes back
        result.lost = [Lost(dist.name, entry.version, dist.version, pid, entry.path) for pid in entry.patches]
        result.drop = dist.key(relpath)
    if after is None or after == before or any(f.is_error for f in findings):
        return result
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


def _absent(dist: Distribution, relpath: str, path: Path, items: Items) -> list[Finding]:
    """The findings on a target file that is not there: removed by hand when the wheel's
    RECORD lists it (a local edit), else not in this release (the anchor moved)."""
    if dist.recorded_sha256(relpath) is None:
        reason = f"{relpath} is absent from {dist.name} {dist.version} ({path})"
        return [Finding(p, Outcome.ANCHOR_MISSING, reason, dist.version, relpath, p.fixed_in_for(r)) for p, r in items]
    reason = f"{relpath} is in the wheel's RECORD but absent ({path}): it was removed outside sm120kit"
    reinstall = (
        f"reinstall {dist.name} {dist.version} to get the vendor's bytes back "
        f"({reinstall_command(dist.name, dist.version)}), then run `sm120kit patch`"
    )
    findings = [Finding(p, Outcome.FOREIGN_EDIT, reason, dist.version, relpath, p.fixed_in_for(r)) for p, r in items]
    for f in findings:
        f.hint = reinstall
    return findings


def _unrestorable(file: TargetFile, findings: list[Finding]) -> list[str]:
    """Why `unpatch` could not give back this file's vendor bytes (`patch --verify` fails on
    the same): patched code that no ledger entry records, or an entry whose backup is gone."""
    dist, entry = file.dist, file.entry
    reinstall = reinstall_command(dist.name, dist.version)
    if entry is None:
        if any(f.outcome is Outcome.ALREADY_APPLIED for f in findings):
            return [
                f"{file.relpath}: patched code without a ledger entry, so `unpatch` cannot restore it; "
                f"reinstall: {reinstall}"
            ]
        return []
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
