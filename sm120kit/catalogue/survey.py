"""The survey of known SM120 failures (patches/known-failures.toml): what each failure
prints, the releases whose real code has it, where upstream tracks and fixed it, and
sm120kit's answer (a patch, a launch rule, or flags that avoid compiled code).

One file feeds three readers: `diagnose` matches the symptoms, the launch rules
(rules.py) refuse a known-failing configuration before a load, and `patches` / `status`
show each patch's upstream link. A user's --patch-dir may hold a known-failures.toml of
its own: its entries come first, and one with a shipped entry's id replaces it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal, TypeVar, get_args

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from sm120kit import search_paths
from sm120kit.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

FILENAME = "known-failures.toml"
Package = Literal["sglang", "flashinfer-python"]
PACKAGES = get_args(Package)
M = TypeVar("M", bound=BaseModel)
STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
Id = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$", max_length=80)]
Line = Annotated[str, Field(min_length=1, max_length=2000)]
UPSTREAM = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")
Answer = Literal["patch", "rule", "compiled", "environment"]
# The validation context of a user's survey (a --patch-dir's known-failures.toml). The
# shipped file's entries carry what its tests and its published page need (a GitHub link,
# the evidence, the release read, a profile and an `avoid` for each rule, which the tests
# run); a user's needs what sm120kit acts on: an id, a range, and a symptom (diagnose) or a
# rule (refusal).
USER = {"user": True}


def _is_users(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("user"))


def _required_in_the_shipped_survey(value, info: ValidationInfo):
    if not _is_users(info) and (value is None or value == []):
        raise ValueError("required in the shipped survey (a user's own survey may leave it out)")
    return value


def _version(value: str) -> str:
    try:
        Version(value)
    except InvalidVersion:
        raise ValueError(f"{value!r} is not a release (e.g. 0.5.23)") from None
    return value


class Condition(BaseModel):
    """One fact about the launch. `flag`: a value of the rendered argv (the first of the
    spellings given, in the order listed; `default` when none is); a list of such lists is
    alternatives, and the fact holds when it holds for one of them (the attention backend
    of either phase: [["--prefill-attention-backend", "--attention-backend"],
    ["--decode-attention-backend", "--attention-backend"]]); `model`: a dotted key of
    the model's config.json (the first of those listed that it has; `hf_quant_config.` reads
    the checkpoint's hf_quant_config.json, where ModelOpt writes its quantization), and for a
    key of the checkpoint's quantization, `quantization`: the methods of sglang's
    --quantization (the profile's model.quantization) under which it can hold (a launch
    that gives another is decided without config.json: the fact does not hold);
    `env`: the server's environment; `nvcc = true`: the release of the nvcc flashinfer's JIT
    compiles with in the server's environment ("12.8"; where there is none the fact does not
    hold); `capability = true`: the profile's
    node.compute_capability. The fact holds when its value is `in` the list, or `matches`
    the regular expression (for a list value: any element), or for `present`, when the
    flag is (or is not) given."""

    model_config = STRICT

    flag: list[Line] | list[list[Line]] | None = None
    model: list[Line] | None = None
    quantization: list[Line] | None = Field(None, min_length=1)  # with `model`: see above
    env: Line | None = None
    capability: bool | None = None  # the profile's node.compute_capability ("12.0", "12.1")
    nvcc: bool | None = None  # the release ("12.8") of the nvcc flashinfer's JIT compiles with, where one is
    in_: list[str] | None = Field(None, alias="in", min_length=1)
    matches: Line | None = None  # a regular expression that a value (or an element of a list) contains
    present: bool | None = None
    default: str | None = None

    @field_validator("flag", "model", mode="before")
    @classmethod
    def _spellings(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_of_each(self) -> Condition:
        subjects = [k for k in ("flag", "model", "env", "capability", "nvcc") if getattr(self, k) is not None]
        if len(subjects) != 1:
            raise ValueError("a condition names exactly one of flag, model, env, capability, nvcc")
        if sum(x is not None for x in (self.in_, self.matches, self.present)) != 1:
            raise ValueError("a condition has exactly one of `in`, `matches` and `present`")
        if self.matches is not None:
            try:
                re.compile(self.matches)
            except re.error as exc:
                raise ValueError(f"`matches` is not a regular expression: {exc}") from None
        if self.present is not None and self.flag is None:
            raise ValueError("`present` is for a flag")
        alternatives = self.flag_alternatives()
        if not all(alternatives):
            raise ValueError("a flag names at least one spelling")
        if not all(s.startswith("--") for spellings in alternatives for s in spellings):
            raise ValueError("a flag is spelled with its dashes, e.g. --attention-backend")
        if self.present is not None and len(alternatives) > 1:
            raise ValueError("`present` takes one list of spellings (any of them given), not alternatives")
        if self.quantization is not None and self.model is None:
            raise ValueError("`quantization` is for a model condition (a key of the checkpoint's quantization)")
        return self

    def flag_alternatives(self) -> list[list[str]]:
        """The flag's alternatives, each the spellings of one flag in the order tried:
        `flag = "--x"` and `flag = ["--x", "--y"]` are one alternative."""
        if self.flag is None:
            return []
        if all(isinstance(s, str) for s in self.flag):
            return [[s for s in self.flag if isinstance(s, str)]]
        return [list(s) for s in self.flag if isinstance(s, list)]

    def describe(self) -> str:
        subject = (
            _alternatives(self.flag_alternatives())
            if self.flag
            else " / ".join(self.model)
            if self.model
            else f"${self.env}"
            if self.env
            else "the nvcc flashinfer compiles with"
            if self.nvcc
            else "node.compute_capability"
        )
        if self.present is not None:
            return f"{subject} {'given' if self.present else 'not given'}"
        if self.matches is not None:
            return f"{subject} matches {self.matches!r}"
        default = f" (default {self.default})" if self.default is not None else ""
        return f"{subject} in {{{', '.join(self.in_ or ())}}}{default}"  # (`in` is set: the validator says so)


def _alternatives(alternatives: list[list[str]]) -> str:
    """`--x / --y`, or `(--a / --x) or (--b / --x)` for alternatives."""
    if len(alternatives) == 1:
        return " / ".join(alternatives[0])
    return " or ".join(f"({' / '.join(spellings)})" for spellings in alternatives)


class Rule(BaseModel):
    """A launch rule: refuse before the load when every condition holds on an affected
    release and no applied patch covers it. `profile` + `trigger` (profile --set
    assignments) make it fire, `avoid` added to them makes it pass: the tests run both on
    the real flag schema of the affected releases, and users read `avoid` as the fix."""

    model_config = STRICT

    when: list[Condition] = Field(min_length=1)
    profile: Line | None = Field(None, validate_default=True)  # (a user's rule may leave out the test data)
    trigger: list[Line] = []
    trigger_config: dict = {}  # config.json of the model in the test (model conditions)
    avoid: list[Line] = Field([], validate_default=True)

    _test_data = field_validator("profile", "avoid")(_required_in_the_shipped_survey)


class Failure(BaseModel):
    model_config = STRICT

    id: Id
    title: Line  # (a user's entry: its id, unless it says)
    package: Package  # (a user's entry: sglang, unless it says)
    affected: Line  # PEP 440 over the releases whose real code has the bug
    checked: Line | None = Field(None, validate_default=True)  # the newest release whose code was read
    fixed_in: Line | None = None  # the first release with the fix; None: open
    upstream: list[Line] = Field([], validate_default=True)  # the shipped survey's: GitHub; a user's: any
    symptom: Line | None = None  # a regular expression over one log line (diagnose); None: silent
    example: Line | None = None  # a line a log would hold, which symptom matches: what operators are shown
    evidence: Line | None = Field(None, validate_default=True)  # where the real code shows it (file, function)
    answer: Answer | None = Field(None, validate_default=True)  # (a user's entry: patch or rule, as it has one)
    patch: Id | None = None
    avoid: Line | None = None  # the flags that avoid it, as an operator types them
    advice: Line | None = Field(None, validate_default=True)
    rule: Rule | None = None

    _shipped_data = field_validator("checked", "upstream", "evidence", "answer", "advice")(
        _required_in_the_shipped_survey
    )

    @model_validator(mode="before")
    @classmethod
    def _users_defaults(cls, data, info: ValidationInfo):
        """A user's entry left without a title, a package or an answer gets what it implies."""
        if not (_is_users(info) and isinstance(data, dict)):
            return data
        implied = {"title": data.get("id") if isinstance(data.get("id"), str) else "untitled", "package": "sglang"}
        if "patch" in data or "rule" in data:
            implied["answer"] = "patch" if "patch" in data else "rule"
        return {**implied, **data}

    @field_validator("checked", "fixed_in")
    @classmethod
    def _release(cls, value: str | None) -> str | None:
        return value if value is None else _version(value)

    @field_validator("affected")
    @classmethod
    def _specifier(cls, value: str) -> str:
        try:
            spec = SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"{value!r} is not a PEP 440 range (e.g. >=0.5.17,<=0.5.23)") from None
        if not list(spec):
            raise ValueError("names no releases: write the range the real code was read in, e.g. >=0.5.17")
        return value

    @field_validator("upstream")
    @classmethod
    def _links(cls, links: list[str], info: ValidationInfo) -> list[str]:
        for link in links if not _is_users(info) else ():  # (a user's may be an internal tracker's)
            if not UPSTREAM.match(link):
                raise ValueError(f"{link!r} is not a GitHub issue or pull request URL")
        return links

    @field_validator("symptom")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _answer_fits(self, info: ValidationInfo) -> Failure:
        if (self.answer == "patch") != (self.patch is not None):
            raise ValueError('`patch` names the patch exactly when answer = "patch"')
        if _is_users(info) and self.symptom is None and self.rule is None:
            raise ValueError("needs a `symptom` (for diagnose) or a [failure.rule] (to refuse a launch)")
        if self.answer not in (None, "patch") and not self.avoid and not _is_users(info):
            raise ValueError(f'answer = "{self.answer}" needs `avoid`: the flags that avoid the failure')
        if self.answer == "rule" and self.rule is None:
            raise ValueError('answer = "rule" needs a [failure.rule]: else nothing refuses the configuration')
        if self.fixed_in and self.covers(self.fixed_in):
            raise ValueError(f"fixed_in {self.fixed_in} is inside affected {self.affected!r}")
        return self

    @model_validator(mode="after")
    def _example_shows_the_symptom(self) -> Failure:
        if self.example is not None and self.symptom is None:
            raise ValueError("`example` is a line the symptom matches: give `symptom` too")
        if self.example is not None and not re.search(self.symptom or "", self.example):
            raise ValueError(f"symptom {self.symptom!r} does not match its example {self.example!r}")
        return self

    @property
    def shown_symptom(self) -> str | None:
        """The symptom as an operator reads it: the example line, else (an entry without one)
        the pattern, said to be one."""
        if self.symptom is None:
            return None
        return self.example or f"a line matching the pattern {self.symptom!r}"

    @cached_property
    def specifier(self) -> SpecifierSet:
        return SpecifierSet(self.affected)

    @cached_property
    def pattern(self) -> re.Pattern | None:
        return re.compile(self.symptom) if self.symptom else None

    def covers(self, version: str) -> bool:
        return self.specifier.contains(Version(version), prereleases=True)

    def unverified_on(self, version: str) -> bool:
        """Newer than any release whose code was read for this entry (one that names none
        is the user's own word: not said to be unverified)."""
        return self.checked is not None and Version(version) > Version(self.checked)

    def tracked(self, first: bool = False) -> str:
        """The links as a message ends with them, `; upstream LINK, ...` (the first alone
        with `first`), or "" for a user's entry that names none."""
        links = self.upstream[:1] if first else self.upstream
        return f"; upstream {', '.join(links)}" if links else ""

    @property
    def status(self) -> str:
        return f"fixed in {self.fixed_in}" if self.fixed_in else "open"


