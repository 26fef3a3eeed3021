"""Finds the patches: the user's directories first (--patch-dir, then $SM120KIT_PATCH_PATH),
then the shipped set. Nothing is loaded from anywhere else.

A patch is a module `<dir>/<package>/<name>.py` that defines `PATCH = Patch(...)`.
A user patch with the id of a shipped one replaces it (so a fix can be tried before a
release), and the listing says where each patch came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import shlex
import sys
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120kit import search_paths
from sm120kit.errors import UserError
from sm120kit.patching.spec import Patch

ENV_VAR = "SM120KIT_PATCH_PATH"


def shipped_dir() -> Path:
    return search_paths.shipped("patches")


def search_path(patch_dirs: list[str] | None = None) -> list[Path]:
    return search_paths.search_path("patches", "--patch-dir", ENV_VAR, patch_dirs, shipped_dir())


def _load_module(path: Path) -> Patch:
    name = "sm120kit_patch_" + "_".join(path.with_suffix("").parts[-2:]).replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    try:
        if spec is None or spec.loader is None:  # (a .py file always has both)
            raise ImportError(f"no loader for {path.name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and libcst need the module registered
        spec.loader.exec_module(module)
    except BaseException as exc:  # a broken user patch is bad input, not a crash
        # BaseException too: a module that calls sys.exit(0) or raises KeyboardInterrupt at
        # import would otherwise end the whole run, `patch --verify` exiting 0 with nothing done.
        sys.modules.pop(name, None)
        if isinstance(exc, SystemExit):
            said = f"it calls sys.exit({exc.code!r}) at import"
        else:
            said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise UserError(
            f"{path}: the patch module failed to load ({said})",
            "fix the module or remove its directory from --patch-dir / $" + ENV_VAR,
        ) from None
    patch = getattr(module, "PATCH", None)
    if not isinstance(patch, Patch):
        raise UserError(f"{path}: defines no PATCH = Patch(...)", "see patches/sglang/ for the shape")
    if path.parent.name != patch.package:
        raise UserError(
            f"{path}: PATCH.package is {patch.package!r} but the file is under {path.parent.name}/",
            f"move it to {path.parent.parent / patch.package}/",
        )
    _check_releases(path, patch)
    for rewrite in patch.rewrites:
        if rewrite.upper is None:  # past it, sm120kit could not tell "unproven" from "not applicable"
            raise UserError(
                f"{path}: the rewrite of {rewrite.path} ({rewrite.versions!r}) names no last release it was proven on",
                "end its range with <=X, X the newest release the rewrite was tested on",
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return dataclasses.replace(patch, source=str(path), source_sha256=digest)


def _check_releases(path: Path, patch: Patch) -> None:
    """Each range and fixed_in as PEP 440 reads them: read later, a bad one would end
    `patches`, `status` and `patch` in InvalidSpecifier instead of naming the file."""
    recheck = f"then: sm120kit patches --patch-dir {shlex.quote(str(path.parent.parent))}"
    for rewrite in patch.rewrites:
        try:
            SpecifierSet(rewrite.versions)
        except (InvalidSpecifier, TypeError, AttributeError):  # (the latter two: not a string)
            raise UserError(
                f"{path}: the rewrite of {rewrite.path} has versions {rewrite.versions!r}, not a PEP 440 range",
                f'write the releases it was proven on, e.g. ">=0.5.9,<=0.5.23"; {recheck}',
            ) from None
    fixed = [("PATCH.fixed_in", patch.fixed_in)]
    fixed += [(f"the fixed_in of the rewrite of {r.path}", r.fixed_in) for r in patch.rewrites]
    for what, release in fixed:
        try:
            if release is not None:
                Version(release)
        except (InvalidVersion, TypeError):
            raise UserError(
                f"{path}: {what} is {release!r}, not a release",
                f'give the upstream release that carries the fix, e.g. "0.5.24"; {recheck}',
            ) from None


def _modules(directory: Path) -> list[Path]:
    """<directory>/<package>/<name>.py. A package directory this user cannot search is
    refused: the glob would pass over it, and over its patches, without a word."""
    for package_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        if found := search_paths.unsearchable(package_dir):
            why, hint = found
            raise UserError(f"patch directory {package_dir} {why}", hint)
    return sorted(directory.glob("*/*.py"))


def load_patches(patch_dirs: list[str] | None = None) -> list[Patch]:
    """All patches, first directory wins for an id; ordered by package, then id."""
    found: dict[str, Patch] = {}
    for directory in search_path(patch_dirs):
        for path in _modules(directory):
            if path.name.startswith("_"):
                continue
            patch = _load_module(path)
            found.setdefault(patch.id, patch)
    return sorted(found.values(), key=lambda p: (p.package, p.id))


def select(patches: list[Patch], only: list[str] | None, flag: str = "") -> list[Patch]:
    if not only:
        return patches
    known = {p.id: p for p in patches}
    unknown = [i for i in only if i not in known]
    if unknown:
        nearest = {i: difflib.get_close_matches(i, list(known), n=1) for i in unknown}
        said = [repr(i) + (f" (nearest: {nearest[i][0]})" if nearest[i] else "") for i in unknown]
        # every id only where one has no near spelling: a typo needs its fix, not the whole list
        listing = "" if all(nearest.values()) else f"; known: {', '.join(known) or 'none'}"
        raise UserError(
            f"{flag + ': ' if flag else ''}unknown patch id {', '.join(said)}{listing}",
            "run `sm120kit patches` to list them",
        )
    return [known[i] for i in only]
