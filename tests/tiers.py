"""The two test tiers, told apart by reading the code each test runs (conftest.py marks them).

A test is `integration` when it needs one of these (each is also a marker of its own, so
`-m wheels` or `-m "not processes"` work too):

- wheels:    real sglang / flashinfer wheels (sm120kit.wheels.fetch, install, flashinfer_pin,
             latest, or the helpers of tests/support built on them: install, wheel_bytes,
             flashinfer_pin, the patch tests' harness);
- processes: a child process (the subprocess or multiprocessing modules, psutil.Popen,
             os.fork, os.system, os.exec*, os.spawn*, os.posix_spawn*: the CLI as a
             process, the stand-in server, the supervisor);
- router:    the real sglang-router (the sglang_router package);
- triton:    Triton (a compile through sm120kit.tune.aot, or the triton package).

"The code each test runs" is the test function, the fixtures it requests (pytest's closure
of them) and, followed by the names they use, every function and class defined under
tests/ (tests/support's helpers, a test module's own), plus a module's top-level
`import triton` or `import sglang_router` and any `slow` marker (it builds a
wheel or a venv).
Code in sm120kit itself is not followed (the CLI reaches everything): what it hides from
the test's own code is named below, with the reason: the sm120kit functions a test calls
that start processes or read wheels (CALL_USES), and the in-process CLI's commands and
options that do (COMMAND_USES, OPTION_USES, KEYWORD_USES, read from a call's literal
arguments). A new test file gets no default: it is classified by the same reading, and
conftest.py's run-time guard fails a fast-tier test that starts a process, fetches a wheel
or compiles with Triton all the same, so a miss shows on the first fast run.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import sys
import textwrap
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# A module whose use (any of its names) is a need.
MODULE_USES = {"subprocess": "processes", "multiprocessing": "processes", "sglang_router": "router", "triton": "triton"}
# A module whose import at a test module's top level is a need of every test there: that
# file exists to compile with Triton or to run the router (subprocess is imported everywhere).
MODULE_IMPORT_USES = {"sglang_router": "router", "triton": "triton"}
# os's calls that start a process or replace this one. Matched as os's attribute of that
# name: most are posix's builtins (os.fork.__module__ is "posix"), which a qualified name
# would miss, and the guard's wrapper of one is one too. conftest's guard watches this list.
OS_PROCESS_CALLS = tuple(
    name
    for name in (
        *("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"),
        *("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe"),
        *("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"),
    )
    if hasattr(os, name)
)
# A function whose use is a need, by its qualified name.
CALL_USES = {
    "sm120kit.wheels.fetch": "wheels",
    "sm120kit.wheels.install": "wheels",
    "sm120kit.wheels.flashinfer_pin": "wheels",
    "sm120kit.wheels.latest": "wheels",
    "sm120kit.wheels._pip_download": "wheels",
    "sm120kit.tune.aot.compile_for": "triton",
    "sm120kit.tune.aot.shared_bytes": "triton",
    "psutil.Popen": "processes",
    # sm120kit's own, called directly by tests: each starts processes or reads wheels inside.
    "sm120kit.node.checks.nccl.nccl_all_reduce": "processes",
    "sm120kit.tune.timing.time_candidates": "processes",
    "sm120kit.tune.worker_client.probe": "processes",
    "sm120kit.node.checks.nccl.probe": "processes",
    "sm120kit.tune.compare.compare_with_default": "processes",
    "sm120kit.node.checks.imports.judge": "processes",
    "sm120kit.tryout.run": "wheels",
    "sm120kit.resolution.run.resolve": "processes",  # sglang's resolution in the target's interpreter
    "sm120kit.node.checks.imports.probe": "processes",
    "sm120kit.tune.worker_client.Worker": "processes",
    # The module the callers above start their children through, called directly by its tests.
    "sm120kit.child_process.run": "processes",
    "sm120kit.child_process.LineChild": "processes",
}
# The CLI run in-process (the `cli` fixture): a command, or an option, that starts a process
# or reads wheels inside, read from a call's string arguments (`cli("try", "0.5.23")`).
COMMAND_USES = {  # render systemd / docker ask the serving python what it has
    ("try",): ("wheels", "processes"),
    ("render", "systemd"): ("processes",),
    ("render", "docker"): ("processes",),
}
OPTION_USES = {"--python": ("processes",), "--nccl-gpus": ("processes",)}  # a target interpreter; the NCCL probe
KEYWORD_USES = {"python": ("processes",)}  # resolve_target(python=...): the interpreter is run
# conftest's guard (support.fast_tier) names what it watches for; watching is not using.
NOT_READ = {"fast_tier_guard", "watch_fast_tier"}


def needs(item) -> set[str]:
    """What `item` (a collected pytest Function) needs: some of wheels, processes, router, triton."""
    found: set[str] = set()
    function = getattr(item, "function", None)
    if function is not None:
        found |= _uses(function)
    for fixture in _fixture_functions(item):
        found |= _uses(fixture)
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if _followable(value):  # a parametrized helper: `COMMANDS = {"status": lambda tmp: [...]}`
            found |= _uses(value)
    module = getattr(item, "module", None)
    if module is not None:
        found |= _module_uses(getattr(module, "__file__", None))
    if item.get_closest_marker("slow"):
        found.add("processes")
    return found


def _fixture_functions(item):
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures the test uses
    for name in set(getattr(item, "fixturenames", ())) - NOT_READ:
        # The definitions of a name, the one pytest runs last (a module's over a conftest's):
        # an overridden one runs only where the one over it requests it (`def serve(serve)`).
        for fixturedef in reversed(info.name2fixturedefs.get(name, ()) if info else ()):
            yield fixturedef.func
            if name not in fixturedef.argnames:
                break


def _defined_here(obj) -> bool:
    try:
        source = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return source is not None and Path(source).resolve().is_relative_to(TESTS)


def _qualname(obj) -> str | None:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else None


def _is_os_process_call(obj) -> bool:
    name = obj.__name__
    return name in OS_PROCESS_CALLS and getattr(os, name, None) is obj


def _need_of(obj) -> str | None:
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)) and _is_os_process_call(obj):
        return "processes"
    if isinstance(obj, types.ModuleType):
        return MODULE_USES.get(obj.__name__.split(".")[0])
    if (need := CALL_USES.get(_qualname(obj) or "")) is not None:
        return need
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return MODULE_USES.get(module.split(".")[0])
    return None


@functools.cache
def _module_uses(path: str | None) -> frozenset[str]:
    """A test module's top-level `import triton`, `from sglang_router... import ...` and the like."""
    if path is None:
        return frozenset()
    found = set()
    for statement in ast.parse(Path(path).read_text()).body:
        if isinstance(statement, ast.Import):
            names = [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            names = [statement.module]
        else:
            continue
        found.update(need for name in names if (need := MODULE_IMPORT_USES.get(name.split(".")[0])))
    return frozenset(found)


_seen: dict[object, frozenset[str]] = {}


def _uses(obj) -> frozenset[str]:
    """The needs of a function or class defined under tests/, followed through the names it uses."""
    if isinstance(obj, functools._lru_cache_wrapper):
        obj = obj.__wrapped__
    if obj in _seen:
        return _seen[obj]
    _seen[obj] = frozenset()  # a cycle adds nothing
    scope = sys.modules[obj.__module__].__dict__ if isinstance(obj, type) else getattr(obj, "__globals__", {})
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):  # a lambda in a table: the names its code loads
        tree = ast.Module([ast.Expr(ast.Name(name, ast.Load())) for name in _code_names(obj)], [])
    scope = {**scope, **_local_imports(tree)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found.update(_command_uses(node))
        for used in _resolve(node, scope):
            if (need := _need_of(used)) is not None:
                found.add(need)
            elif used is not obj and _followable(used) and getattr(used, "__name__", None) not in NOT_READ:
                found |= _uses(used)
    _seen[obj] = frozenset(found)
    return _seen[obj]


def _command_uses(call: ast.Call) -> set[str]:
    words = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    found = {
        need for command, needs in COMMAND_USES.items() if tuple(words[: len(command)]) == command for need in needs
    }
    for word in words:
        found.update(OPTION_USES.get(word, ()))
    for keyword in call.keywords:
        found.update(KEYWORD_USES.get(keyword.arg or "", ()))
    return found


def _code_names(obj) -> set[str]:
    names, codes = set(), [getattr(obj, "__code__", None)]
    while codes:
        if (code := codes.pop()) is not None:
            names |= set(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _local_imports(tree: ast.AST) -> dict:
    """The names a function imports for itself (`from support.sites import install`)."""
    names = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    names[alias.asname or top] = importlib.import_module(alias.name if alias.asname else top)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if hasattr(module, alias.name):
                        names[alias.asname or alias.name] = getattr(module, alias.name)
                    else:
                        names[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
        except Exception:  # what cannot be imported here is not read
            continue
    return names


def _followable(obj) -> bool:
    if isinstance(obj, functools._lru_cache_wrapper):
        obj = obj.__wrapped__
    return isinstance(obj, (type, types.FunctionType)) and _defined_here(obj)


_MISSING = object()


def _resolve(node: ast.AST, scope: dict):
    """The objects a Name (`install`) or an attribute chain (`wheels.fetch`) stands for."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load):
        return
    obj = scope.get(node.id, _MISSING)
    if obj is _MISSING:
        return
    yield obj
    for attr in reversed(chain):
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
            return
        yield obj
