"""Plan, apply, verify and revert patches on a target environment.

The engine never knows what a patch does. It reads each target file once, runs the
transforms that cover the installed version, and decides from the results, the wheel's
RECORD and the ledger what each (patch, file) is: applied, already-applied, would-apply,
fixed-upstream, not-applicable, anchor-missing, foreign-edit or failed.

A run that writes is one transaction: every new file is computed and self-checked first
(second pass changes nothing, the marker is present, the file compiles); if anything is an
error nothing is written; if a write fails, the files already written are put back.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.patching import cache as outcome_cache
from sm120kit.patching import jit_cache, transaction
from sm120kit.patching.ledger import DamagedLedger, FileEntry, Ledger, ReadOnly, sha256
from sm120kit.patching.spec import (
    AlreadyApplied,
    AnchorMissing,
    FixedUpstream,
    Outcome,
    Patch,
    Rewrite,
    Rewritten,
    marker_revisions,
)
from sm120kit.target import Distribution, Target


@dataclass
class Finding:
    patch: Patch
    outcome: Outcome
    detail: str = ""
    version: str | None = None
    path: str | None = None
    fixed_in: str | None = None  # the upstream release that fixed this part, if any
    unproven: str = ""  # past the proven window: "unproven on sglang 0.5.24 (proven 0.5.9–0.5.23)"
    allowed: bool = False  # an anchor-missing the user accepted (--allow-missing, recorded)
    stuck: bool = False  # outdated, and `patch` cannot rebuild it (the detail says why)
    hint: str = ""  # for an error: what to do next

    @property
    def is_error(self) -> bool:
        return (self.outcome.is_error and not self.allowed) or self.stuck

    def as_json(self) -> dict:
        return {
            "patch": self.patch.id,
            "package": self.patch.package,
            "version": self.version,
            "path": self.path,
            "outcome": self.outcome.value,
            "detail": self.detail,
            "fixed_in": self.fixed_in,
            "proven": not self.unproven,
            "proven_window": self.patch.window,
            "unproven": self.unproven or None,
            "allowed": self.allowed,
            "error": self.is_error,
            "hint": self.hint or None,
        }


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
    allowances: dict[tuple[Path, str], dict] = field(
        default_factory=dict
    )  # (site, patch id): --allow-missing to record
    interrupted: list[Path] = field(default_factory=list)  # journals of a killed run, not recovered yet
    damaged: list[str] = field(default_factory=list)  # ledgers that failed validation (read without them)

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
        return [*self.damaged, *unfinished]

    def exit_code(self, check: bool) -> int:
        if self.errors or self.blockers:
            return 2
        if check and self.pending:
            return 1
        return 0


# -- transforming source (pure: bytes in, bytes and findings out) ----------------------


def _transform(
    source: bytes, items: list[tuple[Patch, Rewrite]], version: str, relpath: str
) -> tuple[bytes, list[Finding]]:
    import libcst as cst

    def finding(patch: Patch, rewrite: Rewrite, outcome: Outcome, detail: str = "") -> Finding:
        return Finding(patch, outcome, detail, version, relpath, patch.fixed_in_for(rewrite))

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        reason = f"{relpath} does not parse ({str(exc).splitlines()[0]})"
        return source, [finding(p, r, Outcome.ANCHOR_MISSING, reason) for p, r in items]

    findings = []
    for patch, rewrite in items:
        try:
            result = rewrite.transform(module, patch.context())
        except Exception as exc:  # a patch bug must not take the run down: report it
            import traceback

            findings.append(
                finding(patch, rewrite, Outcome.FAILED, f"transform raised {exc!r}\n{traceback.format_exc()}")
            )
            continue
        if isinstance(result, Rewritten):
            module = result.module
            findings.append(finding(patch, rewrite, Outcome.WOULD_APPLY))
        elif isinstance(result, AlreadyApplied):
            findings.append(finding(patch, rewrite, Outcome.ALREADY_APPLIED))
        elif isinstance(result, FixedUpstream):
            fixed_in = patch.fixed_in_for(rewrite)
            detail = f"fixed upstream in {fixed_in}: {result.reason}" if fixed_in else result.reason
            findings.append(finding(patch, rewrite, Outcome.FIXED_UPSTREAM, detail))
        elif isinstance(result, AnchorMissing):
            findings.append(finding(patch, rewrite, Outcome.ANCHOR_MISSING, result.reason))
        else:
            findings.append(finding(patch, rewrite, Outcome.FAILED, f"transform returned {result!r}"))
    after = module.bytes
    if after != source:
        _self_check(after, items, findings, relpath)
    return after, findings


def _self_check(after: bytes, items, findings: list[Finding], relpath: str) -> None:
    """Black's assert_stable, for patches: the result parses, compiles, carries each
    marker, and a second pass of every transform that rewrote it changes nothing."""
    import libcst as cst

    text = after.decode("utf-8", "replace")
    try:
        compile(after, relpath, "exec", dont_inherit=True)
        module = cst.parse_module(after)
    except (SyntaxError, ValueError, cst.ParserSyntaxError) as exc:
        for f in findings:
            if f.outcome is Outcome.WOULD_APPLY:
                f.outcome, f.detail = Outcome.FAILED, f"the rewritten file does not compile: {exc}"
        return
    for (patch, rewrite), f in zip(items, findings):
        if f.outcome is not Outcome.WOULD_APPLY:
            continue
        if patch.revision not in marker_revisions(text, patch.id):
            f.outcome, f.detail = Outcome.FAILED, "the transform did not leave its marker comment"
        elif not isinstance(rewrite.transform(module, patch.context()), AlreadyApplied):
            f.outcome, f.detail = Outcome.FAILED, "unstable: a second pass would change the code again"


# -- planning --------------------------------------------------------------------------


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
    result = Plan(target)
    by_package: dict[str, list[Patch]] = defaultdict(list)
    for patch in patches:
        by_package[patch.package].append(patch)

    installed = 0
    for package, group in by_package.items():
        dist = target.find(package)
        if dist is None:
            result.findings += [Finding(p, Outcome.NOT_APPLICABLE, f"{package} is not installed") for p in group]
            continue
        installed += 1
        if dist.site not in result.ledgers:  # sglang and flashinfer usually share one
            result.ledgers[dist.site] = _load_ledger(result, dist.site, tolerate_damage)
            result.interrupted += transaction.pending([dist.site])
        ledger = result.ledgers[dist.site]
        per_file: dict[str, list[tuple[Patch, Rewrite]]] = defaultdict(list)
        for patch in group:
            to_run = patch.rewrites_to_run(dist.version)
            for rewrite in to_run:
                per_file[rewrite.path].append((patch, rewrite))
            if patch.is_past_window(dist.version):
                result.findings += _fixed_by_version(patch, dist, to_run)
            elif not to_run:
                outcome, detail = _outside_window(patch, dist)
                result.findings.append(Finding(patch, outcome, detail, dist.version, fixed_in=patch.fixed_in))
        allowed = {pid: "--allow-missing" for pid in allow_missing}
        allowed = {**ledger.allowed_for(dist.name, dist.version), **allowed}
        for relpath, items in per_file.items():
            _plan_file(result, dist, ledger, relpath, items, force, cache, need_bytes, allowed)
        for f in result.findings:
            if f.outcome is Outcome.ANCHOR_MISSING and f.patch.package == dist.name and f.patch.id in allow_missing:
                result.allowances[(dist.site, f.patch.id)] = {
                    "package": dist.name,
                    "version": dist.version,
                    "reason": f.detail.rsplit(" (allowed:", 1)[0],
                }
        _plan_untargeted_entries(result, dist, ledger, set(per_file))
        if dist.record_damaged:
            result.warnings.append(
                f"{dist.dist_info / 'RECORD'} is not valid UTF-8 (a damaged installation): the rows of the files sm120kit "
                f"patches were read, the rest ignored; repair it: pip install --force-reinstall --no-deps {dist.name}=={dist.version}"
            )
        result.warnings += _stale_jit_caches(dist, ledger)
        prebuilt = jit_cache.prebuilt_package(dist)
        if prebuilt and (aot := target.find(prebuilt)):
            result.warnings.append(
                f"{aot.name} {aot.version} is installed: flashinfer loads its prebuilt kernels instead of "
                f"building from the sources that sm120kit patches (pip uninstall {aot.name} to use the fixes)"
            )

    if patches and not installed:
        names = sorted(by_package)
        missing = f"{names[0]} is not installed" if len(names) == 1 else f"none of {', '.join(names)} is installed"
        raise UserError(
            f"{missing} in {target.description}: nothing to do",
            "point sm120kit at the serving environment with --python /path/to/venv/bin/python or --site DIR",
        )
    return result


def _load_ledger(result: Plan, site: Path, tolerate_damage: bool) -> Ledger:
    try:
        return Ledger.load(site)
    except DamagedLedger as exc:
        if not tolerate_damage:
            raise
        result.damaged.append(str(exc))
        return Ledger(site)


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


def _fixed_by_version(patch: Patch, dist: Distribution, to_run: list[Rewrite]) -> list[Finding]:
    """Past the proven window, the parts of the window's top that do not run by shape: their
    bug is known fixed upstream in this release."""
    return [
        Finding(
            patch,
            Outcome.FIXED_UPSTREAM,
            f"fixed upstream in {fixed} (by version; proven {patch.window})",
            dist.version,
            r.path,
            fixed,
        )
        for r in patch.current_rewrites
        if r not in to_run and (fixed := patch.fixed_in_for(r))
    ]


def _outside_window(patch: Patch, dist: Distribution) -> tuple[Outcome, str]:
    if patch.is_fixed_in(dist.version):
        return (
            Outcome.FIXED_UPSTREAM,
            f"fixed upstream in {patch.fixed_in} (by version; beyond the releases it was proven on)",
        )
    windows = "; ".join(sorted({r.versions for r in patch.rewrites}))
    return Outcome.NOT_APPLICABLE, f"{dist.name} {dist.version} is outside {windows}"


def _file_state(dist: Distribution, entry: FileEntry | None, relpath: str, digest: str) -> str:
    """pristine: the vendor's bytes; ours: what we last wrote; foreign: neither."""
    if entry and digest == entry.patched_sha256:
        return "ours"
    recorded = dist.recorded_sha256(relpath)
    if recorded is not None:
        return "pristine" if digest == recorded else "foreign"
    # No RECORD hash (editable source tree): the bytes we first saw are the baseline.
    return "pristine" if entry is None or digest == entry.vendor_sha256 else "foreign"


