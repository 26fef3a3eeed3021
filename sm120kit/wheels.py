"""Real release wheels: fetched from the package index once (pip download, cached) and
installed into a site directory the way pip installs them.

A wheel unpacked is an installed distribution: its files plus a dist-info with RECORD.
That is what the patch tests run against and what `sm120kit try` shows the whole cycle on,
without a GPU and without sglang installed. Unpacking only some members (the files the
patches touch and those the flag schema is read from) keeps an install fast; RECORD still
lists every file, so an upgrade removes the old release's files as pip would.

The cache is $SM120KIT_WHEEL_CACHE, else the platform's user cache dir
(~/.cache/sm120kit/wheels on Linux).
"""

from __future__ import annotations

import base64
import csv
import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from sm120kit import caches

CACHE_ENV = "SM120KIT_WHEEL_CACHE"

# Every sglang release the patch engine is proven on, post-releases included. Extending it
# means: the tests pass on the new release, and the patches' `<=` bounds move with it.
SGLANG_WINDOW = (
    "0.5.9",
    "0.5.10",
    "0.5.10.post1",
    "0.5.11",
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)

# flashinfer-python releases newer than the one the window's last sglang pins, on which the
# flashinfer patches are proven too (tests/test_flashinfer_patches.py; conformance --window).
# There is no 0.7.3 on the index.
FLASHINFER_PAST_PINS = ("0.7.2.post1", "0.7.4")

# The releases from 0.5.12 on are cp311 manylinux wheels; the .py sources are the same
# on every platform, so one tag set serves any machine (a Mac included).
PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_34_x86_64",
    "--platform",
    "any",
]

# What sm120kit reads sglang's flag schema from (profiles render for it): with the files the
# patches name, all an install needs to hold for the patch and profile commands.
SCHEMA_SOURCES = [
    "sglang/srt/server_args.py",
    "sglang/srt/arg_groups/*.py",
    "sglang/srt/utils/common.py",
    "sglang/srt/model_executor/cuda_graph_config.py",
]


class FetchError(Exception):
    """pip could not give the wheel: the release does not exist, or the index is out of reach."""


def cache_dir() -> Path:
    """The wheel cache, made if missing. One that cannot be made (a file there, no write
    permission) is a UserError naming the path and $SM120KIT_WHEEL_CACHE."""
    configured = os.environ.get(CACHE_ENV)
    path = Path(configured) if configured else caches.cache_dir("wheels", env=None)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from sm120kit.errors import UserError

        source = f"${CACHE_ENV}" if configured else f"the default wheel cache (${CACHE_ENV} is not set)"
        why = "a file, not a directory" if path.is_file() else exc.strerror or exc
        raise UserError(
            f"cannot use {path} as the wheel cache ({source}): {why}",
            f"point ${CACHE_ENV} at a directory you can write to, e.g. export {CACHE_ENV}=$HOME/sm120kit-wheels",
        ) from None
    return path


def cached(package: str, version: str) -> Path | None:
    """The cached wheel of package==version, if there is one (any platform tag will do)."""
    stem = package.replace("-", "_")
    hits = sorted(cache_dir().glob(f"{stem}-{version}-*.whl"))
    return hits[0] if hits else None


# What pip prints when it never reached the index (as opposed to an index without the release).
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Network is unreachable|Temporary failure in name "
    r"resolution|Name or service not known|Max retries exceeded|ConnectTimeout|ReadTimeout|ProxyError|SSLError|"
    r"Connection refused"
)


def _pip_download(requirement: str) -> Path:
    """`pip download --no-deps` of one requirement into the cache; the wheel it gave."""
    if importlib.util.find_spec("pip") is None:
        raise FetchError(f"cannot download {requirement}: pip is not installed in {sys.executable}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM, requirement, "-d", str(cache_dir())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    text = proc.stdout + proc.stderr
    # To the end of the line: a cache path may hold spaces.
    if proc.returncode == 0 and (m := re.search(r"(?:Saved|File was already downloaded) (.+\.whl)\s*$", text, re.M)):
        return Path(m[1])
    name = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0]
    listed = re.search(r"\(from versions: ([^)]*)\)", text)
    if _UNREACHABLE.search(text) or (listed and listed[1].strip() == "none" and "Retrying" in text):
        raise FetchError(f"cannot reach the package index for {requirement} (no network?)")
    if listed and listed[1].strip() != "none":
        newest = ", ".join(listed[1].split(", ")[-3:])
        raise FetchError(f"{requirement} is not on the package index (its newest releases there: {newest})")
    if listed:  # pip printed no versions and no connection error (as with PIP_RETRIES=0): either
        raise FetchError(
            f"the package index listed no {name} wheel for this platform, or could not be reached ({requirement})"
        )
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
    raise FetchError(f"pip download {requirement} failed: {last[0].strip()}")


