"""The launch rules: before a load, does the rendered command run into a known SM120
failure of the installed release that no applied patch covers?

A rule (a [failure.rule] of the survey) holds when every condition on the rendered argv,
the model's config.json and the server's environment holds. It is judged only for an
SM12x node (the profile's node.compute_capability), on a release the entry names, and
it is then one of: refused (an error, exit 2, naming the release, the symptom, the
upstream link and what avoids it), covered (the entry's patch is in place or upstream
fixed it), allowed (--allow-known-failure ID), or undecided (a condition could not be
read, e.g. no config.json on this machine: a warning). A rule that can never hold on the
installed release, as it needs a flag that release does not have (a user's rule written
for another release, a misspelt flag), is inert: a warning, never silence.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from sm120kit.catalogue.survey import Condition, Failure, Survey
from sm120kit.errors import UserError

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.target import Target

ALLOW_OPTION = "--allow-known-failure"


IN_PLACE = {"applied", "already-applied", "fixed-upstream"}  # outcomes of a patch that covers its failure


class Verdict(str, enum.Enum):
    REFUSED = "refused"
    COVERED = "covered"
    ALLOWED = "allowed"
    UNDECIDED = "undecided"
    INERT = "inert"  # it needs a flag the installed sglang does not have: it can never fire


@dataclass(frozen=True)
class Judged:
    failure: Failure
    verdict: Verdict
    version: str  # the installed release of failure.package
    detail: str = ""  # the covering patch, what could not be read, or the flags the release lacks

    @property
    def release(self) -> str:
        return f"{self.failure.package} {self.version}"

    def message(self) -> str:
        f = self.failure
        unverified = (
            f" (checked through {f.checked}: unverified on this release)" if f.unverified_on(self.version) else ""
        )
        head = f"known failure {f.id} on {self.release}{unverified}: {f.title}"
        if self.verdict is Verdict.COVERED:
            return f"{head}: covered ({self.detail})"
        if self.verdict is Verdict.ALLOWED:
            return f"{head}: allowed by {ALLOW_OPTION} {f.id}"
        if self.verdict is Verdict.INERT:
            return f"{head}: its rule can never fire here: {self.detail}; fix its `when` for this release"
        if self.verdict is Verdict.UNDECIDED:
            return f"{head}: may apply ({self.detail}){f.tracked(first=True)}"
        symptom = f"; it fails with: {f.shown_symptom}" if f.symptom else ""  # the line, not the pattern
        return f"{head}{symptom}{f.tracked()} ({f.status})"

    def fix(self) -> str:
        f = self.failure
        ways = []
        if f.patch:
            ways.append(f"`sm120kit patch --verify` ({f.patch} covers it)")
        if f.rule and f.rule.avoid:  # (a user's rule may name no way round it)
            ways.append("profile: --set " + " --set ".join(f.rule.avoid))
        if f.avoid:
            ways.append(f"sglang flags: {f.avoid}")
        ways.append(f"{ALLOW_OPTION} {f.id} to allow it anyway")
        return "; or ".join(ways)

    def as_json(self) -> dict:
        return {
            "id": self.failure.id,
            "verdict": self.verdict.value,
            "release": self.release,
            "title": self.failure.title,
            "upstream": list(self.failure.upstream),
            "status": self.failure.status,
            "detail": self.detail,
            "fix": self.fix(),
        }


@dataclass(frozen=True)
class Facts:
    """What a launch looks like to the rules."""

    argv: Sequence[object]  # the rendered argv (EnvRef items are secrets: never compared)
    env: Mapping[str, str]
    versions: Mapping[str, str]  # package -> installed release
    model_config: dict | None  # config.json, None when it could not be read
    model_config_problem: str = ""  # why not
    capability: str = "12.0"
    patch_outcome: Callable[[str], str | None] = lambda patch_id: None  # a patch's outcome on the target
    nvcc: str | None = None  # the release of the nvcc flashinfer compiles with ("12.8"), where there is one
    flags: frozenset[str] | None = None  # every spelling the installed sglang takes (None: not known)

    def flag(self, spellings: Sequence[str]) -> tuple[bool, str | None]:
        """(given, value) of the first of the spellings that the argv gives, in the order
        listed (["--decode-attention-backend", "--attention-backend"]: the decode backend,
        as sglang resolves it); `--x=v` and `--x v` both count. A condition with
        alternatives (each phase's backend) reads each of them with this."""
        words = [a for a in self.argv if isinstance(a, str)]
        for spelling in spellings:
            for i, word in enumerate(words):
                name, eq, value = word.partition("=")
                if name != spelling:
                    continue
                if eq:
                    return True, value
                following = words[i + 1] if i + 1 < len(words) else None
                return True, following if following is not None and not following.startswith("--") else None
        return False, None


def _holds(condition: Condition, facts: Facts) -> bool | None:
    """True, False, or None where the fact cannot be read."""
    values: list[object]
    if condition.flag is not None:
        read = [facts.flag(spellings) for spellings in condition.flag_alternatives()]  # one flag, or alternatives
        if condition.present is not None:
            return any(given == condition.present for given, _ in read)
        values = [value if given else condition.default for given, value in read]
    elif condition.model is not None:
        if condition.quantization is not None:  # the launch's own --quantization decides first
            given, stated = facts.flag(["--quantization"])
            if given and stated is not None and stated not in condition.quantization:
                return False
        if facts.model_config is None:
            return None
        node = next((v for key in condition.model if (v := _dotted(facts.model_config, key)) is not None), None)
        values = node if isinstance(node, list) else [node]
    elif condition.env is not None:
        values = [facts.env.get(condition.env, condition.default)]
    elif condition.nvcc:
        values = [facts.nvcc]
    else:
        values = [facts.capability]
    if condition.matches is not None:
        return any(v is not None and re.search(condition.matches, str(v)) for v in values)
    return any(v is not None and str(v) in (condition.in_ or ()) for v in values)  # (`in` is set: no `matches`)


def _dotted(doc: dict, key: str) -> object:
    node: object = doc
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def judge(survey: Survey, facts: Facts, allowed: frozenset[str] = frozenset()) -> list[Judged]:
    """Every rule that holds on this launch, with its verdict (rules that do not hold are
    not listed)."""
    if not facts.capability.startswith("12."):
        return []
    found = []
    for failure in survey.failures:
        version = facts.versions.get(failure.package)
        if failure.rule is None or version is None or not failure.covers(version):
            continue
        if lacking := _lacking(failure.rule.when, facts):
            sglang = facts.versions.get("sglang", "")
            detail = f"it needs {' and '.join(lacking)}, which sglang {sglang} does not have"
            found.append(Judged(failure, Verdict.INERT, version, detail))
            continue
        held = [_holds(c, facts) for c in failure.rule.when]
        if False in held:
            continue
        outcome = facts.patch_outcome(failure.patch) if failure.patch else None
        if outcome in IN_PLACE:
            found.append(Judged(failure, Verdict.COVERED, version, f"{failure.patch}: {outcome}"))
        elif failure.id in allowed:
            found.append(Judged(failure, Verdict.ALLOWED, version))
        elif None in held:
            unread = [c.describe() for c, h in zip(failure.rule.when, held) if h is None]
            why = facts.model_config_problem or "not readable here"
            found.append(Judged(failure, Verdict.UNDECIDED, version, f"cannot tell {', '.join(unread)}: {why}"))
        else:
            found.append(Judged(failure, Verdict.REFUSED, version))
    return found


def refusal(judged: list[Judged], what: str) -> UserError | None:
    """One UserError for every refused rule (exit 2), or None."""
    refused = [j for j in judged if j.verdict is Verdict.REFUSED]
    if not refused:
        return None
    lines = [f"{what} runs into {len(refused)} known SM120 failure(s) before any load:"]
    for j in refused:
        lines += [f"  {j.message()}", f"    avoid: {j.fix()}"]
    ids = " ".join(f"{ALLOW_OPTION} {j.failure.id}" for j in refused)
    return UserError("\n".join(lines), f"apply one fix per failure above, or allow them anyway with {ids}")


def warnings(judged: list[Judged]) -> list[str]:
    """What the operator should still read: allowed, undecided and inert rules."""
    return [j.message() for j in judged if j.verdict in (Verdict.ALLOWED, Verdict.UNDECIDED, Verdict.INERT)]


def _lacking(conditions: Sequence[Condition], facts: Facts) -> list[str]:
    """The flags of conditions that can only hold where the flag is given (present = true,
    or a value with no default) and that the installed sglang has under no spelling: while
    one is there, the rule can never fire."""
    if facts.flags is None:
        return []
    lacking = []
    for c in conditions:
        needs_it = c.present is True or (c.present is None and c.default is None)
        spellings = [s for alternative in c.flag_alternatives() for s in alternative]
        if c.flag is not None and needs_it and not any(s in facts.flags for s in spellings):
            lacking.append(" / ".join(spellings))
    return lacking


def check_launch(
    profile: Profile,
    launch: Launch,
    target: Target,
    patch_dirs: Sequence[str] = (),
    allowed: Sequence[str] = (),
    survey: Survey | None = None,
    capability: str | None = None,
    model: tuple[dict | None, str] | None = None,
) -> list[Judged]:
    """The rules judged for one rendered launch of `profile` on `target` (on `capability`,
    else the profile's; `model`: model_config() of the profile, where the caller read it).
    An unknown id in `allowed` is a UserError."""
    from sm120kit.catalogue.survey import load_survey

    survey = survey or load_survey(list(patch_dirs) or None)
    allow = survey.select(list(allowed), ALLOW_OPTION)
    capability = capability or profile.node.compute_capability or "12.0"  # unsaid: the SM120 node this kit is for
    if not capability.startswith("12."):
        return []
    versions = {p: d.version for p in ("sglang", "flashinfer-python") if (d := target.find(p))}
    config, problem = model or model_config(profile.model.path)
    outcome = cache(lambda patch_id: patch_outcome(target, patch_id, patch_dirs))
    nvcc = _nvcc(launch.env)
    facts = Facts(launch.argv, {**launch.env}, versions, config, problem, capability, outcome, nvcc, _flags(target))
    return judge(survey, facts, allow)


def _flags(target: Target) -> frozenset[str] | None:
    """Every spelling of every flag of the installed sglang (its schema, read from its source
    as the launch was rendered); None without one."""
    from sm120kit.profiles.flags import read_schema

    dist = target.find("sglang")
    return frozenset(s for f in read_schema(dist).flags for s in (f.name, *f.aliases)) if dist else None


def _nvcc(env: Mapping[str, str]) -> str | None:
    """The nvcc flashinfer's JIT would compile with in the server's environment, as "12.8"."""
    import os

    from sm120kit.cuda_toolkit import flashinfer_nvcc

    found = flashinfer_nvcc({**os.environ, **env})
    return ".".join(map(str, found[1])) if found and found[1] else None


def model_config(path: str | None) -> tuple[dict | None, str]:
    """config.json of the profile's model from disk or the Hugging Face cache (never the
    network), with its hf_quant_config.json under "hf_quant_config"; or None and why not."""
    from sm120kit.model_config import find_model_config, read_model_config

    if not path:
        return None, "the profile names no model"
    try:
        found = find_model_config(path)
        config = read_model_config(found)
    except UserError as exc:
        return None, exc.message
    quant = found.with_name("hf_quant_config.json")  # ModelOpt checkpoints keep their quantization here
    if quant.is_file():
        try:
            config = {**config, "hf_quant_config": read_model_config(quant)}
        except UserError as exc:
            return None, exc.message
    return config, ""


def patch_outcome(target: Target, patch_id: str, patch_dirs: Sequence[str]) -> str | None:
    """The patch's outcome on the target: in place only when every file it applies to is."""
    from sm120kit.patching import planning
    from sm120kit.patching.registry import load_patches

    chosen = [p for p in load_patches(list(patch_dirs) or None) if p.id == patch_id]
    outcomes = [f.outcome.value for f in planning.plan(target, chosen, need_bytes=False).findings]
    relevant = [o for o in outcomes if o != "not-applicable"]
    return next((o for o in relevant if o not in IN_PLACE), relevant[0] if relevant else None)
