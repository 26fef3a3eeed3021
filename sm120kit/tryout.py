"""`sm120kit try`: the whole patch cycle on real sglang releases, on any machine.

In a scratch directory: the proven release before the one tried, with the flashinfer-python
it pins, unpacked from the real wheels; `status`, `patch --diff`, `patch --verify`; then the
upgrade to the release tried, done as pip does it (the old files out by RECORD, the new
wheel in), which puts the vendor's bytes back over every patched file; `status` (the
patches lost), `patch --verify` (re-applied), `unpatch` (the vendor's bytes), and a
profile's rendered command. Every command is the real one, run in-process with `--site`
through the entry point the caller passes in (sm120kit.cli.main: tryout sits below the cli);
each step's result is checked against what the cycle expects, from the JSON documents the
commands print and from the bytes on disk (compared with the wheels and RECORD here, not
by the engine under test). The cycle stops at the first step that does not do what it should.

Only the files the patches touch and those the flag schema is read from are unpacked: what
the commands read (RECORD still lists every file), and it keeps the whole run to seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit import report, wheels
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode

PROFILE = "glm5-nvfp4"
SGLANG, FLASHINFER = "sglang", "flashinfer-python"
SHOWN_LINES = 40  # of each command's output in the transcript; the rest is counted


class Unexpected(Exception):
    """A step's result is not what the cycle expects; the message says what happened."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a command the cycle ran (the command itself returned 130)."""


@dataclass
class Step:
    name: str
    command: str  # as a user would type it, with $SITE for the scratch site
    stands_in: str | None = None  # the step is not `command` but does what it would: how (pip is never run)
    exit_code: int | None = None
    proven: str | None = None  # the summary line, when the step did what it should
    problem: str | None = None  # what happened instead

    @property
    def ok(self) -> bool:
        return self.proven is not None

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "command": self.command,
            "stands_in": self.stands_in,
            "exit_code": self.exit_code,
            "ok": self.ok,
            "proven": self.proven,
            "problem": self.problem,
        }


@dataclass
class Wheel:
    package: str
    version: str
    path: Path
    downloaded: bool

    def as_json(self) -> dict:
        return {"package": self.package, "version": self.version, "path": str(self.path), "downloaded": self.downloaded}


@dataclass
class Cycle:
    """What `sm120kit try` did and proved."""

    old: dict[str, str]  # package -> release, before the upgrade
    new: dict[str, str]  # and after it
    wheels: list[Wheel] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    patched: list[dict] = field(default_factory=list)  # {"patch", "package", "path"} applied on the old releases
    lost: list[str] = field(default_factory=list)  # patched files that the upgrade gave the vendor's bytes again
    reapplied: list[str] = field(default_factory=list)  # of those, patched again by --verify
    not_needed: list[str] = field(default_factory=list)  # of those, fixed upstream (or not applicable) now
    restored: list[str] = field(default_factory=list)  # unpatch: byte-identical to the wheel and RECORD
    arguments: int | None = None  # the profile's rendered sglang arguments
    scratch: Path | None = None  # kept (--keep)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps) and not self.not_run

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if self.ok else ExitCode.FINDINGS

    def as_json(self) -> dict:
        return {
            "command": "try",
            "ok": self.ok,
            "from": self.old,
            "to": self.new,
            "wheels": [w.as_json() for w in self.wheels],
            "steps": [s.as_json() for s in self.steps],
            "not_run": self.not_run,
            "patched": self.patched,
            "lost": self.lost,
            "reapplied": self.reapplied,
            "not_needed": self.not_needed,
            "restored": self.restored,
            "profile": {"name": PROFILE, "sglang": self.new[SGLANG], "arguments": self.arguments},
            "scratch": str(self.scratch) if self.scratch else None,
            "seconds": round(self.seconds, 2),
            "exit_code": int(self.exit_code),
        }

    def summary(self) -> str:
        """One screen: what was proven, step by step, and the verdict."""
        lines = [f"sm120kit try: the cycle on real release wheels, no GPU, no installed sglang ({self.seconds:.1f} s)"]
        lines += [f"  ok      {s.proven}" if s.ok else f"  FAILED  {s.name}: {s.problem}" for s in self.steps]
        if self.not_run:
            lines.append(f"  not run: {', '.join(self.not_run)}")
        if self.ok:
            lines.append("every step did what the cycle expects.")
            lines.append("next, on the GPU node (and after every `pip install -U sglang`): sm120kit patch --verify")
        else:
            failed = next(s for s in self.steps if not s.ok)
            at = f"the step in place of `{failed.command}`" if failed.stands_in else f"`{failed.command}`"
            lines.append(f"the cycle stopped at {at}: that step did not do what it should.")
        if self.scratch:
            lines.append(f"scratch site kept: SITE={self.scratch / 'site-packages'}")
        return "\n".join(lines)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('ch') else 's'}"


