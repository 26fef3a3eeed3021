"""Finds and loads launch profiles: the user's directories first (--profile-dir, then
$SM120KIT_PROFILE_PATH), then the shipped set. A profile is `<dir>/<name>.toml`; the first
directory wins for a name, so a user profile replaces a shipped one of the same name.

Loading: read the TOML, resolve `extends` (depth first, in order; tables merge, lists and
values replace), apply `--set a.b=value` overrides, then validate. Every mistake is a
UserError naming the file (or the --set), the key and the next step.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import json
import math
import os
import sys
from pathlib import Path
from types import UnionType
from typing import Any, TypeGuard, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from sm120kit import search_paths
from sm120kit.errors import UserError
from sm120kit.profiles.model import Profile, allowed_range

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ENV_VAR = "SM120KIT_PROFILE_PATH"
LOADER_FIELDS = {"name", "source"}  # set by the loader, never by a file
Path_ = tuple[str | int, ...]


def shipped_dir() -> Path:
    return search_paths.shipped("profiles")


def search_path(dirs: list[str] | None = None) -> list[Path]:
    """--profile-dir DIRs, then $SM120KIT_PROFILE_PATH, then the shipped profiles."""
    return search_paths.search_path("profiles", "--profile-dir", ENV_VAR, dirs, shipped_dir())


def _index(dirs: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.toml")) if directory.is_dir() else []:
            found.setdefault(path.stem, path)
    return found


def list_profiles(dirs: list[str] | None = None) -> list[tuple[str, Path, str]]:
    """(name, path, description) of every profile, first directory wins; sorted by name.
    A file that does not parse is listed with the reason instead of its description."""
    rows = []
    for name, path in sorted(_index(search_path(dirs)).items()):
        try:
            description = _read(path).get("description", "")
            description = description if isinstance(description, str) else ""
        except UserError as exc:
            description = f"(cannot be read: {exc.message})"
        rows.append((name, path, description))
    return rows


def _unknown_profile(name: str, index: dict[str, Path], where: str = "") -> UserError:
    near = difflib.get_close_matches(name, index, n=1)
    return UserError(
        f"{where}unknown profile {name!r}"
        + (f"; did you mean {near[0]!r}?" if near else "")
        + f"; known: {', '.join(sorted(index)) or 'none'}",
        f"check the spelling, or add its directory with --profile-dir DIR or ${ENV_VAR}",
    )


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(
            f"{path}: TOML syntax error: {exc}", "fix the file there (TOML: key = value; strings in quotes)"
        ) from None
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8"
        ) from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to read", "flatten the arrays/tables in the file") from None
    except OSError as exc:
        raise UserError(
            f"{path}: cannot be read ({exc.strerror or exc})", "check the file and its permissions"
        ) from None


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: tables merge key by key, anything else in `over` replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _origins(data: dict, source: str, prefix: Path_ = ()) -> dict[Path_, str]:
    """Which file (or --set) wrote each key path: for error messages after a merge."""
    out: dict[Path_, str] = {}
    for key, value in data.items():
        path = (*prefix, key)  # (named: mypy reads out[(*prefix, key)] as 3.11's out[*prefix, key])
        out[path] = source
        if isinstance(value, dict):
            out.update(_origins(value, source, path))
    return out


def _extends(data: dict, path: Path) -> list[str]:
    value = data.get("extends")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise UserError(
        f"{path}: extends: expected a profile name or a list of names, got {_show(value)}",
        'write extends = "sm120-base" or extends = ["a", "b"]',
    )


def _resolve(name: str, path: Path, index: dict[str, Path], chain: list[str]) -> tuple[dict, dict[Path_, str]]:
    """The profile's data with its parents merged underneath, and where each key came from."""
    own = _read(path)
    data: dict = {}
    origins: dict[Path_, str] = {}
    for parent in _extends(own, path):
        if parent in chain:
            cycle = " -> ".join([*chain[chain.index(parent) :], parent])
            raise UserError(f"{path}: extends cycle: {cycle}", "remove one of these extends")
        if parent not in index:
            raise _unknown_profile(parent, index, f"{path}: extends: ")
        parent_data, parent_origins = _resolve(parent, index[parent], index, [*chain, parent])
        parent_data.pop("extends", None)
        data = _merge(data, parent_data)
        origins.update(parent_origins)
    return _merge(data, own), {**origins, **_origins(own, str(path))}  # own `extends` stays


