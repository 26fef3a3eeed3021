"""The Python environment being patched: its site directories and the installed
distributions in them (version, RECORD hashes, editable source trees).

Nothing here imports the target's packages: everything is read from dist-info metadata,
so an environment with sglang, torch and CUDA is inspected without loading any of them.
"""

from __future__ import annotations

import base64
import csv
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import unquote, urlparse

from sm120kit import path_limits, shallow_json
from sm120kit.errors import UserError

# Asked of a foreign interpreter (--python): where its installed packages live.
_SITE_QUERY = (
    "import json, site, sys, sysconfig; p = sysconfig.get_paths(); "
    "print(json.dumps([p['purelib'], p['platlib'], *site.getsitepackages(), *sys.path]))"
)


def canonicalize_name(name: str) -> str:
    """PEP 503 normalisation (as packaging.utils does, without its import cost)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hex(digest: str) -> str | None:
    algo, _, value = digest.partition("=")
    if algo != "sha256" or not value:
        return None
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except ValueError:  # a damaged row: no hash to trust
        return None
    return raw.hex() if len(raw) == 32 else None


def reinstall_command(name: str, version: str) -> str:
    """The pip command that puts a package's own files back (the hint wherever they are gone)."""
    return f"pip install --force-reinstall --no-deps {name}=={version}"


@dataclass(frozen=True)
class Distribution:
    name: str  # canonical name, e.g. "sglang", "flashinfer-python"
    version: str
    site: Path  # the directory that holds the .dist-info (and our ledger)
    dist_info: Path

    @cached_property
    def editable_root(self) -> Path | None:
        """The source tree of an editable install (PEP 610 direct_url.json), else None."""
        try:
            info = shallow_json.loads((self.dist_info / "direct_url.json").read_bytes())
        except (OSError, ValueError):  # (nested too deep is a ValueError too: a damaged file)
            return None
        dir_info = info.get("dir_info") if isinstance(info, dict) else None  # (any other shape: damaged)
        if not (isinstance(dir_info, dict) and dir_info.get("editable") and isinstance(info.get("url"), str)):
            return None
        url = urlparse(info["url"])
        return Path(unquote(url.path)) if url.scheme == "file" else None

    @cached_property
    def _record(self) -> tuple[str, bool]:
        """RECORD's text, and whether it was damaged (not UTF-8, as PEP 376 has it): a
        damaged byte elsewhere must not hide the rows sm120kit needs."""
        try:
            raw = (self.dist_info / "RECORD").read_bytes()
        except OSError:
            return "", False
        try:
            return "\n" + raw.decode("utf-8"), False
        except UnicodeDecodeError:
            return "\n" + raw.decode("utf-8", "replace"), True

    @property
    def record_damaged(self) -> bool:
        return self._record[1]

    def recorded_sha256(self, relpath: str) -> str | None:
        """The sha256 (hex) that RECORD gives for `relpath`, or None (not listed, no hash).
        Finds the one row instead of parsing all of them (0.5.23's RECORD has 6,400)."""
        text = self._record[0]
        for needle in (f"\n{relpath},", f'\n"{relpath}",'):
            start = text.find(needle)
            if start >= 0:
                end = text.find("\n", start + 1)
                row = next(csv.reader([text[start + 1 : end if end >= 0 else None]]))
                return _record_hex(row[1]) if len(row) >= 2 else None
        return None

    def file(self, relpath: str) -> Path:
        """Where `relpath` (e.g. "sglang/srt/x.py") lives: the site dir, or for an editable
        install the source tree (its root, src/ or python/ as sglang's repository has it)."""
        root = self.editable_root
        if root is None:
            return self.site / relpath
        top = relpath.split("/", 1)[0]
        for candidate in (root, root / "src", root / "python"):
            if (candidate / top).is_dir():
                return candidate / relpath
        return root / relpath

    def key(self, relpath: str) -> str:
        return f"{self.name}:{relpath}"


