"""Issue 32, the house's third pass: a suite that stays fast as it grows, and tests that
cannot pass by skipping.

1  each in-process HTTP server a test starts stopped half a second late (serve_forever's
   default poll, which shutdown() waits out): they are all served by
   support.http_server.http_served;
2  a missing patch, module or fixture fails instead of skipping; the fast tier's guard and
   tests/tiers.py see every os call that starts a process (os.system, os.exec*, os.spawn*,
   os.posix_spawn*; tiers read os.fork and os.system by a qualified name that posix's
   builtins never have);
3  test support is code, not conftest: helpers live in tests/support/ and are imported by
   name; a conftest.py holds fixtures and hooks only and no file imports it, and no test
   module imports another (a test file is not a library)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import textwrap
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tiers
from support import patch_cases
from support.fast_tier import watch_fast_tier
from support.http_server import http_served
from support.inner_pytest import run_pytest
from support.paths import ROOT

TESTS = ROOT / "tests"
# The tests' own Python files; tests/fixtures holds the stand-in programs, run as processes.
TEST_SOURCES = sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)
# Every os call that starts a process or replaces this one.
OS_CALLS = (
    *("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"),
    *("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe"),
    *("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"),
)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """The calls of `name` or of `anything.name` in `tree`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)
    ]


# -- 1: the HTTP servers stop at once -----------------------------------------------------


class Ok(BaseHTTPRequestHandler):
    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(204)
        self.end_headers()


def test_a_served_http_server_stops_at_once_and_frees_its_port():
    import urllib.request

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    with http_served(server) as url, urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 204
        began = time.monotonic()
    took = time.monotonic() - began
    # shutdown() waits for the next poll: with the default, nearly 0.5 s after the request was served
    assert took < 0.45, f"stopping took {took:.2f} s: shutdown() waited out serve_forever's poll"
    assert server.socket.fileno() == -1  # closed: the port is free


def test_every_http_server_of_the_tests_is_served_by_http_served():
    """serve_forever's default poll makes each stop cost 0.5 s: a test serves through
    support.http_server.http_served, whose poll is short."""
    found = []
    for path in TEST_SOURCES:
        if path != TESTS / "support" / "http_server.py":
            served = [n for n in ast.walk(parsed(path)) if isinstance(n, ast.Attribute) and n.attr == "serve_forever"]
            found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in served]
    assert not found, f"serve_forever outside support.http_server.http_served: {found}"


# -- 2: nothing passes by skipping --------------------------------------------------------


def test_no_test_is_skipped_for_a_missing_module_and_every_skip_says_why():
    """What a test needs is imported (a missing one fails the run); a skip that stays (a
    machine that cannot mount, no strace) says why."""
    found = []
    for path in TEST_SOURCES:
        tree = parsed(path)
        where = path.relative_to(ROOT)
        found += [f"{where}:{c.lineno}: importorskip" for c in calls(tree, "importorskip")]
        for call in calls(tree, "skip"):
            if any(k.arg == "allow_module_level" for k in call.keywords):
                found.append(f"{where}:{call.lineno}: a whole module skipped")
            if not call.args and not any(k.arg == "reason" for k in call.keywords):
                found.append(f"{where}:{call.lineno}: a skip without a reason")
        for call in calls(tree, "skipif"):
            if not any(k.arg == "reason" for k in call.keywords):
                found.append(f"{where}:{call.lineno}: a skipif without a reason")
    assert not found, found


def test_a_renamed_patch_fails_the_tests_that_prove_it_instead_of_skipping_them():
    """Every patch test asks the harness for its patch by id (the smem patch's among them)."""
    raised: BaseException | None = None
    try:
        patch_cases.shipped_patch("sglang-triton-smem-sm120-renamed")
    except BaseException as e:  # a skip is an exception too: it must not be the one raised
        raised = e
    assert isinstance(raised, pytest.fail.Exception), repr(raised)
    assert "no shipped patch has the id sglang-triton-smem-sm120-renamed" in str(raised)
    assert "sglang-triton-smem-sm120" in str(raised)  # the ids there are, to find the new name by


def test_a_patch_range_that_selects_no_release_fails_instead_of_skipping():
    """A test parametrized on no release is skipped by pytest: the harness refuses that."""
    with pytest.raises(pytest.fail.Exception, match="no release to run on"):
        patch_cases.cases([])
    [case] = patch_cases.cases(["0.5.23"])
    assert (case.values, case.id) == (("0.5.23",), "0.5.23")  # the id a plain version would have


def test_the_tiers_read_the_fixture_pytest_runs_not_the_one_it_overrides():
    """tests/serve/test_metrics.py's own `serve` (a metrics server, in-process) overrides
    tests/serve/conftest.py's (a supervised stand-in, a process): only the one pytest runs
    is read, and the one below it too where it requests it (`def serve(serve)`)."""

    def below():
        pass

    def over():
        pass

    def item(*definitions):
        info = types.SimpleNamespace(name2fixturedefs={"serve": definitions})
        return types.SimpleNamespace(fixturenames=["serve"], _fixtureinfo=info)

    conftests = types.SimpleNamespace(func=below, argnames=("tmp_path", "env_python"))
    replacing = types.SimpleNamespace(func=over, argnames=())
    extending = types.SimpleNamespace(func=over, argnames=("serve",))
    assert list(tiers._fixture_functions(item(conftests, replacing))) == [over]
    assert list(tiers._fixture_functions(item(conftests, extending))) == [over, below]


def test_the_tiers_and_the_guard_know_every_os_call_that_starts_a_process():
    assert set(tiers.OS_PROCESS_CALLS) == {name for name in OS_CALLS if hasattr(os, name)}