# -- the shape of Profile, for --set paths, suggestions and "expected ..." -----------------


def _fields(model: type[BaseModel]) -> list[str]:
    return [k for k in model.model_fields if not (model is Profile and k in LOADER_FIELDS)]


def _is_model(t: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _type_at(path: Path_) -> Any:
    """The annotation at a key path of Profile; raises LookupError((depth, valid keys there))."""
    t: Any = Profile
    for depth, key in enumerate(path):
        if get_origin(t) in (Union, UnionType) and len(models := [a for a in get_args(t) if _is_model(a)]) == 1:
            t = models[0]  # an optional table ([fleet]): its keys
        if isinstance(t, type) and issubclass(t, BaseModel):
            if key not in _fields(t):
                raise LookupError(depth, _fields(t))
            t = t.model_fields[key].annotation
        elif get_origin(t) is dict and isinstance(key, str):
            t = get_args(t)[1]
        elif get_origin(t) is list and isinstance(key, int):
            t = get_args(t)[0]
        else:
            raise LookupError(depth, [])
    return t


def _expected(t: Any) -> str:
    if (isinstance(t, type) and issubclass(t, BaseModel)) or get_origin(t) is dict:
        return "a table"
    if get_origin(t) is list:
        return f"an array of {_expected(get_args(t)[0]).split(' ', 1)[1]}s"
    args = [a for a in get_args(t) if a is not type(None)]
    if args:
        return " or ".join(_expected(a) for a in args)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(t, getattr(t, "__name__", str(t)))


def _dotted(path: Path_) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else ("." if i else "") + k for i, k in enumerate(path))