def _pair(versions: dict[str, str]) -> str:
    return " + ".join(f"{package} {version}" for package, version in versions.items())


def releases() -> tuple[str, ...]:
    """The releases `try` can end on: every proven one that has a proven one before it."""
    return wheels.SGLANG_WINDOW[1:]


def _toolkit_rules() -> list[str]:
    """The launch rules on this machine's CUDA toolkit: the cycle runs on any machine, whose
    nvcc is not the profile's business here (allowed, they are said as warnings)."""
    from sm120kit.catalogue.survey import load_survey

    return [f.id for f in load_survey().failures if f.rule and any(c.nvcc for c in f.rule.when)]


def resolve_release(text: str | None) -> tuple[str, str]:
    """(the release to start on, the one to upgrade to) for --release TEXT (default: the
    newest proven). Anything else is refused with the window named."""
    from packaging.version import InvalidVersion, Version

    window = wheels.SGLANG_WINDOW
    if text is None:
        return window[-2], window[-1]
    span = f"{window[0]}–{window[-1]}"
    try:
        wanted = Version(text)
    except InvalidVersion:
        wanted = None
    index = next((i for i, v in enumerate(window) if wanted is not None and Version(v) == wanted), None)
    if index is None:
        raise UserError(
            f"--release {text}: not a release sm120kit is proven on (sglang {span})",
            f"choose one of {', '.join(releases())}, or leave --release out for {window[-1]}",
        )
    if index == 0:
        raise UserError(
            f"--release {text}: the cycle upgrades to it from the proven release before it, "
            f"and {window[0]} is the first of the window ({span})",
            f"choose one of {releases()[0]} … {releases()[-1]}",
        )
    return window[index - 1], window[index]


def fetch_release_wheels(old: str, new: str, note: Callable[[str], None]) -> tuple[dict, dict, list[Wheel]]:
    """Both sglang releases and the flashinfer-python each pins: from the cache, or
    downloaded into it. Offline and not cached: a UserError naming the wheel and what to do."""
    got: list[Wheel] = []
    trying = ""

    def wheel(package: str, version: str) -> Path:
        nonlocal trying
        trying = f"{package}=={version}"
        if hit := wheels.cached(package, version):
            path, downloaded = hit, False
        else:
            note(f"downloading {package}=={version} into {wheels.cache_dir()} …")
            path, downloaded = wheels.fetch(package, version), True
        if all(w.path != path for w in got):
            got.append(Wheel(package, version, path, downloaded))
        return path

    try:
        sides = []
        for version in (old, new):
            wheel(SGLANG, version)
            pin = wheels.flashinfer_pin(version)
            side = {SGLANG: version}
            if pin:
                wheel(FLASHINFER, pin)
                side[FLASHINFER] = pin
            sides.append(side)
    except wheels.FetchError as exc:
        raise UserError(
            f"cannot fetch {trying}, which is not in the wheel cache ({wheels.cache_dir()}): {exc}",
            "on a machine with network, `sm120kit try` downloads the wheels it needs into its wheel cache "
            f"(~/.cache/sm120kit/wheels, or ${wheels.CACHE_ENV}): copy them into {wheels.cache_dir()} here, "
            "then run `sm120kit try` again",
        ) from None
    return sides[0], sides[1], got


