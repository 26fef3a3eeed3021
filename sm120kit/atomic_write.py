"""One file replaced whole, or not at all: what a kill, a full disk or a Ctrl-C mid-write
leaves is the old file or the new one, never a torn one. The ledger, the journal, the
backups, a smoke baseline, tune-moe's progress and bench's records are written this way."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TMP_SUFFIX = ".sm120kit-tmp"  # names our temp files, so that a clean-up never takes anyone else's


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, keep mode bits and owner, os.replace. A
    failure (EIO, ENOSPC, out of inodes) is an OSError that names `path`, not its temp file."""
    try:
        _write_atomic(path, data)
    except OSError as exc:
        if exc.filename == str(path):
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def _write_atomic(path: Path, data: bytes) -> None:
    st = path.stat() if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
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
