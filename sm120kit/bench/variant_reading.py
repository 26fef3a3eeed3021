"""The variants a search is asked for, read from the command line or a file:

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

Separate from the plan (variant_plan.py), which loads and renders them: this is the input's
syntax and its mistakes, with no profile and no environment.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

from sm120kit.bench.variants import BASELINE, Variant, set_word
from sm120kit.errors import UserError

NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
FILE_KEYS = ("profile", "description", "variants")
VARIANT_KEYS = ("description", "set", "requires", "why")
PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
VARIANTS_DIR = "variants"  # under each profile directory
MAX_VARIANTS = 1000  # a cartesian product past this is a typo, not a search
MAX_NAME = 120  # a variant's name is its directory's: a long --vary name is cut, with a digest
RESERVED = frozenset({"search.json", "summary.md", "results.csv", "plot.png"})  # the search's own files


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
