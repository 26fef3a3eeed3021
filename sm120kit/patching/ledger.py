"""State that travels with the target environment: <site>/.sm120kit/

  ledger.json   per patched file: vendor hash, our hash, patch ids + revisions, backup name
  backups/      the original bytes, content-addressed by sha256
  lock          held by a run that writes, so two runs never interleave

It lives beside the dist-info it describes, so a `docker build` step that patches leaves
state that a later `sm120kit status` in the running container reads; pip leaves it alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from sm120kit import __version__
from sm120kit.errors import UserError

STATE_DIR = ".sm120kit"
SCHEMA = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, keep mode bits and owner, os.replace."""
    st = path.stat() if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".sm120kit-tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if st is None:  # a new file gets the usual mode, not mkstemp's 0600
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        else:
            os.chmod(tmp, st.st_mode & 0o7777)
            with contextlib.suppress(OSError):
                os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@dataclass
class FileEntry:
    package: str
    version: str  # the package version the file was patched at
    path: str  # relative to the package's install root
    vendor_sha256: str  # the bytes before we wrote (the wheel's, when RECORD agrees)
    patched_sha256: str  # the bytes we last wrote
    patches: dict[str, int]  # patch id -> revision
    patched_at: str = ""


@dataclass
class Ledger:
    site: Path
    files: dict[str, FileEntry] = field(default_factory=dict)
    # "<package>:<patch id>" -> {"package", "version", "reason", "at"}: an anchor-missing the
    # user accepted with --allow-missing, for that release only (an upgrade asks again).
    allowed_missing: dict[str, dict] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.site / STATE_DIR

    @property
    def path(self) -> Path:
        return self.state_dir / "ledger.json"

    @classmethod
    def load(cls, site: Path) -> Ledger:
        ledger = cls(site)
        try:
            raw = json.loads(ledger.path.read_text())
        except FileNotFoundError:
            return ledger
        except (OSError, ValueError) as exc:
            raise UserError(
                f"{ledger.path}: the sm120kit ledger is unreadable ({exc})",
                f"move it aside (mv {ledger.path} {ledger.path}.bad) and run `sm120kit status`",
            ) from None
        if raw.get("schema") != SCHEMA:
            raise UserError(
                f"{ledger.path}: ledger schema {raw.get('schema')!r}, this sm120kit reads {SCHEMA}",
                "upgrade sm120kit (pip install -U sm120kit)",
            )
        ledger.files = {k: FileEntry(**v) for k, v in raw.get("files", {}).items()}
        ledger.allowed_missing = dict(raw.get("allowed_missing", {}))
        return ledger

    def save(self) -> None:
        self.state_dir.mkdir(exist_ok=True)
        doc = {
            "schema": SCHEMA,
            "tool": f"sm120kit {__version__}",
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
        }
        if self.allowed_missing:
            doc["allowed_missing"] = dict(sorted(self.allowed_missing.items()))
        write_atomic(self.path, (json.dumps(doc, indent=2) + "\n").encode())
        self._collect_backups()

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
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        return digest

    def backup(self, digest: str) -> bytes | None:
        """The original bytes, only if they still hash to what we recorded."""
        try:
            data = self._backup_path(digest).read_bytes()
        except OSError:
            return None
        return data if sha256(data) == digest else None

    def _collect_backups(self) -> None:
        keep = {e.vendor_sha256 for e in self.files.values()}
        backups = self.state_dir / "backups"
        if backups.is_dir():
            for path in backups.iterdir():
                if path.name not in keep:
                    path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive for the duration of a run that writes; a second run fails at once."""
        from filelock import FileLock, Timeout

        try:
            self.state_dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create {self.state_dir} ({exc.strerror}): the target is not writable",
                "run as the user that owns the environment, or patch at image build time",
            ) from None
        lock = FileLock(str(self.state_dir / "lock"), timeout=0)
        try:
            with lock:
                yield
        except Timeout:
            raise UserError(
                f"another sm120kit run is changing {self.site} (it holds {lock.lock_file})",
                "wait for it to finish, then run the command again",
            ) from None
