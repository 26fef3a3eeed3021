"""A search's directory as written and read back (the layout: search.py): the settings
that make two searches' figures comparable, each variant's record (variant.json) and its
Outcome, and what a rerun with the same --out resumes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.atomic_write import write_atomic
from sm120kit.bench import analysis
from sm120kit.bench.analysis import Level
from sm120kit.bench.variants import Plan, Planned, VariantStatus
from sm120kit.errors import UserError
from sm120kit.exit_codes import ExitCode

if TYPE_CHECKING:
    from sm120kit.bench.command import BenchOptions

SEARCH_FILE = "search.json"
VARIANT_FILE = "variant.json"
SMOKE_FILE = "smoke.json"
SERVER_LOG = "server.log"
FORMAT = 1


class Outcome(str, Enum):
    DONE = "done"  # smoked (or --no-smoke) and swept: every level has figures, none of them of garbage
    EXCLUDED = "excluded"  # its smoke failed (not swept), or its sweep's outputs are garbage
    FAILED = "failed"  # swept, but a level gave no figures: not a result, runs again on a rerun
    CRASHED = "crashed"  # did not get ready, or its server died during the sweep
    REFUSED = "refused"  # serve's preflight refused to start it (the node's state): runs again on a rerun
    SKIPPED = "skipped"  # the plan: nothing started
    INTERRUPTED = "interrupted"  # Ctrl-C: runs again on a rerun
    RUNNING = "running"  # a variant.json whose bench was killed outright: runs again

    def __str__(self) -> str:
        return self.value


REFUSED_WHY = "refused by the preflight"
FINAL = frozenset({Outcome.DONE, Outcome.EXCLUDED, Outcome.CRASHED})


@dataclass
class VariantResult:
    name: str
    sets: list[str]
    status: Outcome
    why: str = ""
    levels: list[Level] = field(default_factory=list)
    smoke: dict | None = None  # SmokeReport.as_json()
    stop: dict | None = None  # the serve child's exit code and what its stop proved
    diagnosis: list[str] = field(default_factory=list)  # the supervisor's, for a crash
    seconds: float | None = None
    scaling: str = ""  # the first line of its sweep's plateau verdict
    resumed: bool = False  # found done in the directory: not run again

    @property
    def unclean(self) -> bool:
        return self.stop is not None and self.stop.get("exit_code") == int(ExitCode.UNCLEAN)

    def as_json(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "set": self.sets,
            "status": str(self.status),
            "why": self.why,
            "levels": [lv.as_json() for lv in self.levels],
            "smoke": self.smoke,
            "stop": self.stop,
            "diagnosis": self.diagnosis,
            "seconds": self.seconds,
            "scaling": self.scaling,
        }

    @classmethod
    def skipped(cls, planned: Planned) -> VariantResult:
        """A variant the plan skipped, or found that serve's preflight would refuse: nothing
        started, why says."""
        refused = planned.status is VariantStatus.REFUSED
        return cls(
            planned.name, list(planned.variant.sets), Outcome.REFUSED if refused else Outcome.SKIPPED, planned.why
        )

    @classmethod
    def from_json(cls, doc: dict) -> VariantResult:
        return cls(
            doc["name"],
            list(doc.get("set", [])),
            Outcome(doc["status"]),
            doc.get("why", ""),
            [analysis.level_from_json(d) for d in doc.get("levels", [])],
            doc.get("smoke"),
            doc.get("stop"),
            list(doc.get("diagnosis", [])),
            doc.get("seconds"),
            doc.get("scaling", ""),
        )


def settings_of(options: BenchOptions, plan: Plan, base_sets: list[str]) -> dict:
    """What makes two searches' figures comparable: a rerun into the same directory must
    have the same."""
    return {
        "profile": plan.profile,
        "base_set": list(base_sets),
        "levels": options.levels,
        "repeat": options.repeat,
        "input_len": options.input_len,
        "output_len": options.output_len,
        "prompts_per_level": options.prompts_per_level,
        "smoke": options.smoke,
        "sglang": plan.variants[0].launch.sglang if plan.variants and plan.variants[0].launch else None,
    }


def default_directory(profile: str) -> Path:
    return Path("sm120kit-bench") / f"{profile}-search-{time.strftime('%Y%m%d-%H%M%S')}"


def write_json(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, indent=2).encode())  # a Ctrl-C mid-write must not leave a broken file


def read_json(path: Path, hint: str | None = None) -> dict | None:
    """A search's JSON file (search.json, a variant.json); None when there is none."""
    hint = hint or (
        "give another --out (without it, the variants done there are not known)"
        if path.name == SEARCH_FILE
        else f"remove {path.parent} (that variant runs again) or give another --out"
    )
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({type(exc).__name__}: {exc})", hint) from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object", hint)
    return doc


def check_resumable(directory: Path, settings: dict, plan: Plan) -> dict[str, VariantResult]:
    """The variants already finished in `directory` (a rerun skips them). A directory with
    other settings, or a variant of the same name with other sets, is refused: their
    figures would not compare."""
    doc = read_json(directory / SEARCH_FILE) if directory.is_dir() else None
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is not a directory", "give a directory for the search's results")
    if doc is None:
        if directory.is_dir() and (directory / "run.json").exists():
            raise UserError(
                f"--out {directory} holds a plain sweep (run.json), not a search", "give another --out for the search"
            )
        return {}
    before = doc.get("settings", {})
    changed = [k for k in settings if before.get(k) != settings[k]]
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} then, {settings[k]!r} now" for k in changed)
        raise UserError(
            f"--out {directory} holds a search with other settings ({shown}): its figures would not compare",
            "run with the same options to resume it, or give another --out",
        )
    sets = {p.name: list(p.variant.sets) for p in plan.variants}
    done: dict[str, VariantResult] = {}
    for name in sets:
        vdoc = read_json(directory / name / VARIANT_FILE) if (directory / name).is_dir() else None
        if vdoc is None:
            continue
        try:
            result = VariantResult.from_json(vdoc)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"{directory / name / VARIANT_FILE} is damaged ({type(exc).__name__}: {exc})",
                f"remove {directory / name} (that variant runs again)",
            ) from None
        if result.sets != sets[name]:
            raise UserError(
                f"{directory / name} was variant {name} with --set {' '.join(result.sets) or '(none)'}; "
                f"now it sets {' '.join(sets[name]) or '(none)'}",
                "give another --out, or remove that directory",
            )
        if result.status in FINAL and not _without_figures(result):
            result.resumed = True
            done[name] = result
    return done


def _without_figures(result: VariantResult) -> bool:
    """A variant recorded done with a level that gave no figures (an earlier sm120kit wrote
    such a one as done): not a result, so not finished."""
    return result.status is Outcome.DONE and (not result.levels or any(not lv.figures for lv in result.levels))


def search_doc(settings: dict, plan: Plan, results: dict[str, VariantResult]) -> dict:
    return {
        "format": FORMAT,
        "settings": settings,
        "plan": plan.as_json(),
        "status": {name: str(r.status) for name, r in results.items()},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