@contextlib.contextmanager
def _scratch_env(scratch: Path) -> Iterator[None]:
    """Caches the commands write go into the scratch dir: patching flashinfer removes that
    version's JIT cache, which must never be the machine's own, and nothing is left behind."""
    saved = {name: os.environ.get(name) for name in ("FLASHINFER_WORKSPACE_BASE", "SM120KIT_CACHE_DIR")}
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(scratch / "home")
    os.environ["SM120KIT_CACHE_DIR"] = str(scratch / "cache")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _trim(text: str) -> list[str]:
    """A command's output for the transcript: its first SHOWN_LINES lines or fewer, cut where
    an item ends (never between a table's row and the lines under it), the rest counted.
    Lines are kept whole: the command fitted them, and one wider is a path or a URL."""
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= SHOWN_LINES:
        return lines
    top = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    cut = next((k for k in range(SHOWN_LINES, 0, -1) if _starts_an_item(lines, k, top)), SHOWN_LINES)
    return [*lines[:cut], f"… {len(lines) - cut} more lines"]


def _starts_an_item(lines: list[str], k: int, top: int) -> bool:
    """Whether lines[k] begins an item of the output: it is at the outermost indentation, the
    line above is no table's header (its words all capitals: PATCH PACKAGE ...) and does not
    lead with a word broken at its end (a table's first cell wrapped: `flashinfer-sm120-`
    over `arch-suffix`)."""
    line, above = lines[k], lines[k - 1].split()
    header = bool(above) and all(word.isupper() for word in above)
    broken = bool(above) and above[0].endswith(("-", "/", ",", "–"))
    return len(line) - len(line.lstrip()) == top and not header and not broken


def _stderr(err: str, known: str = "") -> str:
    """The last lines a command wrote to stderr (those not repeating `known`), to add to a problem."""
    lines = [line.strip() for line in err.splitlines() if line.strip() and not (known and known in line)]
    return f"; stderr: {' | '.join(lines[-3:])}" if lines else ""


class _Runner:
    """Runs the steps: each command in-process, its output echoed (indented, trimmed)."""

    def __init__(
        self,
        cycle: Cycle,
        site: Path,
        main: Callable[[list[str]], int],
        echo: Callable[[str], None] | None,
        debug: bool,
        width: int | None = None,
    ) -> None:
        self.cycle, self.site, self.main, self.echo, self.debug = cycle, site, main, echo, debug
        # The commands print fitted to the transcript's width less the 4 columns they are indented by.
        self.outer = width or report.NOT_A_TERMINAL
        self.width = max(self.outer - 4, report.NARROWEST)

    def show(self, command: str, output: str, stands_in: str | None = None) -> None:
        """A command run (`$ command`), or a step that does what `command` would without
        running it (a `#` line that says so), then the output, indented."""
        if self.echo:
            head = f"# in place of `{command}` (not run): {stands_in}" if stands_in else f"$ {command}"
            self.echo("\n" + report.wrap(head, self.outer, hanging="    "))
            for line in _trim(output):
                self.echo(f"    {line}")

    def cli(self, *argv: str, as_json: bool = False) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); without as_json, stderr is in stdout as on a terminal."""
        argv = (*argv, "--site", str(self.site), *(["--json"] if as_json else []), *(["--debug"] if self.debug else []))
        out, err = io.StringIO(), io.StringIO()
        with (
            report.fitted_to(self.width),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out if not as_json else err),
        ):
            code = self.main(list(argv))
        if code == ExitCode.INTERRUPTED:
            raise Interrupted
        return code, out.getvalue(), err.getvalue()

    def command(self, step: Step, *argv: str) -> tuple[int, str]:
        """The step's command as a user runs it (echoed); its exit code is the step's."""
        code, text, _ = self.cli(*argv)
        step.exit_code = code
        self.show(step.command, text)
        return code, text

    def doc(self, *argv: str) -> dict:
        """A read-only command's JSON document: the facts a step is checked on. A command that
        printed none, or answered with an error document, fails the step with what it said."""
        code, text, err = self.cli(*argv, as_json=True)
        shown = f"`sm120kit {' '.join(argv)} --json`"
        try:
            document = json.loads(text)
        except ValueError:
            raise Unexpected(f"{shown} printed no JSON document (exit {code})" + _stderr(err)) from None
        if isinstance(document, dict) and "error" in document:
            error = document["error"]
            raise Unexpected(f"{shown} answered with an error (exit {code}): {error}" + _stderr(err, error))
        return document

    def rows(self) -> dict[tuple[str, str], dict]:
        """(patch, path) -> `status`'s row for it."""
        return {(r["patch"], r["path"]): r for r in self.doc("status")["results"]}


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise Unexpected(problem)


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _wheel_bytes(cycle: Cycle, package: str, version: str, relpath: str) -> bytes | None:
    wheel = next(w.path for w in cycle.wheels if w.package == package and w.version == version)
    try:
        return wheels.read_member(wheel, relpath)
    except KeyError:  # the release has no such file
        return None


