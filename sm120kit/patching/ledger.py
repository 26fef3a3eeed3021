"""State that travels with the target environment: <site>/.sm120kit/

  ledger.json   per patched file: vendor hash, our hash, patch ids + revisions, backup name;
                per fused-MoE config table that `tune-moe` installed: what it was tuned for
  backups/      the original bytes, content-addressed by sha256
  journal.json  only while a run writes (or after one was killed): see transaction.py
  lock          held by a run that writes, so two runs never interleave

Everything read from here is validated (a strict schema, paths that stay inside the
target, no symbolic link followed out of the directory): a damaged or hostile ledger is
reported as such and never steers a write.

It lives beside the dist-info it describes, so a `docker build` step that patches leaves
state that a later `sm120kit status` in the running container reads; pip leaves it alone.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime as _dt
import errno
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sm120kit import __version__, shallow_json
from sm120kit.atomic_write import TMP_SUFFIX, write_atomic
from sm120kit.errors import UserError
from sm120kit.patching.ledger_entries import FileEntry, TunedEntry

STATE_DIR = ".sm120kit"
# 2 adds `tuned` and `moe_config_dirs`. A ledger without them is still written as 1, so that
# an older sm120kit keeps reading it; one with them says "upgrade sm120kit" there, not "damaged".
SCHEMA = 2
SCHEMAS = (1, 2)
STATE_FILES = ("backups", "ledger.json", "journal.json", "lock")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Ledger:
    site: Path
    files: dict[str, FileEntry] = field(default_factory=dict)
    # "<package>:<path>" -> a config table tune-moe installed (see TunedEntry).
    tuned: dict[str, TunedEntry] = field(default_factory=dict)
    # Directories tune-moe installed tables into as $SGLANG_MOE_CONFIG_DIR: each keeps its
    # own ledger; this says where status and unpatch find them.
    moe_config_dirs: list[str] = field(default_factory=list)
    # "<package>:<patch id>" -> {"package", "version", "reason", "at"}: an anchor-missing the
    # user accepted with --allow-missing, for that release only (an upgrade asks again).
    allowed_missing: dict[str, dict] = field(default_factory=dict)
    loaded: bytes | None = field(default=None, repr=False, compare=False)  # the document as read

    @property
    def state_dir(self) -> Path:
        return self.site / STATE_DIR

    @property
    def path(self) -> Path:
        return self.state_dir / "ledger.json"

    @classmethod
    def load(cls, site: Path) -> Ledger:
        ledger = cls(site)
        ledger.check_state_dir()
        try:
            raw = shallow_json.loads(ledger.path.read_text())
        except FileNotFoundError:
            return ledger
        except (OSError, ValueError) as exc:
            raise ledger.damaged(f"unreadable ({exc})") from None
        if not isinstance(raw, dict) or raw.get("schema") not in SCHEMAS:
            found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            if isinstance(found, int) and found > SCHEMA:
                raise UserError(
                    f"{ledger.path}: ledger schema {found}, this sm120kit reads {SCHEMA}",
                    "upgrade sm120kit (pip install -U sm120kit)",
                )
            raise ledger.damaged(f"schema {found!r}, expected {' or '.join(map(str, SCHEMAS))}")
        from sm120kit.patching import ledger_check  # the strict schema, its verdict cached by contents

        try:
            ledger.files, ledger.allowed_missing, ledger.tuned, ledger.moe_config_dirs = ledger_check.read(raw)
        except ledger_check.Invalid as exc:
            raise ledger.damaged(str(exc)) from None
        ledger.loaded = ledger.document()
        return ledger

    @property
    def changed(self) -> bool:
        """Whether there is anything to write: entries that differ from those loaded."""
        if self.loaded is None:
            return bool(self.files or self.allowed_missing or self.tuned or self.moe_config_dirs)
        return self.document() != self.loaded

    def damaged(self, why: str) -> UserError:
        return DamagedLedger(
            f"{self.path}: the sm120kit ledger is damaged: {why}",
            f"the markers in the code still tell patched from pristine: move it aside (mv {self.path} {self.path}.bad) "
            "and run `sm120kit status`; to get the vendor's bytes back, reinstall the packages it names",
        )

    def check_state_dir(self) -> None:
        """Refuse a state directory that a symbolic link could lead out of the target."""
        for path in (self.state_dir, *(self.state_dir / name for name in STATE_FILES)):
            if path.is_symlink():
                raise UserError(
                    f"{path} is a symbolic link (to {os.readlink(path)}): "
                    "sm120kit never follows one out of its state directory",
                    f"remove the link (rm {path}) and run the command again",
                )

    def document(self) -> bytes:
        doc = {
            "schema": SCHEMA if self.tuned or self.moe_config_dirs else 1,
            "tool": f"sm120kit {__version__}",
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
        }
        if self.allowed_missing:
            doc["allowed_missing"] = dict(sorted(self.allowed_missing.items()))
        if self.tuned:
            doc["tuned"] = {k: asdict(v) for k, v in sorted(self.tuned.items())}
        if self.moe_config_dirs:
            doc["moe_config_dirs"] = sorted(set(self.moe_config_dirs))
        return (json.dumps(doc, indent=2) + "\n").encode()

    def save(self) -> None:
        self.state_dir.mkdir(exist_ok=True)
        write_atomic(self.path, self.document())

    def record(self, key: str, entry: FileEntry) -> None:
        entry.patched_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.files[key] = entry

    # -- anchor-missing accepted by the user ---------------------------------------------

    def allowed_for(self, package: str, version: str) -> dict[str, str]:
        """Patch id -> when, for each anchor-missing accepted on exactly this release."""
        return {
            key.split(":", 1)[1]: f"`sm120kit patch --allow-missing` on {a.get('at', '?')}"
            for key, a in self.allowed_missing.items()
            if a.get("package") == package and a.get("version") == version
        }

    def allow_missing(self, patch_id: str, allowance: dict) -> None:
        at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.allowed_missing[f"{allowance['package']}:{patch_id}"] = {**allowance, "at": at}

    def forget_allowances(self, patch_ids: set[str]) -> None:
        self.allowed_missing = {k: a for k, a in self.allowed_missing.items() if k.split(":", 1)[1] not in patch_ids}

    # -- backups: original bytes, named by their sha256 ---------------------------------

    def _backup_path(self, digest: str) -> Path:
        return self.state_dir / "backups" / digest

    def store_backup(self, data: bytes) -> str:
        digest = sha256(data)
        path = self._backup_path(digest)
        if self.backup(digest) is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        return digest

    def backup(self, digest: str) -> bytes | None:
        """The original bytes, only if they still hash to what we recorded (never read
        through a symbolic link, never outside backups/)."""
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        try:
            fd = os.open(self._backup_path(digest), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            data = fh.read()
        return data if sha256(data) == digest else None

    def collect_backups(self) -> None:
        """Remove the backups no ledger entry needs (after a committed run), but for the only
        copy of a file's vendor bytes: one that a RECORD of this site lists for a file that
        does not hold those bytes now (patched or removed, its ledger entry lost). `unpatch`
        restores from it; once the file holds them again, it goes."""
        keep = {e.vendor_sha256 for e in self.files.values()} | {e.vendor_sha256 for e in self.tuned.values()}
        backups = self.state_dir / "backups"
        if backups.is_dir() and not backups.is_symlink():
            orphans = [p for p in backups.iterdir() if p.name not in keep and not p.name.endswith(TMP_SUFFIX)]
            needed = _only_copies(self.site, {p.name for p in orphans}) if orphans else set()
            for path in orphans:
                if path.name not in needed:
                    path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive for the duration of a run that writes; a second run fails at once."""
        from filelock import FileLock, Timeout

        self.check_state_dir()
        lock = FileLock(str(self.state_dir / "lock"), timeout=0)
        try:
            self.state_dir.mkdir(exist_ok=True)
            lock.acquire()
        except Timeout:
            raise UserError(
                f"another sm120kit run is changing {self.site} (it holds {lock.lock_file})",
                "wait for it to finish, then run the command again",
            ) from None
        except OSError as exc:
            raise ReadOnly(self.state_dir, exc) from None
        try:
            yield
        finally:
            lock.release()