def _read_distribution(dist_info: Path) -> Distribution | None:
    """Name and Version from METADATA's header (core metadata: one line each)."""
    fields: dict[str, str] = {}
    try:
        with open(dist_info / "METADATA", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                if sep and key in ("Name", "Version"):
                    fields.setdefault(key, value.strip())
    except OSError:
        return None
    if "Name" not in fields or "Version" not in fields:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        Version(fields["Version"])
    except InvalidVersion:
        name = canonicalize_name(fields["Name"])
        raise UserError(
            f"{dist_info / 'METADATA'}: {name}'s version {fields['Version']!r} is not a PEP 440 version: "
            "the installation is damaged",
            f"reinstall it: pip install --force-reinstall --no-deps {name}",
        ) from None
    return Distribution(canonicalize_name(fields["Name"]), fields["Version"], dist_info.parent, dist_info)


@dataclass
class Target:
    description: str
    site_dirs: list[Path]
    _found: dict[str, Distribution | None] = field(default_factory=dict)

    def find(self, package: str) -> Distribution | None:
        """The installed distribution that the interpreter would import (first on the path)."""
        want = canonicalize_name(package)
        if want not in self._found:
            self._found[want] = None
            prefix = want.replace("-", "_")
            for site in self.site_dirs:
                for dist_info in sorted(site.glob("*.dist-info")):
                    stem = dist_info.name[: -len(".dist-info")]
                    if canonicalize_name(stem.split("-", 1)[0]) != canonicalize_name(prefix):
                        continue
                    if dist := _read_distribution(dist_info):
                        self._found[want] = dist
                        break
                if self._found[want]:
                    break
        return self._found[want]

    def as_json(self) -> dict:
        return {"description": self.description, "site_dirs": [str(p) for p in self.site_dirs]}


def _unique_dirs(paths: list[str]) -> list[Path]:
    seen, dirs = set(), []
    for raw in paths:
        if not raw:
            continue
        p = Path(raw).resolve()
        if p not in seen and p.is_dir() and ("site-packages" in p.parts[-1] or "dist-packages" in p.parts[-1]):
            seen.add(p)
            dirs.append(p)
    return dirs


PYTHON_TIMEOUT_S = 60.0


def _executable(python: str) -> str:
    """--python's program: a name with a slash is a path (a relative one made absolute, so
    that messages say which file); a bare name is looked up on PATH as a shell would, and,
    when PATH has no such program, taken as a file in the current directory if one is there."""
    import os
    import shutil

    if os.sep in python or python.startswith("~"):
        return str(Path(python).expanduser().absolute())
    if shutil.which(python) is None and Path(python).exists():
        return str(Path(python).absolute())
    return python


def _ask_site_dirs(python: str) -> list[str]:
    """Ask `python` where its packages live. It runs in a session of its own, so that a
    wrapper that hangs is stopped with everything it started."""
    import os

    from sm120kit import child_process  # here: most commands never start a child

    hint = "pass the python executable of the environment, e.g. --python /opt/venv/bin/python"
    exe = _executable(python)
    shown = python if exe == python else f"{python} ({exe})"
    path = Path(exe)
    if path.is_absolute() and path.exists() and (path.is_dir() or not os.access(path, os.X_OK)):
        what = "a directory" if path.is_dir() else "a file without execute permission"
        raise UserError(f"--python {shown}: not an executable python ({what})", hint)
    try:
        done = child_process.run([exe, "-c", _SITE_QUERY], deadline_s=PYTHON_TIMEOUT_S)
    except OSError as exc:
        where = " on PATH or in the current directory" if not Path(exe).is_absolute() else ""
        raise UserError(f"--python {shown}: cannot run it ({exc.strerror or exc}{where})", hint) from None
    if done.hung:
        raise UserError(
            f"--python {shown}: no answer within {PYTHON_TIMEOUT_S:g} s; it was stopped, with what it started", hint
        )
    if done.returncode:
        said = f"exit {done.returncode}: {(done.stderr_tail() or ['no message'])[-1]}"
        raise UserError(f"--python {shown}: could not ask that interpreter for its site directories ({said})", hint)
    out = done.stdout
    try:
        paths = shallow_json.loads(out)  # (a wrapper's answer nested 100,000 deep is not a RecursionError)
    except ValueError:
        paths = None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        said = repr(out.strip().splitlines()[0][:80]) if out.strip() else "nothing"
        raise UserError(
            f"--python {shown}: did not answer as a Python interpreter would "
            f"(asked for its site directories, it printed {said}): it is not the environment's python",
            "give the environment's python, e.g. --python /opt/venv/bin/python",
        )
    return paths


def resolve_target(python: str | None = None, site: str | None = None) -> Target:
    """--site DIR, --python EXE, or (default) this interpreter."""
    if python and site:
        raise UserError("--python and --site name two different targets", "give one of them")
    if site:
        path_limits.check("--site", site)
        path = Path(site).expanduser()
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "no such directory"
            raise UserError(f"--site {site}: {what}", "point --site at a site-packages directory")
        return Target(f"site {path.resolve()}", [path.resolve()])
    if python:
        path_limits.check("--python", python)
        return Target(f"python {_executable(python)}", _unique_dirs(_ask_site_dirs(python)))
    paths = sysconfig.get_paths()
    return Target(f"python {sys.executable}", _unique_dirs([paths["purelib"], paths["platlib"], *sys.path]))
