"""sm120kit's own wheel, for an image that installs it (`render docker --out DIR` puts it in
the build's context): the wheel file this sm120kit was installed from, or one built from its
source directory (an editable install, or one from a checkout) with `pip wheel --no-deps`,
kept in the cache under the digest of the files it is built from. No package index serves
sm120kit, so the image cannot `pip install sm120kit==VERSION`."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from sm120kit.caches import cache_dir
from sm120kit.errors import UserError

DIST = "sm120kit"
# What pyproject.toml's wheel target is built from (tool.hatch.build.targets.wheel: the package
# and the force-included patch set and profiles; the metadata's readme and license): the
# digest of these names a built wheel in the cache.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "sm120kit", "patches", "profiles")
SKIPPED = {"__pycache__"}
BUILD_TIMEOUT_S = 600
REINSTALL = (
    "install sm120kit from a checkout (pip install -e CHECKOUT) or from a wheel file "
    "(pip install ./sm120kit-VERSION-py3-none-any.whl), then render again"
)


def wheel_name() -> str:
    """The file name of this sm120kit's wheel (pure Python: py3-none-any)."""
    from packaging.version import Version

    from sm120kit import __version__

    return f"{DIST}-{Version(__version__)}-py3-none-any.whl"


def own_wheel() -> Path:
    """This sm120kit's wheel: the file it was installed from, else one built from its source
    directory (cached). A UserError when neither is here."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise UserError(
            "sm120kit is not installed as a package here: it has no wheel to put in the image", REINSTALL
        ) from None
    origin = _origin(dist)
    if origin is None:
        raise UserError(
            "sm120kit was installed from a package index or an archive that is not on this machine: "
            "there is no wheel or source here to put in the image",
            REINSTALL,
        )
    if origin.is_dir():
        return _built(origin)
    if origin.is_file() and origin.name.endswith(".whl"):
        return origin
    what = "is not on this machine any more" if not origin.exists() else "is neither a wheel nor a source directory"
    raise UserError(f"sm120kit was installed from {origin}, which {what}", REINSTALL)


def _origin(dist: metadata.Distribution) -> Path | None:
    """Where pip installed it from (PEP 610's direct_url.json): a local directory or file."""
    text = dist.read_text("direct_url.json")
    try:
        url = json.loads(text)["url"] if text else None
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or urlparse(url).scheme != "file":
        return None
    return Path(unquote(urlparse(url).path))


def source_digest(source: Path) -> str:
    """sha256 over the names and bytes of the files the wheel is built from."""
    digest = hashlib.sha256()
    for top in WHEEL_SOURCES:
        path = source / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        for file in files:
            if SKIPPED.isdisjoint(file.relative_to(source).parts):
                digest.update(f"{file.relative_to(source).as_posix()}\0".encode())
                digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _built(source: Path) -> Path:
    """The wheel built from `source` (`pip wheel --no-deps`), from the cache when its files
    are the ones it was built from."""
    if not (source / "pyproject.toml").is_file():
        raise UserError(
            f"sm120kit's source directory {source} has no pyproject.toml to build its wheel from", REINSTALL
        )
    try:
        key = source_digest(source)[:32]
    except OSError as exc:
        raise UserError(f"cannot read sm120kit's source in {source}: {exc.strerror or exc}", REINSTALL) from None
    cache = cache_dir("own-wheel")
    cached = cache / key / wheel_name()
    if cached.is_file():
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", scratch, str(source)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            done = None
        built = Path(scratch) / wheel_name()
        if done is None or done.returncode != 0 or not built.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()[-1:] if done else []
            why = said[0] if said else f"no {wheel_name()} after {BUILD_TIMEOUT_S} s" if done is None else "no wheel"
            raise UserError(
                f"could not build sm120kit's wheel from {source}: {why}",
                f"{sys.executable} -m pip wheel --no-deps {source} (it fetches the build backend, hatchling, "
                "from the package index) must work here; then render again",
            )
        (cache / key).mkdir(exist_ok=True)
        built.replace(cached)  # whole or not at all: the same file system
    for stale in cache.iterdir():  # one build kept: a wheel of older source is never asked for again
        if stale.name != key and len(stale.name) == len(key) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return cached