def _cache_key(patch: Patch, rewrite: Rewrite, version: str, digest: str) -> str:
    return outcome_cache.key(patch.id, str(patch.revision), patch.source_sha256, rewrite.path, version, digest)


def _verdicts(before: bytes, digest: str, items, version: str, relpath: str, cache: bool, need_bytes: bool):
    """(new bytes or None when not needed, findings): from the cache when it has every
    verdict and no new bytes are needed, else from the transforms (and then cached)."""
    keys = [_cache_key(p, r, version, digest) for p, r in items]
    if cache:
        hits = [outcome_cache.get(k) for k in keys]
        if all(hits) and not (need_bytes and any(h["outcome"] == Outcome.WOULD_APPLY.value for h in hits)):
            return None, [
                Finding(p, Outcome(h["outcome"]), h["detail"], version, relpath, p.fixed_in_for(r))
                for (p, r), h in zip(items, hits)
            ]
    after, findings = _transform(before, items, version, relpath)
    after_digest = sha256(after)
    for (p, r), k, f in zip(items, keys, findings):
        if f.outcome is not Outcome.FAILED:  # a failure may be an environment accident; retry it
            outcome_cache.put(k, {"outcome": f.outcome.value, "detail": f.detail})
        if f.outcome is Outcome.WOULD_APPLY:  # the self-check proved it on the new bytes
            outcome_cache.put(
                _cache_key(p, r, version, after_digest), {"outcome": Outcome.ALREADY_APPLIED.value, "detail": ""}
            )
    return after, findings