def _members() -> list[str]:
    """What the commands read: the files the patches touch, and the flag schema's sources."""
    from sm120kit.patching.registry import load_patches

    return sorted({r.path for p in load_patches() for r in p.rewrites}) + wheels.SCHEMA_SOURCES


def _install(run: _Runner, step: Step, versions: dict[str, str], upgrade: bool) -> list[str]:
    """pip install (-U): each package whose release changes, old files out by RECORD, the new
    wheel's members in. Returns the packages it replaced."""
    members = _members()
    changed = [p for p, v in versions.items() if not upgrade or run.cycle.old.get(p) != v]
    lines = []
    for package in changed:
        if wheels.uninstall(run.site, package):
            lines.append(f"removed {package} {run.cycle.old[package]}: every file its RECORD lists")
        wheels.unpack(wheels.fetch(package, versions[package]), run.site, members)
        recorded = wheels.recorded_sha256(run.site, package)
        unpacked = sum((run.site / path).is_file() for path in recorded)
        lines.append(f"installed {package} {versions[package]}: {unpacked} of its {len(recorded)} files unpacked")
    lines.append("(the files the patches touch and the flag schema is read from)")
    step.exit_code = 0
    run.show(step.command, "\n".join(lines), step.stands_in)
    return changed


def _step_install(run: _Runner, step: Step) -> str:
    _install(run, step, run.cycle.old, upgrade=False)
    return f"{_pair(run.cycle.old)} installed in a scratch site"


def _step_status(run: _Runner, step: Step) -> str:
    code, _ = run.command(step, "status")
    rows = run.rows()
    errors = [f"{r['patch']}: {r['outcome']}" for r in rows.values() if r["error"]]
    _expect(not errors, f"errors on the installed releases: {'; '.join(errors)}")
    pending = [r for r in rows.values() if r["outcome"] == "would-apply"]
    _expect(bool(pending), "no patch would apply: nothing for the cycle to show")
    _expect(code == ExitCode.FINDINGS, f"exit {code}, expected {int(ExitCode.FINDINGS)} (patches would apply)")
    run.cycle.patched = [{"patch": r["patch"], "package": r["package"], "path": r["path"]} for r in pending]
    fixed = sum(r["outcome"] == "fixed-upstream" for r in rows.values())
    ids = {r["patch"] for r in pending}
    return f"status: {_n(len(ids), 'patch')} would apply ({_n(len(pending), 'file')})" + (
        f"; {_n(fixed, 'part')} fixed upstream" if fixed else ""
    )


