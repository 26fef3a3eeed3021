"""The installed sglang's command-line flags, read from its source with `ast` (importing sglang
to ask argparse would pull in torch and CUDA). One walk covers the three declaration styles:
- up to 0.5.13.post1, `parser.add_argument(...)` calls in `ServerArgs.add_cli_args`;
- 0.5.14 to 0.5.19, fields `name: A[T, "help" | Arg(...)]` on `ServerArgs`, which
  `arg_groups/arg_utils.py` registers, plus a few manual `add_argument` calls;
- 0.5.20 on, the same fields in namespace classes under `arg_groups/fields/`.
Choices named by a constant are followed through assignments, `+`, `list(...)`, class attributes
and imports. Choices computed at run time (parser registries, a set changed under an env check)
stay None, "unknown", so that no valid value is rejected. Plugins may extend the lists through
sglang's `add_*_choices()`; the schema holds the built-in values.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING, TypeGuard

from sm120kit.errors import UserError

if TYPE_CHECKING:
    from sm120kit.target import Distribution, Target

FORMAT = "1"  # bump when the reading rules change, so that cached schemas are read again
SERVER_ARGS, FIELDS = "sglang.srt.server_args", "sglang.srt.arg_groups.fields"
SWITCHES = {"store_true", "store_false", "store_const", "append_const", "count", "BooleanOptionalAction"}
MUTATORS = {"add", "append", "extend", "insert", "update", "remove", "discard", "pop", "clear"}
SCALARS = {"int": "int", "float": "float", "str": "str", "nullable_str": "str", "bool": "bool"}
# "Use --x=y instead", "(Deprecated, use --x)", "Alias for --x value.": a replacement named in prose
REPLACEMENT = re.compile(
    r"(?:\buse|alias for)\s+(--[\w-]+(?:=[^\s)'\",;]+|\s(?!instead)\w+(?=[.)]|$))?)", re.IGNORECASE
)
UNKNOWN = object()  # what reading the source cannot tell


@dataclass(frozen=True)
class Flag:
    name: str  # canonical spelling (argparse's first), e.g. "--moe-runner-backend"
    aliases: tuple[str, ...] = ()  # other accepted spellings
    takes_value: bool = True  # False for store_true/store_false style switches
    type: str | None = None  # "int" | "float" | "str" | "bool" | None (unknown)
    choices: tuple[str, ...] | None = None  # None: any value, or not knowable statically
    deprecated: bool = False
    replacement: str | None = None  # what to use instead, when the code says


@dataclass(frozen=True)
class FlagSchema:
    version: str
    flags: tuple[Flag, ...]

    @cached_property
    def _index(self) -> dict[str, Flag]:
        return {s: f for f in reversed(self.flags) for s in (f.name, *f.aliases)}

    def get(self, spelling: str) -> Flag | None:
        """The flag that `spelling` (name or alias; a `=value` tail is ignored) selects."""
        return self._index.get(spelling.split("=", 1)[0])

    def nearest(self, spelling: str) -> str | None:
        """The closest valid spelling, for "did you mean" messages."""
        found = difflib.get_close_matches(spelling.split("=", 1)[0], list(self._index), n=1)
        return found[0] if found else None


def _digest(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _leaf(node: ast.AST | None) -> str | None:
    """`int` -> "int", `argparse.BooleanOptionalAction` -> "BooleanOptionalAction", "x" -> "x"."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        return node.id if isinstance(node, ast.Name) else node.attr
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _named(node: ast.AST, name: str) -> bool:
    """Whether an assignment (or a mutating call's receiver) is to the plain name `name`."""
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _binding(body: list[ast.stmt], name: str) -> ast.AST | None:
    """What `name` is last bound to directly in `body` (a module or class body): value or class."""
    found: ast.AST | None = None
    for node in body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            found = node.value if _named(node, name) else found
    return found