def _plan_file(
    plan_: Plan,
    dist: Distribution,
    ledger: Ledger,
    relpath: str,
    items,
    force: bool,
    cache: bool,
    need_bytes: bool,
    allowed: dict[str, str],
) -> None:
    path = dist.file(relpath)
    try:
        before = path.read_bytes()
    except FileNotFoundError:
        reason = f"{relpath} is absent from {dist.name} {dist.version} ({path})"
        findings = [
            Finding(p, Outcome.ANCHOR_MISSING, reason, dist.version, relpath, p.fixed_in_for(r)) for p, r in items
        ]
        plan_.findings += _qualified(findings, dist, allowed)
        return
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read the environment") from None

    key = dist.key(relpath)
    entry = ledger.files.get(key)
    digest = sha256(before)
    state = _file_state(dist, entry, relpath, digest)
    older = _other_revisions(before, items)
    if older:
        after, findings = _rebuild(before, dist, ledger, entry, state, relpath, items, older, need_bytes)
    else:
        after, findings = _verdicts(before, digest, items, dist.version, relpath, cache, need_bytes)
    plan_.findings += _qualified(findings, dist, allowed)

    if entry and state == "pristine":  # an upgrade or reinstall put the vendor's bytes back
        plan_.lost += [Lost(dist.name, entry.version, dist.version, pid, entry.path) for pid in entry.patches]
        plan_.drop.append((ledger, key))

    if state == "foreign" and not older:
        _judge_foreign(findings, entry, relpath, force)
    if after is None or after == before or any(f.is_error for f in findings):
        return
    plan_.changes.append(
        FileChange(
            dist,
            relpath,
            before,
            after,
            vendor_sha256=entry.vendor_sha256 if state == "ours" else digest,
            needs_backup=state != "ours",
        )
    )