def _show(value: Any) -> str:
    """A value as TOML would spell it (near enough), shortened."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan: TOML's spelling (JSON would say Infinity, NaN)
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _tables(model: type[BaseModel] = Profile, prefix: Path_ = ()):
    """(key path, model) of every table of a profile ([engine], [fleet], ...; not arrays of tables)."""
    yield prefix, model
    for key in _fields(model):
        t = model.model_fields[key].annotation
        if get_origin(t) in (Union, UnionType) and len(models := [a for a in get_args(t) if _is_model(a)]) == 1:
            t = models[0]
        if _is_model(t):
            yield from _tables(t, (*prefix, key))


def _relocated(path: Path_, depth: int, close: bool = False) -> list[Path_]:
    """The key paths the user meant when the key at `depth` belongs to another table: its
    section left out (max_running_requests: engine.max_running_requests) or the wrong one
    (engine.tp: parallel.tp). The same key elsewhere; with `close`, a close one."""
    key, rest = str(path[depth]), path[depth + 1 :]
    elsewhere = [(where, _fields(model)) for where, model in _tables() if where != path[:depth]]
    if close:
        near = {(*where, f): f for where, fields in elsewhere for f in fields}
        matches = set(difflib.get_close_matches(key, list(near.values()), n=3, cutoff=0.8))
        found = [candidate for candidate, f in near.items() if f in matches]
    else:
        found = [(*where, key) for where, fields in elsewhere if key in fields]
    moved = []
    for candidate in found:
        try:
            _type_at((*candidate, *rest))
        except LookupError:
            continue
        moved.append((*candidate, *rest))
    return moved


def _unknown_key(path: Path_, depth: int, options: list[str]) -> tuple[str, str]:
    """(message, hint) for a key path whose segment at `depth` is not in the model."""
    message, hint, _ = _meant(path, depth, options)
    return message, hint


def _meant(path: Path_, depth: int, options: list[str]) -> tuple[str, str, Path_ | None]:
    """_unknown_key's (message, hint), and the key path the user most likely meant (None:
    no guess). The same key in another table first (a section left out), then a close key
    in this table, then a close key in another."""
    prefix, key = path[:depth], str(path[depth])
    if not options:
        return f"{_dotted(path)}: {_dotted(prefix)} is a value, not a table", f"set {_dotted(prefix)} itself", None
    unknown = f"unknown key {_dotted(path[: depth + 1])}"
    near = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    moved = _relocated(path, depth) or ([] if near else _relocated(path, depth, close=True))
    if moved:
        where = _dotted(moved[0][: len(moved[0]) - len(path) + depth])
        hint = f"put it under [{where}]" if where else "put it at the top level"
        return f"{unknown}; did you mean {' or '.join(map(_dotted, moved))}?", hint, moved[0]
    if near:
        meant = (*prefix, near[0], *path[depth + 1 :])
        return f"{unknown}; did you mean {_dotted((*prefix, near[0]))}?", f"rename it to {near[0]}", meant
    where = f"under [{_dotted(prefix)}]" if prefix else "at the top level"
    return unknown, f"valid keys {where}: {', '.join(options)}", None


# -- --set -------------------------------------------------------------------------------


def parse_set(item: str, option: str = "--set") -> tuple[Path_, Any]:
    """KEY=VALUE -> (key path, value): the key checked against the profile's shape (a
    did-you-mean for an unknown one), the value TOML where it parses, else the text. The
    messages name `option` (--set, or bench's --vary)."""
    key, sep, raw = item.partition("=")
    path = tuple(key.strip().split("."))
    if not sep or not all(path):
        raise UserError(
            f"{option} {item!r}: expected KEY=VALUE with a dotted key, e.g. engine.max_running_requests=256",
            "write --set a.b=value",
        )
    if path[0] == "extends":
        raise UserError(
            f"{option} {item!r}: extends cannot be set with --set",
            "write extends in a profile file, or load the profile it names",
        )
    try:
        t = _type_at(path)
    except LookupError as exc:
        message, hint, meant = _meant(path, *exc.args)
        with contextlib.suppress(LookupError):
            if meant and _type_at(meant):
                hint = f"{option} {_dotted(meant)}={raw}"  # the one to write
        raise UserError(f"{option} {item!r}: {message}", hint) from None
    try:
        parsed = tomllib.loads(f"v = {raw}")
        value = parsed["v"] if parsed.keys() == {"v"} else raw
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw
    # a string field takes the text as written: --set model.served_name=2024 means "2024"
    accepted = get_args(t) if get_origin(t) in (Union, UnionType) else (t,)
    if not isinstance(value, str) and str in accepted and not any(a in accepted for a in (int, float, bool)):
        value = raw
    return path, value


def _set_label(item: str, path: Path_) -> str:
    """How a --set is named in messages; a value for a key flag (extra_args."--api-key") is
    not repeated: it is a secret typed where it does not belong."""
    if path[0] == "extra_args" and "key" in str(path[-1]).lower():
        return f"--set {'.'.join(map(str, path))}=***"
    return f"--set {item}"


def _nest(path: Path_, value: Any) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


# -- validation errors -------------------------------------------------------------------


def _data_path(loc: tuple, data: Any) -> Path_:
    """The part of a pydantic error location that names keys in the data (drops union tags)."""
    path: list = []
    for key in loc:
        if (isinstance(data, dict) and key in data) or (
            isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data)
        ):
            path.append(key)
            data = data[key]
        else:
            break
    return tuple(path)


def _source(path: Path_, origins: dict[Path_, str], default: str) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return default


def _field_at(path: Path_) -> FieldInfo | None:
    """The pydantic field at a key path of Profile (None inside a dict, list or unknown key)."""
    if len(path) < 1 or not all(isinstance(k, str) for k in path):
        return None
    try:
        owner = _type_at(path[:-1]) if len(path) > 1 else Profile
    except LookupError:
        return None
    is_model = isinstance(owner, type) and issubclass(owner, BaseModel)
    return owner.model_fields.get(str(path[-1])) if is_model else None