def _mutated(tree: ast.Module, name: str) -> bool:
    """Whether import-time code changes `name` after binding it (`X.add(...)` under an env check,
    `X += ...`, a conditional re-assignment): its value then depends on the machine."""
    for top in (n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
        for node in ast.walk(top):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                node = node.func.value
            elif not (isinstance(node, ast.AugAssign) or (isinstance(node, ast.Assign) and node is not top)):
                continue
            if _named(node, name):
                return True
    return False


class UnreadableSource(ValueError):
    """A file of the release that is not Python this reader can parse (garbage, not UTF-8,
    NUL bytes, nested past the parser's limits); the message names it, by its path in the
    release, and why."""

    def __init__(self, relpath: str, why: str) -> None:
        super().__init__(f"{relpath}: {why}")
        self.relpath, self.why = relpath, why


def _parsed(data: bytes, relpath: str) -> ast.Module:
    try:
        return ast.parse(data, relpath)
    except SyntaxError as exc:  # garbage, a non-UTF-8 byte, a NUL byte
        where = f" (line {exc.lineno})" if exc.lineno else ""
        raise UnreadableSource(relpath, f"not Python sm120kit can read: {exc.msg}{where}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes (3.11), nesting past the parser's limits
        raise UnreadableSource(relpath, f"not Python sm120kit can read ({exc.__class__.__name__})") from None


class _Reader:
    """The release's modules, parsed on demand; `digests` records every file read."""

    def __init__(self, read: Callable[[str], bytes | None]) -> None:
        self._read = read
        self._trees: dict[str, ast.Module | None] = {}
        self.digests: dict[str, str | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            self._trees[dotted] = None
            base = dotted.replace(".", "/")
            for relpath in (base + ".py", base + "/__init__.py") if dotted.startswith("sglang.") else ():
                data = self._read(relpath)
                self.digests[relpath] = _digest(data)
                if data is not None:
                    self._trees[dotted] = _parsed(data, relpath)
                    break
        return self._trees[dotted]

    def lookup(self, mod: str, name: str, depth: int = 0) -> tuple[ast.AST, str] | None:
        """What `name` is bound to at the top of module `mod`, following `from x import name`."""
        tree = self.module(mod)
        if tree is None or depth >= 8:
            return None
        for node in reversed(tree.body):  # the last binding wins
            alias = next((a for a in getattr(node, "names", ()) if (a.asname or a.name) == name), None)
            if isinstance(node, ast.ImportFrom) and alias:
                package = mod.rsplit(".", node.level)[0] if node.level else ""
                return self.lookup(".".join(p for p in (package, node.module) if p), alias.name, depth + 1)
            value = _binding([node], name)
            if value is not None:
                return None if not isinstance(value, ast.ClassDef) and _mutated(tree, name) else (value, mod)
        return None

    def value(self, node: ast.AST, mod: str, cls: ast.ClassDef | None = None, depth: int = 0):
        """The Python value of a constant expression (lists, strings, numbers), else UNKNOWN."""

        def again(n):
            return self.value(n, mod, cls, depth + 1) if depth < 12 else UNKNOWN

        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items: list = []
            for elt in node.elts:
                inner = again(elt.value if isinstance(elt, ast.Starred) else elt)
                if inner is UNKNOWN or (isinstance(elt, ast.Starred) and not isinstance(inner, list)):
                    return UNKNOWN
                items += inner if isinstance(elt, ast.Starred) else [inner]
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = again(node.left), again(node.right)
            return left + right if type(left) is type(right) and isinstance(left, (list, str)) else UNKNOWN
        if isinstance(node, ast.Call) and _leaf(node.func) in ("list", "tuple", "set") and len(node.args) == 1:
            inner = again(node.args[0])
            return inner if isinstance(inner, list) else UNKNOWN
        if isinstance(node, ast.Name):
            local = _binding(cls.body, node.id) if cls else None  # a class body sees its own names
            found = (local, mod, cls) if local is not None else (*(self.lookup(mod, node.id) or (None, mod)), None)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # e.g. Backend.ALL
            owner = self.lookup(mod, node.value.id)
            owner_class = owner[0] if owner else None
            if owner and isinstance(owner_class, ast.ClassDef):
                found = (_binding(owner_class.body, node.attr), owner[1], owner_class)
            else:
                found = (None, mod, None)
        else:
            return UNKNOWN
        if found[0] is None or isinstance(found[0], ast.ClassDef):
            return UNKNOWN
        return self.value(found[0], found[1], found[2], depth + 1)


def _items(node: ast.expr) -> list[ast.expr]:
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def _subscript_of(node: ast.AST | None, *names: str) -> TypeGuard[ast.Subscript]:
    return isinstance(node, ast.Subscript) and _leaf(node.value) in names


def _strip_optional(node: ast.expr) -> ast.expr:
    """Optional[X], Union[X, None] and X | None -> X."""
    if _subscript_of(node, "Optional"):
        return node.slice
    members: list[ast.expr] = []
    if _subscript_of(node, "Union"):
        members = _items(node.slice)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        members = [node.left, node.right]
    rest = [m for m in members if not (isinstance(m, ast.Constant) and m.value is None)]
    return rest[0] if members and len(rest) == 1 else node


class _Builder:
    """Flags in registration order; the first registration of a spelling wins."""

    def __init__(self, reader: _Reader) -> None:
        self.reader = reader
        self.flags: dict[str, Flag] = {}

    def choices(self, node: ast.AST | None, mod: str) -> tuple[str, ...] | None:
        values = UNKNOWN if node is None else self.reader.value(node, mod)
        # argparse tests the converted value: None never matches, the rest compare as text
        return tuple(dict.fromkeys(str(v) for v in values if v is not None)) if isinstance(values, list) else None

    def nargs_default(self, action: ast.AST, mod: str) -> object:
        """A custom Action's own `nargs=` default (0: a bare switch), read from its __init__."""
        found = self.reader.lookup(mod, action.id) if isinstance(action, ast.Name) else None
        owner = found[0] if found else None
        body = owner.body if isinstance(owner, ast.ClassDef) else []
        for init in (n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
            params = init.args.args[len(init.args.args) - len(init.args.defaults) :] + init.args.kwonlyargs
            for param, default in zip(params, [*init.args.defaults, *init.args.kw_defaults]):
                if param.arg == "nargs" and isinstance(default, ast.Constant):
                    return default.value
        return None

    def add(
        self, names: list[str], kw: dict[str, ast.expr], mod: str, type_: str | None, choices: tuple[str, ...] | None
    ) -> None:
        action = kw.get("action")
        said = {
            k: self.reader.value(v, mod) for k, v in kw.items() if k in ("help", "new_flag", "nargs", "error_message")
        }
        if "nargs" in kw:
            takes_value = said["nargs"] != 0
        elif action is None or isinstance(action, ast.Constant) or _leaf(action) in SWITCHES:
            takes_value = _leaf(action) not in SWITCHES
        else:  # a custom Action class: Deprecated*Action, LoRAPathAction, ...
            takes_value = self.nargs_default(action, mod) != 0
        if _leaf(action) == "BooleanOptionalAction":  # argparse adds the --no-x spelling itself
            names = names + ["--no-" + n[2:] for n in names if n.startswith("--")]
        text = [said[k] if isinstance(said.get(k), str) else "" for k in ("help", "error_message")]
        deprecated = "Deprecated" in (_leaf(action) or "") or text[0].lstrip(" ([").lower().startswith("deprecat")
        # new_flag= is the code's own pointer; failing that, the help or error text may name one
        named = [m.group(1) for m in map(REPLACEMENT.search, text) if m]
        replacement = said["new_flag"] if isinstance(said.get("new_flag"), str) else next(iter(named), None)
        if names and names[0] not in self.flags:
            type_, replacement = (type_ if takes_value else "bool"), (replacement if deprecated else None)
            self.flags[names[0]] = Flag(
                names[0], tuple(names[1:]), takes_value, type_, choices, deprecated, replacement
            )

    def add_argument(self, call: ast.Call, mod: str) -> None:
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        type_ = SCALARS.get(_leaf(kw["type"]) or "") if "type" in kw else "str"  # argparse's default
        self.add(names, kw, mod, type_, self.choices(kw.get("choices"), mod))

    def add_field(self, node: ast.AnnAssign, mod: str) -> None:
        """A field `name: A[T, "help" | Arg(...)]`, registered as arg_utils does it: Optional[X] -> X,
        Literal -> choices, List[X] -> X values, bool -> store_true, no_cli -> no flag."""
        ann = node.annotation
        if not (isinstance(node.target, ast.Name) and _subscript_of(ann, "A", "Annotated")):
            return
        parts = _items(ann.slice)  # the first Arg(...) or help string is the CLI metadata; NS(...) is not
        meta = next((m for m in parts[1:] if not isinstance(m, ast.Call) or _leaf(m.func) == "Arg"), None)
        if meta is None:
            return
        kw = {k.arg: k.value for k in meta.keywords if k.arg} if isinstance(meta, ast.Call) else {"help": meta}
        if "no_cli" in kw and self.reader.value(kw["no_cli"], mod) is True:
            return
        cli_name, aliases = (self.reader.value(kw[k], mod) if k in kw else None for k in ("cli_name", "aliases"))
        names = [cli_name if isinstance(cli_name, str) else "--" + node.target.id.replace("_", "-")]
        names += [a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else []
        extra = kw.get("action_kwargs")
        if isinstance(extra, ast.Dict):
            # (a key that is not a string names no keyword that is read)
            kw.update(
                {
                    k.value: v
                    for k, v in zip(extra.keys, extra.values)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
            )
        inner = _strip_optional(parts[0])
        literal = _items(inner.slice) if _subscript_of(inner, "Literal") else None
        element = _strip_optional(inner.slice) if _subscript_of(inner, "List", "list") else inner
        if "action" not in kw and not literal and _leaf(inner) == "bool":
            kw["action"] = ast.Constant("store_true")
        if "type_parser" in kw:
            type_ = SCALARS.get(_leaf(kw["type_parser"]) or "")
        elif literal:  # typed like its first value
            type_ = SCALARS.get(type(self.reader.value(literal[0], mod)).__name__, "str")
        else:  # arg_utils types anything but int and float as str
            type_ = SCALARS.get(_leaf(element) or "", "str")
        choices = kw.get("choices") or (ast.List(elts=literal) if literal else None)
        self.add(names, kw, mod, type_, self.choices(choices, mod))


def _parse(version: str, reader: _Reader) -> FlagSchema:
    tree = reader.module(SERVER_ARGS)
    if tree is None:
        raise FileNotFoundError(f"sglang {version} has no {SERVER_ARGS.replace('.', '/')}.py")
    builder = _Builder(reader)
    # add_cli_args registers the fields first (0.5.20 on: of the namespace classes server_args
    # imports from arg_groups.fields), then makes its own add_argument calls
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(FIELDS)]
    for statement in imports:
        for alias in statement.names:
            found = reader.lookup(SERVER_ARGS, alias.asname or alias.name)
            if found is None:
                continue
            namespace, namespace_mod = found
            for field in namespace.body if isinstance(namespace, ast.ClassDef) else ():
                if isinstance(field, ast.AnnAssign):
                    builder.add_field(field, namespace_mod)
    # the class itself (0.5.20 on, the name is re-bound afterwards to a struct built from it)
    server_args = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"][-1:]
    for member in server_args[0].body if server_args else ():
        if isinstance(member, ast.AnnAssign):
            builder.add_field(member, SERVER_ARGS)
    for node in ast.walk(server_args[0]) if server_args else ():
        if isinstance(node, ast.Call) and _leaf(node.func) == "add_argument":
            builder.add_argument(node, SERVER_ARGS)
    return FlagSchema(version, tuple(builder.flags.values()))


def schema_from_sources(version: str, read: Callable[[str], bytes | None]) -> FlagSchema:
    """The schema of sglang `version`, whose files `read(relpath)` returns (None: no such file).
    Cached on disk under (format, version, sha256 of server_args.py); an entry is used only while
    the other files it was read from keep their sha256 too."""
    from sm120kit.patching import cache

    name = cache.key("flag-schema", FORMAT, version, _digest(read(SERVER_ARGS.replace(".", "/") + ".py")) or "")
    hit = cache.get(name) or {}
    try:
        if hit.get("format") == FORMAT and all(_digest(read(p)) == d for p, d in hit["digests"].items()):
            return FlagSchema(version, tuple(_flag_from_json(f) for f in hit["flags"]))
    except (KeyError, TypeError, AttributeError):
        pass  # a damaged entry: read the sources again
    reader = _Reader(read)
    schema = _parse(version, reader)
    cache.put(name, {"format": FORMAT, "digests": reader.digests, "flags": [asdict(f) for f in schema.flags]})
    return schema


def _flag_from_json(data: dict) -> Flag:
    choices = None if data["choices"] is None else tuple(data["choices"])
    return Flag(**{**data, "aliases": tuple(data["aliases"]), "choices": choices})


def installed_schema(
    target: Target, hint: str = "point sm120kit at the serving environment with --python EXE"
) -> FlagSchema:
    """The flag schema of the sglang installed in the target (sm120kit.target.Target); a
    UserError when there is none: a profile renders for the installed release."""
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: a profile renders for the installed release", hint
        )
    return read_schema(dist)


def read_schema(dist: Distribution) -> FlagSchema:
    """The flag schema of an installed sglang (a sm120kit.target.Distribution), read from its own
    files: site-packages, or the source tree of an editable install."""

    def read(relpath: str) -> bytes | None:
        try:
            return dist.file(relpath).read_bytes()
        except OSError:
            return None

    try:
        return schema_from_sources(dist.version, read)
    except FileNotFoundError as exc:  # a partial or damaged install
        raise UserError(
            f"{exc} (under {dist.file('sglang')}): cannot read its flags",
            f"reinstall it: pip install --force-reinstall --no-deps sglang=={dist.version}",
        ) from None
    except UnreadableSource as exc:  # a file of it damaged or edited into something else
        raise UserError(
            f"cannot read sglang {dist.version}'s flags: {dist.file(exc.relpath)} is {exc.why}",
            f"reinstall it: pip install --force-reinstall --no-deps sglang=={dist.version}",
        ) from None