def _qualified(findings: list[Finding], dist: Distribution, allowed: dict[str, str]) -> list[Finding]:
    """Past the proven window every outcome of a transform is unproven, and an anchor that
    moved may mean the bug was fixed or that the code changed around it: say so and what
    to do. An anchor-missing the user accepted (patch id -> how) is allowed, not an error."""
    for f in findings:
        past = f.patch.is_past_window(dist.version)
        if past:
            f.unproven = f"unproven on {dist.name} {dist.version} (proven {f.patch.window})"
        if f.outcome is not Outcome.ANCHOR_MISSING:
            continue
        if past:
            f.detail = f"{f.unproven}: {f.detail}; the bug may or may not be fixed in this release"
            last = f.patch.last_proven
            pin = (
                f"pin the last proven release (pip install '{dist.name}=={last}')"
                if last
                else f"pin a release it was proven on ({f.patch.window})"
            )
            refs = f" ({', '.join(f.patch.refs)})" if f.patch.refs else ""
            f.hint = f"{pin}, or check upstream's change to {f.path}{refs}; to go on without this patch: --allow-missing {f.patch.id}"
        else:
            f.hint = f"reinstall {dist.name} {dist.version} (pip install --force-reinstall --no-deps {dist.name}=={dist.version}); to go on without this patch: --allow-missing {f.patch.id}"
        if f.patch.id in allowed:
            f.allowed = True
            f.detail += f" (allowed: {allowed[f.patch.id]})"
    return findings


WILL_REBUILD = ": `sm120kit patch` rebuilds it from the vendor's bytes"


def _other_revisions(source: bytes, items) -> dict[str, set[int]]:
    """Patch id -> the revisions other than its current one whose markers the file carries."""
    text = source.decode("utf-8", "replace")
    found = {p.id: marker_revisions(text, p.id) - {p.revision} for p, _ in items}
    return {pid: revs for pid, revs in found.items() if revs}