def _describe(err: ErrorDetails, data: dict) -> tuple[Path_, str, str]:
    path = _data_path(err["loc"], data)
    if err["type"] == "extra_forbidden":
        try:
            _type_at(path)
        except LookupError as exc:
            message, hint = _unknown_key(path, *exc.args)
            return path, message, hint
    where = _dotted(path) or "(profile)"
    if err["type"] == "owned_flag":  # extra_args naming a flag that a field renders
        owner = err["ctx"]["owner"]
        return (
            path,
            f"{where}: {err['msg']}",
            f"remove {path[-1]} from [extra_args]" + (f" and set {owner}" if owner else ""),
        )
    if err["type"] == "value_error":
        message = err["msg"].removeprefix("Value error, ")
        return path, message if message.startswith(where + ".") else f"{where}: {message}", "fix the value"
    field = _field_at(path)
    allowed = allowed_range(field) if field else None
    note = f"; allowed: {allowed}" if allowed else ""
    value = err.get("input")
    if isinstance(value, float) and not math.isfinite(value):
        return (
            path,
            f"{where}: {_show(value)} is not a finite number{note}",
            f"write {where.rsplit('.', 1)[-1]} as a finite number",
        )
    try:
        expected = _expected(_type_at(path))
    except LookupError:
        expected = "another value"
    if err["type"].endswith("_type") or err["type"] in ("int_from_float", "union_tag_invalid"):
        return (
            path,
            f"{where}: expected {expected}, got {_show(value)}{note}",
            f"write {where.rsplit('.', 1)[-1]} as {expected}",
        )
    return (
        path,
        f"{where}: {err['msg']} (got {_show(value)}){note}",
        "fix the value" + (f" ({allowed})" if allowed else ""),
    )


def _validate(name: str, source: str, data: dict, origins: dict[Path_, str]) -> Profile:
    reported: list[tuple[Path_, str, str]] = [
        ((key,), f"unknown key {key} ({key} is set by sm120kit)", "remove it")
        for key in sorted(LOADER_FIELDS & data.keys())
    ]
    profile: Profile | None = None
    try:
        profile = Profile.model_validate({k: v for k, v in data.items() if k not in LOADER_FIELDS})
    except ValidationError as exc:
        seen = {path for path, _, _ in reported}
        for err in exc.errors(include_url=False):
            path, message, hint = _describe(err, data)
            if path not in seen:  # a union reports once per member: keep the first
                seen.add(path)
                reported.append((path, message, hint))
    if reported or profile is None:  # (a validation error always reports something)
        lines = [f"{_source(path, origins, source)}: {message}" for path, message, _ in reported]
        more = f" (and {len(reported) - 1} more above)" if len(reported) > 1 else ""
        raise UserError(
            f"profile {name} is not valid:\n  " + "\n  ".join(lines),
            reported[0][2] + more,
        )
    return profile.model_copy(update={"name": name, "source": source})


# -- the public entry points -------------------------------------------------------------


def load_profile(name: str, dirs: list[str] | None = None, sets: list[str] | None = None) -> Profile:
    """The profile `name` (or a path ending in .toml) with its extends resolved, the --set
    overrides applied (KEY=VALUE; VALUE is TOML when it parses, else a string), validated."""
    index = _index(search_path(dirs))
    if name.endswith(".toml") or os.sep in name or "/" in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"profile file {path} does not exist", "give a profile name or the path of a .toml file")
        index = {**index, **_index([path.parent])}  # its own directory first, for its extends
        name = path.stem
    elif name in index:
        path = index[name]
    else:
        raise _unknown_profile(name, index)
    data, origins = _resolve(name, path, index, [name])
    for item in sets or []:
        key, value = parse_set(item)
        data = _merge(data, _nest(key, value))
        origins.update({key[:n]: _set_label(item, key) for n in range(1, len(key) + 1)})
    return _validate(name, str(path), data, origins)


def profile_schema() -> dict:
    """The JSON Schema of a profile file, for editor completion (taplo, Even Better TOML)."""
    schema = Profile.model_json_schema()
    schema["title"] = "sm120kit launch profile"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
