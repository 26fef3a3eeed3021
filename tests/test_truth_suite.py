"""Issue 32, the house's third pass: a suite that stays fast as it grows, and tests that
cannot pass by skipping.

1  each in-process HTTP server a test starts stopped half a second late (serve_forever's
   default poll, which shutdown() waits out): they are all served by conftest.http_served;
2  a missing patch, module or fixture fails instead of skipping; the fast tier's guard and
   tests/tiers.py see every os call that starts a process (os.system, os.exec*, os.spawn*,
   os.posix_spawn*; tiers read os.fork and os.system by a qualified name that posix's
   builtins never have)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tiers
from conftest import ROOT, http_served, watch_fast_tier

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
    assert took < 0.25, f"stopping took {took:.2f} s: shutdown() waited out serve_forever's poll"
    assert server.socket.fileno() == -1  # closed: the port is free


def test_every_http_server_of_the_tests_is_served_by_http_served():
    """serve_forever's default poll makes each stop cost 0.5 s: a test serves through
    conftest.http_served, whose poll is short."""
    found = []
    for path in TEST_SOURCES:
        if path != TESTS / "conftest.py":
            served = [n for n in ast.walk(parsed(path)) if isinstance(n, ast.Attribute) and n.attr == "serve_forever"]
            found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in served]
    assert not found, f"serve_forever outside conftest.http_served: {found}"


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


def test_a_renamed_smem_patch_fails_the_tests_that_prove_it_instead_of_skipping_them(monkeypatch):
    import test_smem_sm120 as smem

    monkeypatch.setattr(smem, "PATCH_ID", "sglang-triton-smem-sm120-renamed")
    smem.smem_patch.cache_clear()
    raised: BaseException | None = None
    try:
        smem.smem_patch()
    except BaseException as e:  # a skip is an exception too: it must not be the one raised
        raised = e
    finally:
        smem.smem_patch.cache_clear()
    assert isinstance(raised, pytest.fail.Exception), repr(raised)
    assert "no shipped patch has the id sglang-triton-smem-sm120-renamed" in str(raised)


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
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "500"}  # the summary's lines whole
    argv = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "conftest", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*argv, "--rootdir", str(tmp_path), str(tmp_path / "test_hidden.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    said = {line.split("::", 1)[1].split(" - ")[0]: line for line in out.splitlines() if "::test_hidden[" in line}
    for name in ("system", "posix_spawnp", "spawnv", "execv"):  # a failure, at the call or at teardown
        assert "this test is in the fast tier but" in said.get(f"test_hidden[{name}]", ""), out
        assert f"processes (os.{name})" in said[f"test_hidden[{name}]"], out