def _rebuild(
    before: bytes,
    dist: Distribution,
    ledger: Ledger,
    entry: FileEntry | None,
    state: str,
    relpath: str,
    items,
    older: dict[str, set[int]],
    need_bytes: bool,
):
    """A file that carries another revision of a patch. That patch is outdated (never judged
    by its transform, which would mistake the old revision's code for upstream's); the new
    bytes are the current transforms run on the vendor's bytes (the backup), never on top
    of the old code. (new bytes or None, findings in the order of `items`)"""
    current = [item for item in items if item[0].id not in older]
    _, judged = _transform(before, current, dist.version, relpath) if current else (None, [])
    verdicts = dict(zip(map(id, current), judged))
    findings = []
    for item in items:
        patch, rewrite = item
        if patch.id not in older:
            findings.append(verdicts[id(item)])
            continue
        revs = ", ".join(f"r{r}" for r in sorted(older[patch.id]))
        detail = f"carries {revs} of this patch; this sm120kit has r{patch.revision}"
        findings.append(Finding(patch, Outcome.OUTDATED, detail, dist.version, relpath, patch.fixed_in_for(rewrite)))
    reinstall = f"pip install --force-reinstall --no-deps {dist.name}=={dist.version}, then sm120kit patch"
    vendor = ledger.backup(entry.vendor_sha256) if entry and state == "ours" else None
    if entry is None:
        problem, hint = "no ledger entry for this file (the state was lost), so the vendor's bytes are gone", reinstall
    elif state != "ours":
        problem, hint = f"{relpath} changed since sm120kit wrote it", reinstall
    elif unknown := sorted(set(entry.patches) - {p.id for p, _ in items}):
        problem, hint = (
            f"it also carries {', '.join(unknown)}, which this run does not load",
            "run without --only, or pass the --patch-dir that has it",
        )
    elif vendor is None:
        problem, hint = f"the backup {entry.vendor_sha256[:12]} of the vendor's bytes is missing or damaged", reinstall
    else:
        problem = hint = ""
    outdated = [f for f in findings if f.outcome is Outcome.OUTDATED]
    if problem:
        for f in outdated:
            f.detail, f.stuck, f.hint = f"{f.detail}, and cannot be rebuilt: {problem}", True, hint
        return None, findings
    for f in outdated:
        f.detail += WILL_REBUILD
    if not need_bytes:
        return None, findings
    after, rebuilt = _transform(vendor, items, dist.version, relpath)
    for i, f in enumerate(rebuilt):  # the current revision must apply to the vendor's bytes
        if f.outcome.is_error or (findings[i].outcome is Outcome.OUTDATED and f.outcome is not Outcome.WOULD_APPLY):
            findings[i] = f
    return after, findings


def _judge_foreign(findings: list[Finding], entry: FileEntry | None, relpath: str, force: bool) -> None:
    would_change = [f for f in findings if f.outcome is Outcome.WOULD_APPLY]
    if not would_change:
        note = (
            "marker found, but no ledger entry: the state was lost, so `unpatch` needs a reinstall"
            if entry is None
            else f"{relpath} was edited outside sm120kit after it was patched"
        )
        for f in findings:
            if f.outcome is Outcome.ALREADY_APPLIED:
                f.detail = note
        return
    for f in would_change:
        if force:
            f.detail = "over a foreign edit (--force): unpatch restores the edited bytes"
        else:
            f.outcome = Outcome.FOREIGN_EDIT
            f.detail = (
                f"{relpath} matches neither the wheel's RECORD nor sm120kit's last write: "
                "someone else edited it; reinstall the package or pass --force"
            )


def _plan_untargeted_entries(plan_: Plan, dist: Distribution, ledger: Ledger, targeted: set[str]) -> None:
    """Ledger entries for files that no rewrite covers any more (the upgrade moved or
    fixed the code): when the file is back to vendor bytes, the patch was lost."""
    for key, entry in list(ledger.files.items()):
        if entry.package != dist.name or entry.path in targeted:
            continue
        data = _read_entry(ledger, dist.file(entry.path))
        current = sha256(data) if data is not None else None
        if current == entry.patched_sha256:
            continue
        plan_.lost += [Lost(dist.name, entry.version, dist.version, pid, entry.path) for pid in entry.patches]
        plan_.drop.append((ledger, key))


# -- writing ---------------------------------------------------------------------------