def _step_diff(run: _Runner, step: Step) -> str:
    code, text, _ = run.cli("patch", "--diff")
    step.exit_code = code
    stat = diff_stat(text)
    added, removed = sum(a for _, a, _ in stat), sum(r for _, _, r in stat)
    lines = len(text.splitlines())
    shown = [f"the diff ({_n(lines, 'line')}; the command prints it whole), file by file:"]
    shown.append(report.table(["", "", ""], [[path, f"+{a}", f"-{r}"] for path, a, r in stat], run.width, (0,)))
    shown.append(f"{_n(len(stat), 'file')} changed: {_n(added, 'line')} added, {removed} removed")
    run.show(step.command, "\n".join(shown))
    _expect(code == ExitCode.OK, f"exit {code}, expected 0")
    missing = [p["path"] for p in run.cycle.patched if p["path"] not in {path for path, _, _ in stat}]
    _expect(not missing, f"the diff leaves out {', '.join(missing)}")
    return f"patch --diff: the change to {_n(len(stat), 'file')} (+{added} -{removed} lines); nothing written"


def diff_stat(text: str) -> list[tuple[str, int, int]]:
    """(file, lines added, lines removed) of a unified diff, in its order: each hunk read by
    the line counts its @@ header gives, so a changed line that starts with "--" or "++" is
    counted, not taken for a file's header."""
    stat: list[list] = []
    old_left = new_left = 0
    for line in text.splitlines():
        if old_left > 0 or new_left > 0:
            if line.startswith("+"):
                stat[-1][1] += 1
                new_left -= 1
            elif line.startswith("-"):
                stat[-1][2] += 1
                old_left -= 1
            elif not line.startswith("\\"):  # "\ No newline at end of file" counts for neither
                old_left, new_left = old_left - 1, new_left - 1
        elif line.startswith("+++ "):
            path = line[4:].split("\t")[0].strip()
            stat.append([path[2:] if path.startswith("b/") else path, 0, 0])
        elif (hunk := re.match(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", line)) and stat:
            old_left, new_left = int(hunk[1] or 1), int(hunk[2] or 1)
    return [(path, added, removed) for path, added, removed in stat]


def _step_verify(run: _Runner, step: Step) -> str:
    code, _ = run.command(step, "patch", "--verify")
    _expect(code == ExitCode.OK, f"exit {code}, expected 0 (applied and verified)")
    rows = run.rows()
    for p in run.cycle.patched:
        outcome = rows[(p["patch"], p["path"])]["outcome"]
        _expect(outcome == "already-applied", f"{p['patch']} on {p['path']}: status says {outcome} after --verify")
        vendor = _wheel_bytes(run.cycle, p["package"], run.cycle.old[p["package"]], p["path"])
        _expect((run.site / p["path"]).read_bytes() != vendor, f"{p['path']} still holds the wheel's bytes")
    ids = {p["patch"] for p in run.cycle.patched}
    return f"patch --verify: {_n(len(ids), 'patch')} applied and proven in place from disk"


def _step_upgrade(run: _Runner, step: Step) -> str:
    changed = _install(run, step, run.cycle.new, upgrade=True)
    cycle = run.cycle
    for path in sorted({p["path"] for p in cycle.patched if p["package"] in changed}):
        package = next(p["package"] for p in cycle.patched if p["path"] == path)
        now = (run.site / path).read_bytes() if (run.site / path).is_file() else None
        if now == _wheel_bytes(cycle, package, cycle.new[package], path):
            cycle.lost.append(path)
    _expect(bool(cycle.lost), "no patched file was replaced: the upgrade did not do what pip does")
    upgraded = " + ".join(f"{p} {cycle.new[p]}" for p in changed)
    return f"upgrade to {upgraded}: {_n(len(cycle.lost), 'patched file')} wiped (vendor bytes)"


def _step_status_lost(run: _Runner, step: Step) -> str:
    code, _ = run.command(step, "status")
    doc = run.doc("status")
    named = sorted({lost["path"] for lost in doc.get("lost", [])})
    _expect(named == sorted(run.cycle.lost), f"status says {named or 'no file'} lost, the disk says {run.cycle.lost}")
    _expect(code in (ExitCode.OK, ExitCode.FINDINGS), f"exit {code}, expected 0 or 1")
    ids = {lost["patch_id"] for lost in doc["lost"]}
    return f"status: {_n(len(ids), 'patch')} lost in the upgrade ({_n(len(named), 'file')})"


def _step_verify_again(run: _Runner, step: Step) -> str:
    code, _ = run.command(step, "patch", "--verify")
    _expect(code == ExitCode.OK, f"exit {code}, expected 0 (re-applied and verified)")
    cycle, rows = run.cycle, run.rows()
    for path in cycle.lost:
        outcomes = {r["outcome"] for (_, p), r in rows.items() if p == path}
        _expect(not outcomes & {"would-apply"}, f"{path}: a patch would still apply after --verify")
        (cycle.reapplied if "already-applied" in outcomes else cycle.not_needed).append(path)
    shown = f"patch --verify: {len(cycle.reapplied)} of the {_n(len(cycle.lost), 'lost file')} re-applied"
    return shown + (f" ({len(cycle.not_needed)} fixed upstream now)" if cycle.not_needed else "") + " and verified"


def _step_unpatch(run: _Runner, step: Step) -> str:
    cycle, rows = run.cycle, run.rows()
    carrying = sorted({(r["package"], r["path"]) for r in rows.values() if r["outcome"] == "already-applied"})
    code, _ = run.command(step, "unpatch")
    _expect(code == ExitCode.OK, f"exit {code}, expected 0")
    for package, path in carrying:
        version = cycle.new[package]
        _expect(
            (run.site / path).read_bytes() == _wheel_bytes(cycle, package, version, path),
            f"{path} differs from the {package} {version} wheel",
        )
        _expect(
            _sha256(run.site / path) == wheels.recorded_sha256(run.site, package).get(path),
            f"{path}: its sha256 is not the one RECORD gives",
        )
        cycle.restored.append(path)
    backups = list((run.site / ".sm120kit" / "backups").glob("*"))
    _expect(not backups, f"{len(backups)} backup(s) left in {run.site / '.sm120kit' / 'backups'}")
    return f"unpatch: {_n(len(cycle.restored), 'file')} byte-identical to the wheel, sha256 as in its RECORD"


def _step_profile(run: _Runner, step: Step) -> str:
    allowed = [w for failure_id in _toolkit_rules() for w in ("--allow-known-failure", failure_id)]
    # The site was unpatched above: the command prints, and serve would refuse it for that alone.
    code, _ = run.command(step, "serve", PROFILE, "--dry-run", *allowed)
    _expect(code == ExitCode.FINDINGS, f"exit {code}, expected 1 (its patches are not in place after unpatch)")
    doc = run.doc("profile", "check", PROFILE, *allowed)
    argv = doc.get("argv") or []
    _expect(bool(argv), f"`profile check {PROFILE}` rendered no command")
    failed = [c.get("check") for c in doc.get("checks", []) if c.get("status") == "fail"]
    _expect(failed == ["patches"], f"`profile check {PROFILE}`: failed {failed or 'nothing'}, expected patches alone")
    run.cycle.arguments = len(argv) - 3  # after `python -m sglang.launch_server`, as `profile check` counts
    return (
        f"profile {PROFILE} renders for sglang {run.cycle.new[SGLANG]} to {run.cycle.arguments} arguments; "
        "unpatched, serve refuses it"
    )


def _steps(cycle: Cycle) -> list[tuple[Step, Callable[[_Runner, Step], str]]]:
    old, new = cycle.old, cycle.new
    pip = "pip install {}"
    unpacked = "the wheels unpacked into $SITE, as pip unpacks them"
    replaced = "the old releases' files out by their RECORD, the new wheels unpacked into $SITE, as pip does it"
    return [
        (Step("install", pip.format(" ".join(f"{p}=={v}" for p, v in old.items())), unpacked), _step_install),
        (Step("status", "sm120kit status --site $SITE"), _step_status),
        (Step("patch --diff", "sm120kit patch --diff --site $SITE"), _step_diff),
        (Step("patch --verify", "sm120kit patch --verify --site $SITE"), _step_verify),
        (
            Step(
                "upgrade",
                pip.format("-U " + " ".join(f"{p}=={v}" for p, v in new.items() if old.get(p) != v)),
                replaced,
            ),
            _step_upgrade,
        ),
        (Step("status after the upgrade", "sm120kit status --site $SITE"), _step_status_lost),
        (Step("patch --verify after the upgrade", "sm120kit patch --verify --site $SITE"), _step_verify_again),
        (Step("unpatch", "sm120kit unpatch --site $SITE"), _step_unpatch),
        (Step(f"profile {PROFILE}", f"sm120kit serve {PROFILE} --dry-run --site $SITE"), _step_profile),
    ]


def _echo_header(echo: Callable[[str], None], cycle: Cycle, site: Path, width: int | None) -> None:
    lines = [
        "sm120kit try: the patch cycle on real sglang releases, in a scratch site",
        f"    on {_pair(cycle.old)}, then the upgrade to {_pair(cycle.new)}",
        f"wheels (cache: {wheels.cache_dir()}):",
        *(
            f"    {w.package} {w.version}: {'downloaded' if w.downloaded else 'cached'}, {w.path.name}"
            for w in cycle.wheels
        ),
        f"scratch site: SITE={site}",
    ]
    for line in lines:
        echo(report.wrap(line, width))


def _run_steps(runner: _Runner) -> None:
    """Every step in turn, up to the first that does not do what the cycle expects."""
    steps = _steps(runner.cycle)
    for i, (step, check) in enumerate(steps):
        runner.cycle.steps.append(step)
        try:
            step.proven = check(runner, step)
        except Unexpected as exc:
            step.problem = str(exc)
            runner.cycle.not_run = [s.name for s, _ in steps[i + 1 :]]
            return


def _make_scratch(parent: Path | None) -> Path:
    """The scratch directory with its empty site-packages, in `parent` (--dir) or the
    system's temp dir. One that cannot be made there is a UserError naming the path."""
    if parent is not None and not parent.is_dir():
        raise UserError(f"--dir {parent}: not a directory", "give a directory that exists, or leave --dir out")
    scratch = None
    try:
        scratch = Path(tempfile.mkdtemp(prefix="sm120kit-try-", dir=parent))
        (scratch / "site-packages").mkdir()
        return scratch
    except OSError as exc:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        where = f"--dir {parent}" if parent is not None else "the system's temp dir ($TMPDIR)"
        raise UserError(
            f"cannot make the scratch directory in {where}: {exc.strerror or exc}",
            "give --dir a directory you can write to" if parent is not None else "set $TMPDIR, or give --dir",
        ) from None


def run(
    main: Callable[[list[str]], int],
    release: str | None = None,
    parent: Path | None = None,
    keep: bool = False,
    echo: Callable[[str], None] | None = print,
    note: Callable[[str], None] = lambda line: None,
    debug: bool = False,
    width: int | None = None,
) -> Cycle:
    """The cycle, ending on `release` (default: the newest proven), each command run by
    `main` (sm120kit.cli.main: argv in, exit code out). `echo` gets the
    transcript line by line (None: silent), fitted to `width` (default: output_width's),
    `note` the download progress. Bad input (the
    release, a --dir that is missing or not writable) is a UserError raised before any
    download; so is a wheel that cannot be fetched, which leaves nothing behind on disk."""
    started = time.monotonic()
    width = width or report.output_width()
    old, new = resolve_release(release)
    scratch = _make_scratch(parent)
    try:
        before, after, fetched = fetch_release_wheels(old, new, note)
    except BaseException:  # no wheels (or Ctrl-C during a download): no scratch dir left behind
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    cycle = Cycle(before, after, fetched)
    site = scratch / "site-packages"
    try:  # from here on the scratch dir goes, whatever happens (a reader gone at the header too)
        if echo:
            _echo_header(echo, cycle, site, width)
        with _scratch_env(scratch):
            _run_steps(_Runner(cycle, site, main, echo, debug, width))
    finally:
        if keep:
            cycle.scratch = scratch
        else:
            shutil.rmtree(scratch, ignore_errors=True)
        cycle.seconds = time.monotonic() - started
    return cycle
