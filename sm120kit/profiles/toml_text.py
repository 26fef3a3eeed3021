"""A resolved profile as TOML, the format profiles are written in: what `profile show` prints
for a user to copy into a profile. Only the subset a profile holds: tables, arrays of tables,
strings, integers, floats, booleans and arrays of them. A key without a value (None, which
TOML cannot spell) is a comment naming it; the text loads back as the same document less
those keys (tests/test_first_day_finish.py proves it for every shipped profile)."""

from __future__ import annotations

import json
import math
import re

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
LINE = 100  # an array longer than this: one item a line


def dumps(doc: dict) -> str:
    """`doc` (JSON-like: what pydantic's model_dump(mode="json") gives) as a TOML document."""
    lines: list[str] = []
    _table(doc, (), lines)
    return "\n".join(lines).strip("\n") + "\n"


def _is_table_array(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def _table(doc: dict, path: tuple[str, ...], lines: list[str], header: str | None = None) -> None:
    """A table's own keys, then its sub-tables (TOML gives every key after a header to that table)."""
    nested = {k: v for k, v in doc.items() if isinstance(v, dict) or _is_table_array(v)}
    if header:
        lines += ["", header]
    for key, value in doc.items():
        if key in nested:
            continue
        if value is None:
            lines.append(f"# {_key(key)}: not set")
        elif isinstance(value, list) and value and len(f"{_key(key)} = {_value(value)}") > LINE:
            lines += [f"{_key(key)} = [", *(f"    {_value(item)}," for item in value), "]"]  # one item a line
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in nested.items():
        sub = (*path, key)
        if isinstance(value, dict):
            _table(value, sub, lines, f"[{'.'.join(map(_key, sub))}]")
        else:
            for item in value:
                _table(item, sub, lines, f"[[{'.'.join(map(_key, sub))}]]")


def _key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    # JSON's escapes are TOML's (\" \\ \b \t \n \f \r \uXXXX); DEL, which JSON leaves raw, TOML does not
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, dict):  # a table inside an array of values: inline
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"TOML has no value for {value!r}")