def _check_writable(paths: list[Path]) -> None:
    """Refuse before writing anything. A file without write bits was made read-only on
    purpose (an image layer, a pinned install): honour that even when running as root."""
    blocked = [p for p in paths if not (p.stat().st_mode & 0o222) or not os.access(p.parent, os.W_OK)]
    if blocked:
        listing = ", ".join(f"{p} (mode {p.stat().st_mode & 0o777:04o})" for p in blocked)
        raise UserError(
            f"read-only: {listing}; nothing was changed",
            "make the files writable (chmod u+w) or patch where the environment is built",
        )


def _clear_pycache(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc"):
        with contextlib.suppress(OSError):
            pyc.unlink()


def _write(ledgers: dict[Path, Ledger], writes: list[transaction.FileWrite], op: str) -> None:
    """Every file and ledger as one crash-safe transaction; then the stale bytecode goes."""
    _check_writable([w.path for w in writes])
    transaction.commit(ledgers, writes, op)
    for w in writes:
        _clear_pycache(w.path)


@contextlib.contextmanager
def _locked(target: Target, sites: set[Path], patches: list[Patch]) -> Iterator[list[str]]:
    """The lock of every site, and first of all: finish what a killed run left there.
    Yields what the recovery did."""
    declared = {(p.package, r.path) for p in patches for r in p.rewrites}
    with contextlib.ExitStack() as stack:
        recovered: list[str] = []
        for site in sorted(sites):
            stack.enter_context(Ledger(site).locked())
            recovered += transaction.recover(
                site, lambda package, relpath: _resolve(target, declared, package, relpath)
            )
        yield recovered


def _resolve(target: Target, declared: set[tuple[str, str]], package: str, relpath: str) -> Path | None:
    """A journal's file: only one a loaded patch rewrites, inside the target."""
    dist = target.find(package)
    if (package, relpath) not in declared or dist is None:
        return None
    path = dist.file(relpath)
    return path if _inside(dist, path) else None


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
    sites = {d.site for p in patches if (d := target.find(p.package))}
    try:
        with _locked(target, sites, patches) as recovered:
            result = plan(target, patches, force, allow_missing=allow_missing, tolerate_damage=False)
            result.warnings[:0] = recovered
            if not result.errors:
                _write_plan(result, keep_jit_cache)
    except ReadOnly:
        result = plan(target, patches, force, allow_missing=allow_missing, tolerate_damage=False)
        if not (result.errors or result.blockers) and (result.changes or result.drop or result.allowances):
            raise
    return result


def _write_plan(result: Plan, keep_jit_cache: bool) -> None:
    for ledger, key in result.drop:
        ledger.files.pop(key, None)
    for change in result.changes:
        _record(result, change)
    for (site, patch_id), allowance in result.allowances.items():
        result.ledgers[site].allow_missing(patch_id, allowance)
    if result.changes or result.drop or result.allowances:
        writes = [
            transaction.FileWrite(c.dist.site, c.dist.name, c.relpath, c.abspath, c.before, c.after)
            for c in result.changes
        ]
        _write(result.ledgers, writes, "patch")
    _after_source_change(result, {c.dist for c in result.changes}, keep_jit_cache)
    written = {(c.dist.name, c.relpath) for c in result.changes}
    for f in result.findings:
        if f.outcome is Outcome.WOULD_APPLY:
            f.outcome = Outcome.APPLIED
        elif f.outcome is Outcome.OUTDATED and (f.patch.package, f.path) in written:
            f.outcome, f.detail = (
                Outcome.APPLIED,
                f.detail.removesuffix(WILL_REBUILD) + ": rebuilt from the vendor's bytes",
            )


def _after_source_change(result: Plan | Unpatched, dists, keep_jit_cache: bool) -> None:
    for dist in sorted(dists, key=lambda d: d.name):
        if keep_jit_cache:
            result.warnings += [
                f"{dist.name}: kept the JIT cache {d} (--keep-jit-cache): it was built from the old sources"
                for d in jit_cache.cache_dirs(dist)
            ]
        else:
            result.jit_cache_removed += jit_cache.remove(dist)


def _record(result: Plan, change: FileChange) -> None:
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
    result = plan(target, patches, cache=False)
    problems = [
        f"{f.patch.id}: {f.outcome.value} {f.detail}".rstrip()
        for f in result.findings
        if f.is_error or f.outcome in (Outcome.WOULD_APPLY, Outcome.OUTDATED)
    ]
    problems += result.blockers
    problems += [row.detail for row in _unrecorded_rows(target, result)]
    for ledger in result.ledgers.values():
        for key, entry in ledger.files.items():
            dist = target.find(entry.package)
            path = dist.file(entry.path) if dist else None
            if path is None or not path.exists() or sha256(path.read_bytes()) != entry.patched_sha256:
                problems.append(f"{key}: the bytes on disk are not the ones sm120kit recorded")
            elif ledger.backup(entry.vendor_sha256) is None:
                problems.append(
                    f"{key}: the backup of its vendor bytes is missing or damaged, so `unpatch` could not restore it"
                )
    return problems


# -- reverting -------------------------------------------------------------------------


@dataclass
class Restore:
    package: str
    version: str
    path: str
    patch_ids: list[str]
    outcome: str  # restored | would-restore | pristine | foreign-edit | no-backup
    detail: str = ""

    @property
    def is_error(self) -> bool:
        return self.outcome in ("foreign-edit", "no-backup")

    def as_json(self) -> dict:
        return {k: getattr(self, k) for k in ("package", "version", "path", "patch_ids", "outcome", "detail")}


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
    wanted = only if only is not None else {p.id for p in patches}
    sites = {d.site for p in patches if p.id in wanted and (d := target.find(p.package))}
    try:
        with _locked(target, sites, patches) if not dry_run else contextlib.nullcontext([]) as recovered:
            result, ledgers, writes = _plan_unpatch(target, patches, wanted, sites, force)
            result.warnings[:0] = recovered
            if dry_run:
                result.warnings += [
                    f"an interrupted sm120kit run left {j}: `sm120kit unpatch` finishes it first, so what it restores may differ"
                    for j in transaction.pending(sites)
                ]
            if dry_run or any(r.is_error for r in result.rows):
                return result
            if writes or any(ledger.changed for ledger in ledgers.values()):
                _write(ledgers, writes, "unpatch")
    except ReadOnly:
        result, ledgers, writes = _plan_unpatch(target, patches, wanted, sites, force)
        if writes or any(ledger.changed for ledger in ledgers.values()):
            raise
        return result
    restored = [r for r in result.rows if r.outcome == "would-restore"]
    for row in restored:
        row.outcome = "restored"
    _after_source_change(result, {target.find(r.package) for r in restored}, keep_jit_cache)
    return result


def _plan_unpatch(target: Target, patches: list[Patch], wanted: set[str], sites: set[Path], force: bool):
    """(the rows, the ledgers as they will be, the file writes) of an unpatch."""
    by_id = {p.id: p for p in patches}
    ledgers = {s: Ledger.load(s) for s in sorted(sites)}
    rows: list[Restore] = []
    writes: list[transaction.FileWrite] = []
    updates: list[tuple[Ledger, str, FileEntry | None]] = []
    for ledger in ledgers.values():
        for key, entry in ledger.files.items():
            ids = sorted(set(entry.patches) & wanted)
            if ids:
                _plan_restore(target, ledger, key, entry, ids, by_id, force, rows, writes, updates)
    rows += _unrecorded(target, [p for p in patches if p.id in wanted], ledgers)
    for ledger, key, entry in updates:
        if entry is None:
            ledger.files.pop(key, None)
        else:
            ledger.files[key] = entry
    for ledger in ledgers.values():
        ledger.forget_allowances(wanted)
    return Unpatched(rows), ledgers, writes


def _plan_restore(target, ledger, key, entry, ids, by_id, force, rows, writes, updates) -> None:
    dist = target.find(entry.package)
    row = Restore(entry.package, dist.version if dist else "-", entry.path, ids, "would-restore")
    rows.append(row)
    path = _entry_file(ledger, entry, [by_id[i] for i in ids], dist)
    current = _read_entry(ledger, path)
    recorded = dist.recorded_sha256(entry.path) if dist else None
    digest = sha256(current) if current is not None else None
    if digest is None or digest in (recorded, entry.vendor_sha256):
        row.outcome, row.detail = "pristine", "already the vendor's bytes (reinstalled or upgraded)"
        updates.append((ledger, key, None))
        return
    if digest != entry.patched_sha256 and not force:
        row.outcome = "foreign-edit"
        row.detail = f"{entry.path} changed since sm120kit wrote it; pass --force to restore the original anyway"
        return
    original = ledger.backup(entry.vendor_sha256)
    if original is None:
        row.outcome = "no-backup"
        row.detail = f"the backup {entry.vendor_sha256[:12]} is missing or damaged; reinstall: pip install --force-reinstall --no-deps {entry.package}=={entry.version}"
        return
    others = [i for i in entry.patches if i not in ids]
    if unknown := [i for i in others if i not in by_id]:
        row.outcome = "no-backup"
        row.detail = f"{entry.path} also carries {', '.join(unknown)}, which is not loaded: pass its --patch-dir"
        return
    keep = [(by_id[i], r) for i in others for r in by_id[i].rewrites_to_run(entry.version) if r.path == entry.path]
    if lost := sorted(set(others) - {p.id for p, _ in keep}):
        row.outcome = "no-backup"
        row.detail = f"{entry.path} also carries {', '.join(lost)}, which has no rewrite of it for {entry.package} {entry.version}: unpatch them together"
        return
    new = original
    if keep:
        new, _ = _transform(original, keep, entry.version, entry.path)
    writes.append(transaction.FileWrite(ledger.site, entry.package, entry.path, path, current, new))
    if new == original:
        updates.append((ledger, key, None))
        proof = recorded or entry.vendor_sha256
        row.detail = (
            "matches the wheel's RECORD"
            if sha256(new) == recorded
            else (
                "matches the bytes recorded before patching"
                if sha256(new) == proof
                else "restored the pre-patch bytes (they differ from RECORD)"
            )
        )
    else:
        remaining = {p.id: p.revision for p, _ in keep}
        updates.append(
            (
                ledger,
                key,
                FileEntry(
                    entry.package,
                    entry.version,
                    entry.path,
                    entry.vendor_sha256,
                    sha256(new),
                    remaining,
                    entry.patched_at,
                ),
            )
        )
        row.detail = f"re-applied on the original: {', '.join(remaining)}"


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
    if not _inside(dist, path):
        raise ledger.damaged(f"{entry.path} resolves to {path.resolve()}, outside {dist.name}'s install root")
    return path


def _inside(dist: Distribution, path: Path) -> bool:
    root = (dist.editable_root or dist.site).resolve()
    return path.parent.resolve().is_relative_to(root)


def _read_entry(ledger: Ledger, path: Path | None) -> bytes | None:
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


def _unrecorded(target: Target, patches: list[Patch], ledgers: dict[Path, Ledger]) -> list[Restore]:
    """Applied code with no ledger entry (the state was lost): nothing to restore from."""
    result = plan(target, patches, need_bytes=False)
    result.ledgers.update(ledgers)
    return _unrecorded_rows(target, result)


def _unrecorded_rows(target: Target, result: Plan) -> list[Restore]:
    rows = []
    for f in result.findings:
        if f.outcome not in (Outcome.ALREADY_APPLIED, Outcome.OUTDATED) or f.path is None:
            continue
        dist = target.find(f.patch.package)
        ledger = result.ledgers.get(dist.site) or Ledger(dist.site)
        if dist.key(f.path) in ledger.files:
            continue
        reinstall = f"pip install --force-reinstall --no-deps {dist.name}=={dist.version}"
        rows.append(
            Restore(
                dist.name,
                dist.version,
                f.path,
                [f.patch.id],
                "no-backup",
                f"{f.path}: patched code without a ledger entry, so `unpatch` cannot restore it; reinstall: {reinstall}",
            )
        )
    return rows