@pytest.mark.parametrize("name", [n for n in OS_CALLS if hasattr(os, n)])
def test_the_tiers_read_an_os_call_that_starts_a_process(tmp_path, name):
    """A test that calls os.NAME itself is in the integration tier (`processes`)."""
    path = tmp_path / f"sample_{name}.py"
    path.write_text(f"import os\n\n\ndef sample():\n    os.{name}('x')\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert tiers._uses(module.sample) == {"processes"}


@pytest.mark.parametrize("name", [n for n in OS_CALLS if hasattr(os, n)])
def test_the_fast_tier_guard_watches_each_os_call_that_starts_a_process(monkeypatch, name):
    """Called out of the tiers' sight, each is noted; an exec fails at the call (it would end
    pytest itself). The call reaches a stand-in for os.NAME here: no process is started."""
    reached = []
    monkeypatch.setattr(os, name, lambda *args, **kwargs: reached.append(args))
    done = watch_fast_tier(monkeypatch)
    if name.startswith("exec"):
        with pytest.raises(pytest.fail.Exception, match=rf"fast tier but called processes \(os\.{name}\)"):
            getattr(os, name)("x")
        assert reached == []
    else:
        getattr(os, name)("x")
        assert reached == [("x",)]
    assert done == [f"processes (os.{name})"]


def test_a_fast_test_that_starts_a_process_out_of_the_tiers_sight_fails(tmp_path):
    """End to end: conftest as the plugin of a pytest run whose tests start processes in
    ways tiers.py cannot read; each fails, naming the call; the exec does not end pytest."""
    (tmp_path / "test_hidden.py").write_text(
        textwrap.dedent(
            """\
            import os
            import shlex
            import sys

            import pytest

            PY = sys.executable
            ARGS = {  # the call as a string: tiers.py cannot see it, only the guard can
                "system": (f"{shlex.quote(PY)} -c pass",),
                "posix_spawnp": (PY, [PY, "-c", "pass"], os.environ),
                "spawnv": (os.P_WAIT, PY, [PY, "-c", "pass"]),
                "execv": (PY, [PY, "-c", "pass"]),  # last: on a guard that lets it through, pytest ends here
            }


            @pytest.mark.parametrize("name", list(ARGS))
            def test_hidden(name):
                getattr(os, name)(*ARGS[name])
            """
        )
    )
    path = os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    args = ["-q", "-ra", "-p", "conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "test_hidden.py"]
    code, out = run_pytest(args, tmp_path, {"PYTHONPATH": path, "COLUMNS": "500"})  # the summary's lines whole
    assert code == 1, out
    said = {line.split("::", 1)[1].split(" - ")[0]: line for line in out.splitlines() if "::test_hidden[" in line}
    for name in ("system", "posix_spawnp", "spawnv", "execv"):  # a failure, at the call or at teardown
        assert "this test is in the fast tier but" in said.get(f"test_hidden[{name}]", ""), out
        assert f"processes (os.{name})" in said[f"test_hidden[{name}]"], out


# -- 3: test support is code, not conftest ------------------------------------------------


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in `tree`, in a function or not."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def imports_of_test_code(sources) -> list[str]:
    """Each import of conftest or of a test module (test_*) in `sources`."""
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}: imports {module}"
        for path in sources
        for line, module in imported_modules(ast.parse(path.read_text()))
        if module == "conftest" or module.startswith("test_")
    ]


def bound_names(target: ast.expr) -> list[str]:
    """The names an assignment binds (`a, *b = ...`); `os.environ[k] = v` binds none."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in bound_names(element)]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    return []


def public_non_fixtures(path: Path) -> list[str]:
    """What a conftest.py defines at its top level that is neither a fixture nor a hook
    (pytest_*) nor private (_name): functions, classes and assigned names."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            names = [] if fixture else [node.name]
        elif isinstance(node, ast.ClassDef):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [name for target in targets for name in bound_names(target)]
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {name}" for name in names if not name.startswith(("_", "pytest_"))]
    return found


def test_no_file_imports_conftest_or_a_test_module():
    """Helpers are imported from tests/support; a conftest is pytest's (fixtures, hooks) and a
    test module is a test, not a library. The scripts that borrow the tests' stand-ins too."""
    scripts = sorted((ROOT / "scripts").rglob("*.py"))
    assert not imports_of_test_code([*TEST_SOURCES, *scripts])


def test_a_conftest_defines_only_fixtures_and_hooks():
    conftests = [p for p in TEST_SOURCES if p.name == "conftest.py"]
    assert TESTS / "conftest.py" in conftests
    assert not [found for path in conftests for found in public_non_fixtures(path)]


def test_the_rules_of_test_support_see_what_they_forbid(tmp_path):
    """The scans above find each kind of breach, in a function as at the top."""
    (tmp_path / "test_a.py").write_text(
        "from conftest import install\n\n\ndef test_x():\n    import test_b\n    from test_c.sub import y\n"
    )
    assert imports_of_test_code([tmp_path / "test_a.py"]) == [
        "test_a.py:1: imports conftest",
        "test_a.py:5: imports test_b",
        "test_a.py:6: imports test_c",
    ]
    (tmp_path / "conftest.py").write_text(
        "import os, pytest\n\nWINDOW = ()\n_private = 1\nos.environ['X'] = '1'\n\n\n"
        "@pytest.fixture\ndef site():\n    pass\n\n\n"
        "def pytest_collection_modifyitems(items):\n    pass\n\n\ndef install():\n    pass\n\n\n"
        "class Cli:\n    pass\n"
    )
    assert public_non_fixtures(tmp_path / "conftest.py") == [
        "conftest.py:3: WINDOW",
        "conftest.py:17: install",
        "conftest.py:21: Cli",
    ]