def _only_copies(site: Path, digests: set[str]) -> set[str]:
    """The digests that a RECORD in `site` lists for a file (inside the site) that does not
    hold those bytes now. A string search for each digest's RECORD spelling: no RECORD is
    parsed whole (sglang's has 6,400 rows)."""
    needles = {
        ",sha256=" + base64.urlsafe_b64encode(bytes.fromhex(d)).rstrip(b"=").decode() + ",": d
        for d in digests
        if re.fullmatch(r"[0-9a-f]{64}", d)
    }
    needed: set[str] = set()
    for record in site.glob("*.dist-info/RECORD"):
        try:
            text = record.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for needle, digest in needles.items():
            at = text.find(needle)
            while at >= 0 and digest not in needed:
                row = next(csv.reader([text[text.rfind("\n", 0, at) + 1 : at + len(needle)]]))
                relpath = row[0] if row else ""
                inside = relpath and not relpath.startswith("/") and ".." not in relpath.split("/")
                if inside and _sha256_of(site / relpath) != digest:
                    needed.add(digest)
                at = text.find(needle, at + 1)
    return needed


def _sha256_of(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except OSError:  # absent, or no file
        return None


class DamagedLedger(UserError):
    """ledger.json is not what sm120kit writes: reported, never half-read."""


class ReadOnly(UserError):
    """The state directory cannot be written (a read-only layer, another owner)."""

    def __init__(self, where: Path, exc: OSError) -> None:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):  # the disk failed, not the permissions
            super().__init__(
                f"{exc.filename or where} cannot be written ([Errno {exc.errno}] {exc.strerror or exc}); "
                "nothing was changed",
                "free some space (or inodes: df -i) and run the command again"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else "fix the cause (the kernel log says more about an I/O error) and run the command again",
            )
            return
        super().__init__(
            f"{where} is not writable ({exc.strerror or exc}): "
            "this environment is read-only for this user; nothing was changed",
            "patch where the environment is built (a Dockerfile RUN step, or as the owner of the venv); "
            "`sm120kit status` and `sm120kit patch --check` work read-only",
        )