class _Document(BaseModel):
    model_config = STRICT
    failure: list[Failure] = Field(min_length=1)


@dataclass(frozen=True)
class Survey:
    failures: tuple[Failure, ...]
    sources: tuple[Path, ...]

    def get(self, failure_id: str) -> Failure | None:
        return next((f for f in self.failures if f.id == failure_id), None)

    def select(self, ids: list[str] | tuple[str, ...], option: str = "--allow-known-failure") -> frozenset[str]:
        """The ids as given, each known; an unknown one is a UserError with the nearest."""
        import difflib

        known = [f.id for f in self.failures]
        for failure_id in ids:
            if failure_id not in known:
                near = difflib.get_close_matches(failure_id, known, n=1)
                raise UserError(
                    f"{option} {failure_id}: no known failure has that id" + (f" (nearest: {near[0]})" if near else ""),
                    "`sm120kit known-failures` lists them",
                )
        return frozenset(ids)


def _where(path: Path, doc: dict, loc: tuple) -> str:
    """`failure[3] (trtllm-mla-prefill-sm120).rule.when[0].in` for a pydantic location."""
    if len(loc) >= 2 and loc[0] == "failure" and isinstance(loc[1], int):
        entries = doc.get("failure")
        if not isinstance(entries, list):
            entries = []
        entry = entries[loc[1]] if loc[1] < len(entries) else None
        name = f" ({entry['id']})" if isinstance(entry, dict) and isinstance(entry.get("id"), str) else ""
        rest = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[2:])
        return f"failure[{loc[1]}]{name}{rest}"
    return ".".join(map(str, loc)) or "the document"


