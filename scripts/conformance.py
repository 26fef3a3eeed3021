#!/usr/bin/env python3
"""Conformance of the shipped patches and profiles on real sglang and flashinfer-python releases.

For each sglang release (the newest on the package index by default), with the
flashinfer-python release it pins, and for each flashinfer-python release named on its own
(`--flashinfer`: what `pip install -U flashinfer-python` past sglang's pin gives): fetch the
wheels (cached), unpack their Python sources into a scratch site, then run what an operator
runs after the upgrade (a flashinfer release alone: its patches only, no profiles):

    sm120kit status            the outcome of every patch, before anything is written
    sm120kit patch --verify    apply, then prove it from disk
    sm120kit patch             again: nothing changes (idempotence), --check exits 0
    sm120kit unpatch           every file back to the bytes the wheel's RECORD names
    sm120kit profile check     every shipped profile renders for that release

and write a Markdown report: a release x patch table of outcomes, the lifecycle, and the
profile renders. Exit 0 when every cell is settled and proven; 1 when any cell is an
error or unproven (a release past a patch's proven window), or a step failed; 2 on bad
input (a release that does not exist, no network).

    python scripts/conformance.py                      # the newest sglang release
    python scripts/conformance.py 0.5.22 0.5.23        # named sglang releases
    python scripts/conformance.py --flashinfer 0.7.4   # named flashinfer-python releases (alone)
    python scripts/conformance.py --window             # every release the tests prove, of both
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import datetime as dt
import hashlib
import io
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120kit import __version__, wheels
from sm120kit.cli import main as sm120kit
from sm120kit.patching.registry import load_patches
from sm120kit.profiles.loader import list_profiles, load_profile

FLASHINFER_PAST_PINS = wheels.FLASHINFER_PAST_PINS  # --window checks them alone
SOURCES = ["*.py"]  # the code the patches and the flag schema are read from (plus the dist-info)
SETTLED = {"applied", "already-applied", "fixed-upstream", "not-applicable", "would-apply"}


@dataclass
class Release:
    sglang: str | None  # None: a flashinfer-python release on its own
    flashinfer: str | None
    cells: dict[str, list[dict]] = field(default_factory=dict)  # patch id -> its status rows
    steps: dict[str, str] = field(default_factory=dict)  # lifecycle step -> "ok" or what failed
    profiles: dict[str, str] = field(default_factory=dict)  # profile -> "ok ...", "n/a ..." or "error: ..."

    @property
    def name(self) -> str:
        return f"sglang {self.sglang}" if self.sglang else f"flashinfer-python {self.flashinfer}"

    @property
    def packages(self) -> set[str]:
        """The distributions installed for it: the patches of the others are not run."""
        return {"sglang", "flashinfer-python"} if self.sglang else {"flashinfer-python"}

    @property
    def failures(self) -> list[str]:
        bad = [f"{pid}: {_cell(rows)}" for pid, rows in self.cells.items() if not _cell_ok(rows)]
        bad += [f"{step}: {text}" for step, text in self.steps.items() if text != "ok"]
        return bad + [
            f"profile {name}: {text}" for name, text in self.profiles.items() if not text.startswith(("ok", "n/a"))
        ]


def _cell_ok(rows: list[dict]) -> bool:
    return all(r["outcome"] in SETTLED and not r["error"] and r["proven"] for r in rows)


def _cell(rows: list[dict]) -> str:
    """The distinct outcomes of a patch's rows, e.g. "would-apply, fixed-upstream ×2"."""
    counts: dict[str, int] = {}
    for r in rows:
        label = r["outcome"] + ("" if r["proven"] else " (unproven)")
        counts[label] = counts.get(label, 0) + 1
    text = ", ".join(label + (f" ×{n}" if n > 1 else "") for label, n in counts.items())
    return text if _cell_ok(rows) else f"**{text}**"