def fetch(package: str, version: str) -> Path:
    """The wheel of package==version, downloaded once (pip download --no-deps). Two
    processes that want the same wheel (two commands, or the test suite's workers) take
    turns: pip copies the file in place, and a half-copied wheel must not look cached."""
    from filelock import FileLock

    with FileLock(str(cache_dir() / f".{package.replace('-', '_')}-{version}.lock")):
        return cached(package, version) or _pip_download(f"{package}=={version}")


def latest(package: str) -> str:
    """The newest release of `package` that the package index offers (pip's choice: no
    pre-releases), fetched into the cache on the way."""
    wheel = _pip_download(package)
    return wheel.name.split("-")[1]


def flashinfer_pin(sglang_version: str) -> str | None:
    """The flashinfer-python release that sglang==version pins (its METADATA says)."""
    with zipfile.ZipFile(fetch("sglang", sglang_version)) as zf:
        info = next(n for n in zf.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith("/METADATA"))
        metadata = zf.read(info).decode()
    pins = re.findall(r"^Requires-Dist: flashinfer[-_]python(?:\[[^\]]*\])?==([^\s;,]+)", metadata, re.M)
    return pins[0] if pins else None


def read_member(wheel: Path, relpath: str) -> bytes:
    """The bytes of one file as the wheel ships it."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(relpath)


def unpack(wheel: Path, site: Path, members: Iterable[str] | None = None) -> Path:
    """Extract the dist-info and the files matching `members` (fnmatch globs; all files
    when None) into `site`. Returns the dist-info directory."""
    # One pattern for all the globs: a wheel lists ~16,000 names, each tried against each glob.
    wanted = None if members is None else re.compile("|".join(fnmatch.translate(g) for g in members) or "(?!)")
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info"))
        for name in names:
            if name.endswith("/"):
                continue
            if name.startswith(dist_info + "/") or wanted is None or wanted.match(name):
                zf.extract(name, site)
    return site / dist_info


def _dist_infos(site: Path, package: str) -> list[Path]:
    return sorted(site.glob(f"{package.replace('-', '_')}-*.dist-info"))


def _record_rows(dist_info: Path) -> list[list[str]]:
    return [row for row in csv.reader((dist_info / "RECORD").read_text().splitlines()) if row]


def uninstall(site: Path, package: str) -> list[str]:
    """What `pip uninstall` does: remove the files RECORD lists, then the dist-info.
    Anything else in site-packages (such as sm120kit's ledger) stays. Returns the names of
    the dist-info directories removed."""
    removed = []
    root = site.resolve()
    for dist_info in _dist_infos(site, package):
        for row in _record_rows(dist_info):
            path = site / row[0]
            # A row that points outside the site dir (a script installed to bin/) is not ours to remove.
            if not row[0].startswith(dist_info.name) and path.resolve().is_relative_to(root):
                path.unlink(missing_ok=True)
        shutil.rmtree(dist_info)
        removed.append(dist_info.name)
    return removed


def install(site: Path, package: str, version: str, members: Iterable[str] | None = None) -> Path:
    """Install (or upgrade to) package==version in `site` the way pip would. Returns the
    new dist-info directory."""
    wheel = fetch(package, version)  # before anything is removed: no network, no change
    uninstall(site, package)
    return unpack(wheel, site, members)


def recorded_sha256(site: Path, package: str) -> dict[str, str]:
    """relpath -> the sha256 (hex) that the installed distribution's RECORD gives it. Read
    here, not through sm120kit.target, so that a proof against RECORD does not trust the
    reader it proves."""
    [dist_info] = _dist_infos(site, package)
    return {
        row[0]: base64.urlsafe_b64decode(row[1][len("sha256=") :] + "==").hex()
        for row in _record_rows(dist_info)
        if len(row) > 1 and row[1].startswith("sha256=")
    }
