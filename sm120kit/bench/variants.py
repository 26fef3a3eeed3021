"""The variants of a search (`bench --vary`, `bench --variants`): each a name and the --set
words that turn the profile as written into it, planned before anything starts.

    --vary KEY=V1,V2,...     repeatable; the cartesian product of the lists; each value is
                             read as --set reads one (TOML where it parses, else text)
    --variants NAME|FILE     a variants file: profiles/variants/NAME.toml in a profile
                             directory (--profile-dir, $SM120KIT_PROFILE_PATH, the shipped
                             set), or a path

A variants file:

    profile = "glm5-nvfp4"                  # the profile it was written for
    description = "..."
    [variants.max-running-2048]             # the name: [a-z0-9][a-z0-9._-]*
    description = "max running requests 1024 -> 2048"
    set = { "engine.max_running_requests" = 2048 }
    requires = { flashinfer-python = ">=0.6.17" }    # optional: PEP 440 ranges
    why = "..."                                      # said when it is skipped

The profile as written is always the first variant, "as-written" (the baseline). Planning
loads the profile with each variant's sets and renders it for the installed sglang: a value
of the wrong type is bad input (a UserError, nothing starts); a variant whose `requires`
excludes an installed version, that the installed release cannot take (the renderer's own
message), or that resolves to the same profile as an earlier one is skipped, with why; one
that serve's preflight would refuse on the checks of the profile and the serving
environment (its patches not in place, a package the server imports missing, two of its
ports the same: sm120kit.serve.preflight) is refused, with why, and never started.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120kit.errors import UserError

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.serve.options import ServeOptions
    from sm120kit.target import Target

BASELINE = "as-written"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
FILE_KEYS = ("profile", "description", "variants")
VARIANT_KEYS = ("description", "set", "requires", "why")
PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
VARIANTS_DIR = "variants"  # under each profile directory
MAX_VARIANTS = 1000  # a cartesian product past this is a typo, not a search
MAX_NAME = 120  # a variant's name is its directory's: a long --vary name is cut, with a digest
RESERVED = frozenset({"search.json", "summary.md", "results.csv", "plot.png"})  # the search's own files


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...] = ()  # --set words: "engine.max_running_requests=2048"
    description: str = ""
    requires: tuple[tuple[str, str], ...] = ()  # (package, PEP 440 range)
    why: str = ""  # said when it is skipped

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "set": list(self.sets),
            "description": self.description,
            "requires": dict(self.requires),
            "why": self.why,
        }


class VariantStatus(str, Enum):
    RUNNABLE = "runnable"
    SKIPPED = "skipped"  # nothing started: why says
    REFUSED = "refused"  # serve's preflight would refuse it: nothing started, why says

    def __str__(self) -> str:
        return self.value


@dataclass
class Planned:
    """A variant, its profile and launch, or why it is skipped."""

    variant: Variant
    status: VariantStatus
    why: str = ""
    profile: Any = None  # the Profile with the variant's sets
    launch: Any = None  # its Launch for the installed sglang
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def runnable(self) -> bool:
        return self.status is VariantStatus.RUNNABLE

    def as_json(self) -> dict:
        return {
            **self.variant.as_json(),
            "status": str(self.status),
            "why": self.why or self.variant.why,
            "warnings": self.warnings,
        }


@dataclass(frozen=True)
class Plan:
    profile: str  # the profile's name
    source: str  # "--vary" or the variants file
    variants: list[Planned]  # as-written first
    notes: list[str] = field(default_factory=list)
    serve_args: tuple[str, ...] = ()  # --profile-dir / --python words: serve finds the same profile and sglang

    def with_serve_args(self, profile_dirs: list[str] | None, python: str | None) -> Plan:
        words = [w for d in profile_dirs or () for w in ("--profile-dir", str(Path(d).resolve()))]
        words += ["--python", python] if python else []
        return dataclasses.replace(self, serve_args=tuple(words))

    @property
    def runnable(self) -> list[Planned]:
        return [p for p in self.variants if p.runnable]

    @property
    def skipped(self) -> list[Planned]:
        """Those not run: skipped, or refused."""
        return [p for p in self.variants if not p.runnable]

    @property
    def refused(self) -> list[Planned]:
        return [p for p in self.variants if p.status is VariantStatus.REFUSED]

    def as_json(self) -> dict:
        return {
            "profile": self.profile,
            "source": self.source,
            "variants": [p.as_json() for p in self.variants],
            "notes": self.notes,
            "serve_args": list(self.serve_args),
        }


# -- values as TOML ----------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """A value as TOML spells it (what --set reads back to the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else {"inf": "inf", "-inf": "-inf"}.get(str(value), "nan")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return json.dumps(str(value))


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def set_word(key: str, value: Any) -> str:
    return f"{key}={toml_value(value)}"


def profile_snippet(profile_name: str, sets: tuple[str, ...]) -> str:
    """A profile file that adopts the sets: extends the profile, one table per section."""
    from sm120kit.profiles.loader import parse_set

    tables: dict[tuple, list[str]] = {}
    for word in sets:
        path, value = parse_set(word)
        tables.setdefault(tuple(path[:-1]), []).append(f"{_toml_key(str(path[-1]))} = {toml_value(value)}")
    lines = [f'extends = "{profile_name}"']
    lines += tables.pop((), [])
    for table, rows in tables.items():
        lines += ["", f"[{'.'.join(_toml_key(str(k)) for k in table)}]", *rows]
    return "\n".join(lines)


# -- --vary ------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """ "512,1024" -> ["512", "1024"]; a comma inside quotes, [] or {} stays (TOML arrays)."""
    items: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    items.append("".join(current).strip())
    return items


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "x"


def vary_variants(items: list[str]) -> list[Variant]:
    """--vary KEY=V1,V2 (repeatable) -> the cartesian product, one Variant per combination,
    named after its values ("max_running_requests=2048,cuda_graphs=false"). Keys are checked
    against the profile's shape here (did-you-mean); values when the plan loads them."""
    from sm120kit.profiles.loader import parse_set

    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        hint = "e.g. --vary engine.max_running_requests=1024,2048"
        if not sep or not key:
            raise UserError(f"--vary {item!r}: expected KEY=V1,V2,...", hint)
        values = split_values(raw)
        if not raw.strip() or any(not v for v in values):
            what = "an empty list" if not raw.strip() else "an empty value in the list"
            raise UserError(f"--vary {item!r}: {what}", hint)
        parsed = [parse_set(f"{key}={v}", "--vary")[1] for v in values]  # the key: did-you-mean
        seen: dict[str, str] = {}
        for text, value in zip(values, parsed):
            same = json.dumps([type(value).__name__, value], default=str, sort_keys=True)
            if same in seen:
                raise UserError(
                    f"--vary {item!r}: {text} is in the list twice"
                    + (f" (as {seen[same]})" if seen[same] != text else ""),
                    "give each value once",
                )
            seen[same] = text
        if key in (k for k, _ in axes):
            raise UserError(f"--vary {key} is given twice", f"give one list: --vary {key}=V1,V2,...")
        axes.append((key, values))
    count = math.prod(len(v) for _, v in axes)
    if count > MAX_VARIANTS:
        raise UserError(
            f"--vary: {count} combinations (the product of the lists); at most {MAX_VARIANTS}",
            "vary fewer keys at a time, or name the variants in a file (--variants FILE)",
        )
    leaves = [k.rsplit(".", 1)[-1] for k, _ in axes]
    labels = [leaf if leaves.count(leaf) == 1 else key for leaf, (key, _) in zip(leaves, axes)]
    variants, names = [], set()
    for combo in itertools.product(*(values for _, values in axes)):
        name = ",".join(f"{label}={_slug(v)}" for label, v in zip(labels, combo))
        if len(name) > MAX_NAME:
            name = f"{name[: MAX_NAME - 9]}~{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        base, n = name, 2
        while name in names:  # two values that slug alike ("A", "a")
            name, n = f"{base}~{n}", n + 1
        names.add(name)
        variants.append(Variant(name, tuple(f"{k}={v}" for (k, _), v in zip(axes, combo))))
    return variants


# -- the variants file -------------------------------------------------------------------


def find_variants_file(spec: str, profile_dirs: list[str] | None) -> Path:
    """--variants NAME (variants/NAME.toml in a profile directory) or a path."""
    from sm120kit.profiles import loader

    if spec.endswith(".toml") or "/" in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--variants {spec}: no such file", "give a variants file, or the name of a shipped one")
        return path
    dirs = loader.search_path(profile_dirs)
    for directory in dirs:
        path = directory / VARIANTS_DIR / f"{spec}.toml"
        if path.is_file():
            return path
    known = sorted({p.stem for d in dirs for p in (d / VARIANTS_DIR).glob("*.toml")})
    near = difflib.get_close_matches(spec, known, n=1)
    raise UserError(
        f"--variants {spec}: no variants file of that name"
        + (f"; did you mean {near[0]!r}?" if near else "")
        + f"; known: {', '.join(known) or 'none'}",
        f"give a path, or put {spec}.toml under variants/ in a --profile-dir",
    )


def _unknown(where: str, key: str, allowed: tuple[str, ...]) -> UserError:
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    return UserError(
        f"{where}: unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""),
        f"the keys there are {', '.join(allowed)}",
    )


def _flatten(table: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """set = { engine.x = 1 } (a nested table) and { "engine.x" = 1 } read alike."""
    out = []
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and not _is_table_valued(dotted):
            out += _flatten(value, dotted)
        else:
            out.append((dotted, value))
    return out


def _is_table_valued(dotted: str) -> bool:
    """A key whose value is itself a table (env, extra_args): set whole, not flattened."""
    from typing import get_origin

    from sm120kit.profiles.loader import _type_at

    try:
        return get_origin(_type_at(tuple(dotted.split(".")))) is dict
    except LookupError:
        return False


def read_variants_file(path: Path) -> tuple[list[Variant], dict]:
    """The variants a file names, in its order, and its header (profile, description)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from sm120kit.profiles.loader import _read

    doc = _read(path)
    for key in doc:
        if key not in FILE_KEYS:
            raise _unknown(str(path), key, FILE_KEYS)
    for key in ("profile", "description"):
        if key in doc and not isinstance(doc[key], str):
            raise UserError(f"{path}: {key}: expected a string", f'write {key} = "..."')
    table = doc.get("variants")
    if not isinstance(table, dict) or not table:
        raise UserError(f"{path}: no [variants.NAME] tables", 'add one, e.g. [variants.x] set = { "a.b" = 1 }')
    variants = []
    for name, spec in table.items():
        where = f"{path}: [variants.{name}]"
        if name == BASELINE:
            raise UserError(f"{where}: {BASELINE} is the profile as written, always run", "give it another name")
        if name in RESERVED or len(name) > MAX_NAME:
            raise UserError(
                f"{where}: a variant's name names its directory: not {', '.join(sorted(RESERVED))}, at most "
                f"{MAX_NAME} characters",
                "rename it",
            )
        if not NAME.fullmatch(name):
            raise UserError(
                f"{where}: a variant name is lower-case letters, digits and . _ - (starting with a letter or digit)",
                f"rename it, e.g. [variants.{_slug(name)}]",
            )
        if not isinstance(spec, dict):
            raise UserError(f"{where}: expected a table", f"[variants.{name}] then set = {{ ... }}")
        for key in spec:
            if key not in VARIANT_KEYS:
                raise _unknown(where, key, VARIANT_KEYS)
        sets = spec.get("set", {})
        if not isinstance(sets, dict) or not sets:
            raise UserError(f"{where}: set: expected a table of profile keys", 'set = { "engine.x" = 1 }')
        requires = spec.get("requires", {})
        if not isinstance(requires, dict):
            raise UserError(f"{where}: requires: expected a table", 'requires = { sglang = ">=0.5.20" }')
        for package, rng in requires.items():
            if not PACKAGE.fullmatch(package) or not isinstance(rng, str):
                raise UserError(
                    f"{where}: requires.{package}: expected a package name and a PEP 440 range as a string",
                    'e.g. requires = { flashinfer-python = ">=0.6.17" }',
                )
            try:
                SpecifierSet(rng)
            except InvalidSpecifier:
                raise UserError(
                    f"{where}: requires.{package} = {rng!r} is not a PEP 440 version range",
                    'e.g. ">=0.6.17" or ">=0.5.20,<0.6"',
                ) from None
        for key in ("description", "why"):
            if not isinstance(spec.get(key, ""), str):
                raise UserError(f"{where}: {key}: expected a string", f'write {key} = "..."')
        words = tuple(set_word(k, v) for k, v in _flatten(sets))
        variants.append(Variant(name, words, spec.get("description", ""), tuple(requires.items()), spec.get("why", "")))
    return variants, {"profile": doc.get("profile"), "description": doc.get("description", "")}


# -- the plan ----------------------------------------------------------------------------


def plan(
    profile_name: str,
    profile_dirs: list[str] | None,
    base_sets: list[str],
    variants: list[Variant],
    target: Target,
    python: str,
    source: str,
    written_for: str | None = None,
    patch_dirs: Sequence[str] = (),
    allowed_failures: Sequence[str] = (),
    capability: str | None = None,
    serve_options: ServeOptions | None = None,
) -> Plan:
    """Load and render every variant (as-written first) for the installed sglang; skip
    those that cannot run, with why: a variant that runs into a known SM120 failure of the
    release, or dispatches a kernel with no SM12x build, is skipped before its load. Bad
    input (a key, a value of the wrong type), and an as-written profile that runs into one,
    raise. With serve_options (those the search serves each variant with), each variant
    that serve's preflight would refuse, off this node, is marked refused."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from sm120kit.catalogue.survey import load_survey
    from sm120kit.node.capability import presented_node
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render

    baseline = load_profile(profile_name, profile_dirs, base_sets)
    loaded = []  # every variant loads (bad input) before the environment is looked at
    for variant in variants:
        try:
            loaded.append((variant, load_profile(profile_name, profile_dirs, [*base_sets, *variant.sets])))
        except UserError as exc:
            raise _bad_variant(exc, variant, source, profile_name, profile_dirs, base_sets) from None
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: variants are rendered for the installed release",
            "point sm120kit at the serving environment with --python EXE",
        )
    schema = read_schema(dist)
    notes = []
    if written_for and written_for != profile_name:
        notes.append(f"{source} was written for profile {written_for}; searching {profile_name}")
    launch = render(baseline, schema, python)  # the profile as written must render: else nothing to compare with
    survey = load_survey(list(patch_dirs) or None)  # once for every variant
    from sm120kit.resolution import verdict

    def judge(profile: Profile, launch: Launch) -> verdict.LaunchVerdict:
        node = presented_node(profile, capability)
        return verdict.judge(profile, launch, target, node, patch_dirs, allowed_failures, survey=survey)

    judged = judge(baseline, launch)
    if error := judged.refusal(f"profile {baseline.name} as written", launch.sglang):
        raise error
    launch.warnings.extend(judged.warnings())
    would_refuse = _preflight(target, serve_options)
    as_written = Variant(BASELINE, description="the profile as written")
    preflight_says = would_refuse(baseline, launch)
    status = VariantStatus.REFUSED if preflight_says else VariantStatus.RUNNABLE
    planned = [Planned(as_written, status, preflight_says, baseline, launch, launch.warnings)]
    seen = {_fingerprint(baseline): BASELINE}
    for variant, profile in loaded:
        skip = []
        for package, rng in variant.requires:
            dist_r = target.find(package)
            if dist_r is None:
                skip.append(f"needs {package}{rng}; {package} is not installed")
                continue
            try:
                ok = SpecifierSet(rng).contains(Version(dist_r.version), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                skip.append(f"needs {package}{rng}; installed: {dist_r.version}")
        if skip:
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why("; ".join(skip), variant), profile))
            continue
        twin = seen.get(_fingerprint(profile))
        if twin is not None:
            planned.append(
                Planned(
                    variant, VariantStatus.SKIPPED, f"the same profile as {twin} (nothing it sets differs)", profile
                )
            )
            continue
        try:
            launch = render(profile, schema, python)
        except UserError as exc:
            why = exc.message.split(":\n  ", 1)[-1].replace("\n  ", "; ")  # the renderer's own lines
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why(why, variant), profile))
            continue
        judged = judge(profile, launch)
        if refused := judged.refusal(f"variant {variant.name}", launch.sglang):
            why = f"{refused.message.replace(chr(10) + '  ', '; ')}; {refused.hint}"
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why(why, variant), profile))
            continue
        launch.warnings.extend(judged.warnings())
        seen[_fingerprint(profile)] = variant.name
        if preflight_says := would_refuse(profile, launch):
            planned.append(Planned(variant, VariantStatus.REFUSED, _with_why(preflight_says, variant), profile, launch))
            continue
        planned.append(Planned(variant, VariantStatus.RUNNABLE, "", profile, launch, launch.warnings))
    return Plan(profile_name, source, planned, notes)