def run_cli(*argv) -> tuple[int, dict]:
    """sm120kit in-process with --json: (exit code, document)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = sm120kit([*map(str, argv), "--json"])
    text = out.getvalue()
    return code, json.loads(text) if text.strip() else {}


def record_sha256(site: Path, package: str, relpath: str) -> str | None:
    [dist_info] = site.glob(f"{package.replace('-', '_')}-*.dist-info")
    for row in csv.reader((dist_info / "RECORD").read_text().splitlines()):
        if row and row[0] == relpath and row[1].startswith("sha256="):
            return base64.urlsafe_b64decode(row[1][7:] + "==").hex()
    return None


def check_release(release: Release, site: Path, profiles: list[str]) -> None:
    # A flashinfer release alone: its patches, each by id (sglang's would be not-applicable).
    only = (
        []
        if release.sglang
        else [arg for p in load_patches() if p.package in release.packages for arg in ("--only", p.id)]
    )
    # The scratch site's patches and unpatches must not remove the machine's flashinfer JIT cache.
    keep = "--keep-jit-cache"
    code, doc = run_cli("status", "--site", site, *only)
    for r in doc.get("results", []):
        release.cells.setdefault(r["patch"], []).append(r)
    release.steps["status"] = "ok" if code in (0, 1) else f"exit {code}: {doc.get('error', '')}"

    code, doc = run_cli("patch", "--verify", "--site", site, keep, *only)
    problems = doc.get("verify_problems") or [doc.get("error")] if code else []
    release.steps["patch --verify"] = (
        "ok" if code == 0 and doc.get("verified") else f"exit {code}: {'; '.join(filter(None, problems))}"
    )

    patched = {r["path"]: (site / r["path"]).read_bytes() for r in doc.get("results", []) if r["outcome"] == "applied"}
    code, doc = run_cli("patch", "--site", site, keep, *only)
    again = {r["outcome"] for r in doc.get("results", [])}
    same = all((site / path).read_bytes() == data for path, data in patched.items())
    check, _ = run_cli("patch", "--check", "--site", site, *only)
    idempotent = code == 0 and check == 0 and same and "applied" not in again
    release.steps["idempotent"] = (
        "ok" if idempotent else f"second run: exit {code}, {sorted(again)}; --check exit {check}"
    )

    code, doc = run_cli("unpatch", "--site", site, keep, *only)
    wrong = [
        r["path"]
        for r in doc.get("results", [])
        if hashlib.sha256((site / r["path"]).read_bytes()).hexdigest() != record_sha256(site, r["package"], r["path"])
    ]
    left = list(site.glob(".sm120kit/backups/*"))
    restored = code == 0 and not wrong and not left
    release.steps["unpatch = RECORD"] = (
        "ok" if restored else f"exit {code}; differ from RECORD: {wrong}; backups left: {len(left)}"
    )

    for name in profiles if release.sglang else []:  # a profile serves sglang
        floors = [x.version for x in SpecifierSet(load_profile(name).sglang or "") if x.operator == ">="]
        if any(Version(release.sglang) < Version(f) for f in floors):  # below its proven range: refused, by design
            release.profiles[name] = f"n/a (needs sglang >={max(floors, key=Version)})"
            continue
        # after unpatch: whether the profile renders for the release, not whether it is patched
        code, doc = run_cli("profile", "check", name, "--site", site, "--no-patch-check")
        if code == 0:
            warnings = len(doc.get("warnings", []))
            argv = doc["argv"] if "argv" in doc else doc["replicas"][0]["argv"]  # a fleet: a replica's
            release.profiles[name] = f"ok ({len(argv) - 3} args" + (f", {warnings} warning(s))" if warnings else ")")
        else:
            release.profiles[name] = f"error: {doc.get('error', f'exit {code}')}"


def install(release: Release, site: Path, members: list[str] | None) -> None:
    if release.flashinfer:
        wheels.install(site, "flashinfer-python", release.flashinfer, members)
    if release.sglang:
        wheels.install(site, "sglang", release.sglang, members)


def report(releases: list[Release], patch_ids: list[str], profiles: list[str]) -> str:
    today = dt.date.today().isoformat()
    package = {p.id: p.package for p in load_patches()}
    sglang = [r.sglang for r in releases if r.sglang]
    alone = [r.flashinfer for r in releases if not r.sglang]
    scope = [f"sglang {', '.join(sglang)}, each with the flashinfer-python release it pins"] if sglang else []
    scope += [f"flashinfer-python {', '.join(alone)} on their own (their patches only)"] if alone else []
    lines = [
        f"# sm120kit conformance, {today}",
        "",
        f"sm120kit {__version__}; {len(patch_ids)} shipped patches; {'; '.join(scope) or 'no release'}. "
        "Cells: the outcome of `sm120kit status` before patching; **bold** is an error or unproven; "
        "- is a patch of a package not installed.",
        "",
        "## Patch outcomes",
        "",
        "| sglang | flashinfer | " + " | ".join(f"`{p}`" for p in patch_ids) + " |",
        "|---|---|" + "---|" * len(patch_ids),
    ]

    def row(r: Release) -> str:
        return f"| {r.sglang or '-'} | {r.flashinfer or '-'} | "

    def cell(r: Release, patch_id: str) -> str:
        if patch_id in r.cells:
            return _cell(r.cells[patch_id])
        return "-" if package.get(patch_id) not in r.packages else "**missing**"

    lines += [row(r) + " | ".join(cell(r, p) for p in patch_ids) + " |" for r in releases]
    steps = list(releases[0].steps) if releases else []
    lines += [
        "",
        "## Lifecycle",
        "",
        "| sglang | flashinfer | " + " | ".join(f"`{s}`" for s in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    lines += [row(r) + " | ".join(r.steps.get(s, "-") for s in steps) + " |" for r in releases]
    lines += [
        "",
        "## Profiles (`sm120kit profile check`)",
        "",
        "| sglang | " + " | ".join(profiles) + " |",
        "|---|" + "---|" * len(profiles),
    ]
    # A profile serves sglang: a flashinfer release alone renders none.
    lines += [
        f"| {r.sglang} | " + " | ".join(r.profiles.get(p, "-") for p in profiles) + " |" for r in releases if r.sglang
    ]
    failures = [(r.name, f) for r in releases for f in r.failures]
    lines += ["", "## Verdict", ""]
    lines += [f"- {name}: {f}" for name, f in failures] or ["Every cell is settled and proven."]
    return "\n".join(lines) + "\n"


def release_numbers(names: list[str], what: str, example: str) -> list[str]:
    for text in names:
        try:
            Version(text)
        except InvalidVersion:
            raise wheels.FetchError(f"{what}{text!r} is not a release number (e.g. {example})") from None
    return names


def resolve_releases(args) -> list[Release]:
    """The sglang releases (each with its pin), then the flashinfer-python releases alone;
    every name is checked before anything is fetched."""
    flashinfer = release_numbers(args.flashinfer, "--flashinfer ", FLASHINFER_PAST_PINS[-1])
    sglang = release_numbers(args.releases, "", wheels.SGLANG_WINDOW[-1])
    if args.window:
        sglang = list(wheels.SGLANG_WINDOW)
        flashinfer = [*FLASHINFER_PAST_PINS, *(v for v in flashinfer if v not in FLASHINFER_PAST_PINS)]
    elif args.latest or not (sglang or flashinfer):
        sglang = [wheels.latest("sglang")]
    return [Release(v, wheels.flashinfer_pin(v)) for v in sglang] + [Release(None, v) for v in flashinfer]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("releases", nargs="*", metavar="RELEASE", help="sglang releases (default: --latest)")
    parser.add_argument(
        "--flashinfer",
        nargs="+",
        default=[],
        metavar="RELEASE",
        help="flashinfer-python releases, each checked on its own (its patches only)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--latest", action="store_true", help="the newest sglang release on the package index (the default)"
    )
    group.add_argument(
        "--window",
        action="store_true",
        help="every sglang release in the proven window (sm120kit/wheels.py), and the flashinfer-python "
        "releases proven past its pins",
    )
    parser.add_argument(
        "--report", type=Path, default=Path("sm120kit-conformance.md"), help="where the Markdown report goes"
    )
    parser.add_argument(
        "--patched-files-only", action="store_true", help="unpack only the files the patches and profiles read (faster)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch sites (printed)")
    args = parser.parse_args(argv)
    if args.releases and (args.latest or args.window):
        parser.error("name sglang releases, or --latest, or --window")

    patch_ids = [p.id for p in load_patches()]
    # A base profile (no model: a node to extend) is not served on its own.
    profiles = [name for name, _, _ in list_profiles(None) if load_profile(name).model.path]
    members = (
        sorted({r.path for p in load_patches() for r in p.rewrites}) + wheels.SCHEMA_SOURCES
        if args.patched_files_only
        else SOURCES
    )
    scratch = Path(tempfile.mkdtemp(prefix="sm120kit-conformance-"))
    releases: list[Release] = []
    try:
        for release in resolve_releases(args):
            site = scratch / release.name.replace(" ", "-") / "site-packages"
            install(release, site, members)
            check_release(release, site, profiles)
            releases.append(release)
            pinned = f" (flashinfer {release.flashinfer})" if release.sglang else ""
            print(
                f"{release.name}{pinned}: " + ("ok" if not release.failures else f"{len(release.failures)} problem(s)")
            )
    except wheels.FetchError as exc:
        print(f"conformance: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"scratch sites kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    args.report.write_text(report(releases, patch_ids, profiles))
    failures = [f for r in releases for f in r.failures]
    print(
        f"report: {args.report}"
        + (f" ({len(failures)} problem(s))" if failures else " (every cell settled and proven)")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
