"""Would `python -m MODULE` find every package it imports? Read, never imported.

This file's text runs in the TARGET's interpreter (the one that serves sglang), started by
sm120kit.node.checks.imports as `<python> -c <this text> MODULE [?MODULE ...]` with the
server's environment, so that it sees the sys.path the server will (PYTHONPATH, .pth files,
the current directory, as `-m` has it). It uses the standard library alone and imports
nothing of the target: sglang's imports pull in torch and CUDA, which a check must not load.

What it reads: each MODULE's source, the packages above it (`-m` imports them first) and,
transitively, every module of the same top-level package that those import at module level
and unconditionally (an import inside an if, a try, a function or a class may never run:
it is not followed, so nothing optional is ever demanded). A MODULE written `?MODULE` is
followed where it exists (a module that MODULE starts by default, imported inside a
function). Every other top-level package named by those imports is looked up with
importlib.util.find_spec, which finds a package without importing it.

Output: one JSON object on stdout:

    {"python": sys.executable, "version": "3.11.7", "files": 1059,
     "absent": ["sglang.launch_server"],                       required MODULEs that are not there
     "missing": {"numpy": "sglang/srt/utils/common.py:84"},    not found: where Python would first
                                                               import each (the first one first)
     "found": ["aiohttp", ...],                                found
     "unread": ["sglang/x.py: SyntaxError: ..."]}              files on the way that cannot be read
"""

import ast
import importlib.util
import json
import os
import re
import sys

MAX_FILES = 20000  # a bound on the walk; sglang 0.5.23's server reaches about 1,100
COLUMN_0_IMPORT = re.compile(r"^(?:import|from)[ \t][^\n]*", re.M)


def module_level_imports(source):
    """(module, level, names, line) of each import statement at the module's top level."""
    found = []
    for node in _parse(source).body:
        if isinstance(node, ast.Import):
            found += [(alias.name, 0, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module, node.level, [alias.name for alias in node.names], node.lineno))
    return found


def _parse(source):
    """The file up to the end of its last column-0 import (sglang's files hold them at the
    top: a tenth of the text, parsed 15 times faster); the whole file where that prefix
    does not parse on its own (the cut fell inside a string or a bracket)."""
    last = None
    for found in COLUMN_0_IMPORT.finditer(source):
        last = found
    if last is None:
        return ast.Module(body=[], type_ignores=[])
    end = last.end()
    if "(" in last.group(0) and ")" not in last.group(0):  # from x import (\n a,\n b,\n)
        end = source.find(")", end)
        end = len(source) if end < 0 else _line_end(source, end)
    while 0 < end < len(source) and source[end - 1] == "\\":  # a backslash continues the line
        end = _line_end(source, end + 1)
    try:
        return ast.parse(source[:end])
    except SyntaxError:
        return ast.parse(source)


def _line_end(source, at):
    end = source.find("\n", at)
    return len(source) if end < 0 else end


class Package:
    """A top-level package's directories, found as the interpreter finds it (not imported)."""

    def __init__(self, name):
        self.name = name
        spec = _find(name)
        self.dirs = list(spec.submodule_search_locations or []) if spec is not None else []

    def locate(self, module):
        """(source file or None, is a package) of a module of this package; (None, None)
        where it has none."""
        parts = module.split(".")[1:]
        for base in self.dirs:
            path = os.path.join(base, *parts)
            if os.path.isfile(os.path.join(path, "__init__.py")):
                return os.path.join(path, "__init__.py"), True
            if os.path.isfile(path + ".py"):
                return path + ".py", False
            if parts and os.path.isdir(path):
                return None, True  # a namespace package
            head = os.path.dirname(path)
            if (
                parts
                and os.path.isdir(head)
                and any(f.startswith(parts[-1] + ".") and f.endswith((".so", ".pyd")) for f in os.listdir(head))
            ):
                return None, False  # a compiled module: no source to read, there all the same
        if not parts and self.dirs:
            return None, True
        return None, None

    def relpath(self, path):
        for base in self.dirs:
            if path.startswith(base + os.sep):
                return self.name + "/" + path[len(base) + 1 :].replace(os.sep, "/")
        return path


def _find(name):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a finder that refuses: as good as not found
        return None


def _absolute(module, level, importer, is_package):
    if not level:
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def walk(roots):
    """Each root's packages, then the root, depth first in the order of the imports, as
    Python imports them: where a package is first imported is where the server would fail."""
    required = {r for r in roots if not r.startswith("?")}
    roots = [r.lstrip("?") for r in roots]
    packages = {}
    for root in roots:
        top = root.split(".")[0]
        if top not in packages:
            packages[top] = Package(top)
    state = {"seen": set(), "files": 0, "absent": [], "unread": [], "needs": {}}

    def enter(module):
        """The modules `module` imports, one by one (None: nothing to read)."""
        if module in state["seen"] or state["files"] >= MAX_FILES:
            return None
        state["seen"].add(module)
        package = packages[module.split(".")[0]]
        path, is_package = package.locate(module)
        if is_package is None and module in required:
            state["absent"].append(module)
        if path is None:
            return None
        state["files"] += 1
        try:
            with open(path, "rb") as fh:
                statements = module_level_imports(fh.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
            state["unread"].append(f"{package.relpath(path)}: {type(exc).__name__}: {exc}")
            return None
        return _imported(statements, module, is_package, package.relpath(path))

    def _imported(statements, module, is_package, where):
        for name, level, names, line in statements:
            target = _absolute(name, level, module, is_package)
            top = target.split(".")[0]
            if top in packages:
                parts = target.split(".")
                yield from (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                yield from (f"{target}.{n}" for n in names if n != "*")  # where a name is a module
            elif top and top != "__future__":
                state["needs"].setdefault(top, f"{where}:{line}")

    for root in roots:
        parts = root.split(".")
        for module in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            stack = [enter(module)]
            while stack:
                if stack[-1] is None:
                    stack.pop()
                    continue
                following = next(stack[-1], StopIteration)
                if following is StopIteration:
                    stack.pop()
                else:
                    stack.append(enter(following))
    needs = state["needs"]
    missing = {top: where for top, where in needs.items() if _find(top) is None}
    return {
        "python": sys.executable,
        "version": ".".join(map(str, sys.version_info[:3])),
        "files": state["files"],
        "absent": state["absent"],
        "missing": missing,
        "found": sorted(set(needs) - set(missing)),
        "unread": state["unread"][:20],
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(walk(sys.argv[1:])) + "\n")
