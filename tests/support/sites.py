"""Real upstream releases: sglang's proven window, the files of a release's wheel, a release
unpacked into a throwaway site directory as pip would, and the edits a test makes to an
installed release (a raised version, a changed file, a user's patch directory)."""

from __future__ import annotations

import atexit
import base64
import csv
import functools
import hashlib
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version

from sm120kit import wheels
from sm120kit.patching.registry import load_patches
from support.paths import FIXTURE_PATCHES

WINDOW = wheels.SGLANG_WINDOW

# The files the shipped patches (and the fixture patch) touch, and those the flag schema is
# read from; unpacking just these and the dist-info keeps a release install fast.
MEMBERS = sorted({r.path for p in load_patches([str(FIXTURE_PATCHES)]) for r in p.rewrites}) + wheels.SCHEMA_SOURCES

flashinfer_pin = functools.lru_cache(maxsize=None)(wheels.flashinfer_pin)


@functools.cache
def flashinfer_window() -> tuple[str, ...]:
    """Every flashinfer-python release the patches are proven on: the ones sglang's window
    pins, then those past the pins (`pip install -U flashinfer-python`)."""
    pins = {flashinfer_pin(v) for v in WINDOW} - {None}
    return tuple(sorted({*pins, *wheels.FLASHINFER_PAST_PINS}, key=Version))


def install(site: Path, version: str, flashinfer: bool = True) -> Path:
    """sglang==version into `site` as pip would (replacing any other version), with the
    flashinfer-python release it pins. Returns sglang's dist-info."""
    pin = flashinfer_pin(version) if flashinfer else None
    if pin:
        _install(site, "flashinfer-python", pin)
    return _install(site, "sglang", version)


def _install(site: Path, package: str, version: str) -> Path:
    """wheels.install of MEMBERS, copied from this process's one unpacking of the wheel:
    the same bytes, without reading the wheel's 16,000-name directory for every test."""
    pristine = _unpacked(package, version)
    wheels.uninstall(site, package)
    shutil.copytree(pristine, site, dirs_exist_ok=True)
    [dist_info] = pristine.glob("*.dist-info")
    return site / dist_info.name


@functools.cache
def _unpacked(package: str, version: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"pristine-{package}-{version}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    wheels.install(root, package, version, MEMBERS)
    return root


def raise_version(site: Path, package: str, new: str) -> Path:
    """The installed release of `package` as its next upstream release will look when its
    code is unchanged: the same files, the version raised (METADATA, the dist-info's name,
    RECORD's rows for it). Returns the new dist-info."""
    stem = package.replace("-", "_")
    [old] = site.glob(f"{stem}-*.dist-info")
    new_info = site / f"{stem}-{new}.dist-info"
    metadata = (old / "METADATA").read_text()
    (old / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {new}", metadata, count=1, flags=re.M))
    record = (old / "RECORD").read_text()
    (old / "RECORD").write_text(record.replace(f"{old.name}/", f"{new_info.name}/"))
    old.rename(new_info)
    return new_info


def replace_installed(site: Path, package: str, relpath: str, data: bytes) -> None:
    """A release whose file differs from the one installed: new bytes, and RECORD's hash
    for them (as the wheel of that release would have it)."""
    (site / relpath).write_bytes(data)
    [dist_info] = site.glob(f"{package.replace('-', '_')}-*.dist-info")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rows = [
        f"{relpath},sha256={digest},{len(data)}" if line.startswith(f"{relpath},") else line
        for line in (dist_info / "RECORD").read_text().splitlines()
    ]
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n")


def record_digest(site: Path, package: str, relpath: str) -> bytes:
    """The sha256 that the installed release's RECORD gives for `relpath`."""
    [dist_info] = site.glob(f"{package.replace('-', '_')}-*.dist-info")
    for row in csv.reader((dist_info / "RECORD").read_text().splitlines()):
        if row[0] == relpath:
            return base64.urlsafe_b64decode(row[1].split("=", 1)[1] + "==")
    raise KeyError(relpath)


def patch_dir(root: Path, package: str, name: str, source: str) -> Path:
    """A --patch-dir holding one user patch module: root/<package>/<name>.py."""
    (root / package).mkdir(parents=True, exist_ok=True)
    (root / package / f"{name}.py").write_text(source)
    return root


def next_release(version: str) -> str | None:
    i = WINDOW.index(version)
    return WINDOW[i + 1] if i + 1 < len(WINDOW) else None


@functools.cache
def wheel_bytes(version: str, relpath: str, package: str = "sglang") -> bytes:
    with zipfile.ZipFile(wheels.fetch(package, version)) as zf:
        return zf.read(relpath)
