#!/usr/bin/env python3
"""Fetch real release wheels from PyPI (cached) and unpack them into site directories.

A wheel unpacked is an installed distribution: the files plus a dist-info with RECORD.
That is what the patch tests run against, and what a user can try sm120kit on without
a GPU node:

    python scripts/fetch_wheels.py sglang 0.5.10 --site ./site       # the whole wheel
    python scripts/fetch_wheels.py sglang --window                    # prefetch 0.5.9-0.5.23

The cache is $SM120KIT_WHEEL_CACHE, else ~/.cache/sm120kit/wheels.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# Every sglang release the patch engine is proven on, post-releases included.
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

# The releases from 0.5.12 on are cp311 manylinux wheels; the .py sources are the same
# on every platform, so one tag set serves any machine that runs the tests.
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


def cache_dir() -> Path:
    path = Path(os.environ.get("SM120KIT_WHEEL_CACHE") or Path.home() / ".cache" / "sm120kit" / "wheels")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cached(package: str, version: str) -> Path | None:
    stem = package.replace("-", "_")
    hits = sorted(cache_dir().glob(f"{stem}-{version}-*.whl"))
    return hits[0] if hits else None


class FetchError(Exception):
    """pip could not give the wheel: the release does not exist, or the index is out of reach."""


# What pip prints when it never reached the index (as opposed to an index without the release).
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Network is unreachable|Temporary failure in name "
    r"resolution|Name or service not known|Max retries exceeded|ConnectTimeout|ReadTimeout|ProxyError|SSLError|Connection refused"
)


def _pip_download(requirement: str) -> Path:
    """`pip download --no-deps` of one requirement into the cache; the wheel it gave."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM, requirement, "-d", str(cache_dir())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    text = proc.stdout + proc.stderr
    if proc.returncode == 0 and (m := re.search(r"(?:Saved|File was already downloaded) (\S+\.whl)", text)):
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
    """The wheel of package==version, downloaded once (pip download --no-deps)."""
    if hit := _cached(package, version):
        return hit
    return _pip_download(f"{package}=={version}")


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


def unpack(wheel: Path, site: Path, members: list[str] | None = None) -> Path:
    """Extract the dist-info and the files matching `members` (fnmatch globs; all files
    when None) into `site`. Returns the dist-info directory."""
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info"))
        for name in names:
            if name.endswith("/"):
                continue
            if name.startswith(dist_info + "/") or members is None or any(fnmatch.fnmatch(name, g) for g in members):
                zf.extract(name, site)
    return site / dist_info


def uninstall(site: Path, package: str) -> None:
    """What `pip uninstall` does: remove the files RECORD lists, then the dist-info.
    Anything else in site-packages (such as sm120kit's ledger) stays."""
    stem = package.replace("-", "_")
    for dist_info in site.glob(f"{stem}-*.dist-info"):
        for row in csv.reader((dist_info / "RECORD").read_text().splitlines()):
            if row and not row[0].startswith(dist_info.name):
                (site / row[0]).unlink(missing_ok=True)
        shutil.rmtree(dist_info)


def install(site: Path, package: str, version: str, members: list[str] | None = None) -> Path:
    """Install (or upgrade to) package==version in `site` the way pip would."""
    uninstall(site, package)
    return unpack(fetch(package, version), site, members)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", help="e.g. sglang")
    parser.add_argument("versions", nargs="*", help="releases to fetch")
    parser.add_argument("--window", action="store_true", help="every sglang release sm120kit is proven on")
    parser.add_argument("--site", type=Path, help="also install (unpack) the single release into this site dir")
    parser.add_argument("--member", action="append", help="unpack only files matching this glob (repeatable)")
    args = parser.parse_args()
    versions = list(args.versions) + (list(SGLANG_WINDOW) if args.window else [])
    if not versions:
        parser.error("name at least one version, or --window")
    if args.site and len(versions) != 1:
        parser.error("--site takes exactly one version")
    try:
        for version in versions:
            wheel = fetch(args.package, version)
            print(wheel)
            if args.site:
                dist_info = install(args.site, args.package, version, args.member)
                print(f"installed {dist_info.name} into {args.site}")
    except FetchError as exc:
        print(f"fetch_wheels: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