def _preflight(target: Target, options: ServeOptions | None) -> Callable[[Profile, Launch], str]:
    """(profile, launch) -> why serve's preflight would refuse to start it, off this node
    ("" where it would not, or where no options say how it is served). Variants that differ
    in nothing those checks read are judged once (each imports check runs the interpreter)."""
    from sm120kit.node.checks.serving import port_plan
    from sm120kit.serve import preflight

    said: dict[str, str] = {}

    def why(profile: Profile, launch: Launch) -> str:
        if options is None:
            return ""
        read = [launch.entry_points, sorted(launch.env.items()), profile.env, profile.patches, port_plan(profile)]
        key = json.dumps(read, sort_keys=True, default=str)
        if key not in said:
            failed = preflight.run(profile, launch, target, options, on_this_node=False).failed
            found = "; ".join(f"{c.id}: {c.detail}" + (f" (next: {c.fix})" if c.fix else "") for c in failed)
            said[key] = f"serve would refuse to start it: {found}" if failed else ""
        return said[key]

    return why


def _bad_variant(exc: UserError, variant: Variant, source: str, profile_name, profile_dirs, base_sets) -> UserError:
    """The loader's error, naming the --vary value (or the file's variant) at fault: each
    of a --vary combination's values is loaded alone to find it."""
    from sm120kit.profiles.loader import load_profile

    if source != "--vary":
        return UserError(f"{source}: [variants.{variant.name}]: {exc.message}", exc.hint)
    for word in variant.sets:
        try:
            load_profile(profile_name, profile_dirs, [*base_sets, word])
        except UserError as alone:
            return UserError(f"--vary {word}: {alone.message}", alone.hint)
    return UserError(f"--vary {', '.join(variant.sets)} (together): {exc.message}", exc.hint)


def _with_why(text: str, variant: Variant) -> str:
    return f"{text} ({variant.why})" if variant.why else text


def _fingerprint(profile: Profile) -> str:
    return json.dumps(profile.model_dump(mode="json", exclude={"name", "source"}), sort_keys=True)


def load_variants(
    args_vary: list[str] | None, args_variants: str | None, profile_dirs: list[str] | None
) -> tuple[list[Variant], str, str | None]:
    """(variants, source, the profile a file was written for) from --vary / --variants."""
    if args_vary:
        return vary_variants(args_vary), "--vary", None
    if args_variants is None:
        raise ValueError("load_variants needs --vary or --variants")  # bench checks one is given
    path = find_variants_file(args_variants, profile_dirs)
    found, meta = read_variants_file(path)
    return found, str(path), meta.get("profile")