HINT = "fix the entry (the file's header says what each key holds)"
SHOWN = 2  # the defects listed after the first


def read_document(
    path: Path, model: type[M], what: str, where: Callable[[dict, tuple], str], context: dict | None = None
) -> M:
    """A TOML data file of the catalogue, validated by `model` (with `context`, pydantic's
    validation context): any defect is a UserError naming the file and, by where(doc,
    pydantic location), the key; the first few defects, each once."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the {what}: {exc}", HINT) from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}", HINT) from None
    try:
        return model.model_validate(doc, context=context)
    except ValidationError as exc:
        said = [f"{where(doc, e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]
        first, rest = said[0], said[1:]
        shown = "; ".join(rest[:SHOWN]) + (f"; and {len(rest) - SHOWN} more" if len(rest) > SHOWN else "")
        more = f" (and {len(rest)} more: {shown})" if rest else ""
        raise UserError(f"{path}: {first}{more}", HINT) from None


def read_file(path: Path, users: bool = False) -> list[Failure]:
    """One survey file, validated (`users`: a user's own, held to what sm120kit acts on, not
    to the shipped file's test data); any defect is a UserError naming the file and the key."""
    context = USER if users else None
    parsed = read_document(path, _Document, "known-failures survey", lambda doc, loc: _where(path, doc, loc), context)
    seen: set[str] = set()
    for i, failure in enumerate(parsed.failure):
        if failure.id in seen:
            raise UserError(f"{path}: failure[{i}] ({failure.id}).id: listed twice", HINT)
        seen.add(failure.id)
    return parsed.failure


def load_survey(
    patch_dirs: list[str] | None = None, patch_ids: set[str] | None = None, validate_patches: bool = True
) -> Survey:
    """The user's surveys (in --patch-dir order) before the shipped one; an entry with an
    id already read replaces the later one. Each `patch` must name a known patch (the
    ids of `patch_ids`, else of every loadable patch), unless validate_patches is off
    (diagnose reads symptoms, and a dying server is no time to import patch modules)."""
    from sm120kit.patching.registry import load_patches, search_path

    directories = search_path(patch_dirs)
    shipped = directories[-1] / FILENAME
    files = search_paths.files_named(directories, FILENAME, "known-failures survey")
    failures: dict[str, Failure] = {}
    origin: dict[str, Path] = {}
    for path in files:
        for failure in read_file(path, users=path != shipped):
            if failure.id not in failures:
                failures[failure.id], origin[failure.id] = failure, path
    if not validate_patches:
        return Survey(tuple(failures.values()), tuple(files))
    known = patch_ids if patch_ids is not None else {p.id for p in load_patches(patch_dirs)}
    for failure in failures.values():
        if failure.patch and failure.patch not in known:
            raise UserError(
                f"{origin[failure.id]}: failure {failure.id}.patch: no patch has the id {failure.patch!r}",
                "name a patch that `sm120kit patches` lists, or add the patch module to the --patch-dir",
            )
    return Survey(tuple(failures.values()), tuple(files))
