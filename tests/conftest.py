"""Shared fixtures: real sglang releases unpacked into throwaway site directories, and the
CLI run in-process; and the two tiers.

Tiers: every test that needs real wheels, a child process, the router or Triton is marked
`integration` (and `wheels` / `processes` / `router` / `triton`) at collection, by reading
the code it runs: the rule and its table are in tests/tiers.py. `pytest -m "not integration"`
is the fast loop; plain `pytest` (the README's command, .ci/run) runs both tiers. A fast-tier
test that does start a process, fetch a wheel or compile with Triton all the same fails
(fast_tier_guard), naming what it did, so the rule's misses do not stay hidden.

What a test needs is imported, never skipped for: a missing module, patch or fixture fails
the run (tests/test_truth_suite.py keeps it so).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import re
import socketserver
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts the tests run in-process (conformance)

from sm120kit import wheels  # noqa: E402
from sm120kit.cli import main  # noqa: E402
from sm120kit.patching.registry import load_patches  # noqa: E402
from sm120kit.serve import procs  # noqa: E402

WINDOW = wheels.SGLANG_WINDOW
FIXTURE_PATCHES = ROOT / "tests" / "fixtures" / "patches"

# The files the shipped patches (and the fixture patch) touch, and those the flag schema is
# read from; unpacking just these and the dist-info keeps a release install fast.
MEMBERS = sorted({r.path for p in load_patches([str(FIXTURE_PATCHES)]) for r in p.rewrites}) + wheels.SCHEMA_SOURCES


# The host's processes are not the tests' business: scans see only this test run's
# descendants, and the orphans its servers leave are re-parented to it (not to PID 1).
procs.become_subreaper()
os.environ[procs.SCOPE] = str(os.getpid())

flashinfer_pin = functools.lru_cache(maxsize=None)(wheels.flashinfer_pin)


def install(site: Path, version: str, flashinfer: bool = True) -> Path:
    """sglang==version into `site` as pip would (replacing any other version), with the
    flashinfer-python release it pins. Returns sglang's dist-info."""
    pin = flashinfer_pin(version) if flashinfer else None
    if pin:
        wheels.install(site, "flashinfer-python", pin, MEMBERS)
    return wheels.install(site, "sglang", version, MEMBERS)


def raise_version(site: Path, package: str, new: str) -> Path:
    """The installed release of `package` as its next upstream release will look when its
    code is unchanged: the same files, the version raised (METADATA, the dist-info's name,
    RECORD's rows for it). Returns the new dist-info."""
    stem = package.replace("-", "_")
    [old] = site.glob(f"{stem}-*.dist-info")
    new_info = site / f"{stem}-{new}.dist-info"
    metadata = (old / "METADATA").read_text()
    (old / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {new}", metadata, count=1, flags=re.M))
    record = (old / "RECORD").read_text()
    (old / "RECORD").write_text(record.replace(f"{old.name}/", f"{new_info.name}/"))
    old.rename(new_info)
    return new_info


def replace_installed(site: Path, package: str, relpath: str, data: bytes) -> None:
    """A release whose file differs from the one installed: new bytes, and RECORD's hash
    for them (as the wheel of that release would have it)."""
    (site / relpath).write_bytes(data)
    [dist_info] = site.glob(f"{package.replace('-', '_')}-*.dist-info")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rows = [
        f"{relpath},sha256={digest},{len(data)}" if line.startswith(f"{relpath},") else line
        for line in (dist_info / "RECORD").read_text().splitlines()
    ]
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n")


def patch_dir(root: Path, package: str, name: str, source: str) -> Path:
    """A --patch-dir holding one user patch module: root/<package>/<name>.py."""
    (root / package).mkdir(parents=True, exist_ok=True)
    (root / package / f"{name}.py").write_text(source)
    return root


def next_release(version: str) -> str | None:
    i = WINDOW.index(version)
    return WINDOW[i + 1] if i + 1 < len(WINDOW) else None


@functools.cache
def wheel_bytes(version: str, relpath: str, package: str = "sglang") -> bytes:
    with zipfile.ZipFile(wheels.fetch(package, version)) as zf:
        return zf.read(relpath)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One sm120kit cache for the whole run, never the user's: a transform's verdict on a
    file is a pure function of its bytes, so tests of the same release share it warm."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def private_caches(request, session_cache, tmp_path_factory, monkeypatch) -> None:
    """The session's warm sm120kit cache ($SM120KIT_CACHE_DIR; an empty one of its own for a
    test marked cold_cache), a flashinfer JIT cache root of each test's own (patching
    flashinfer removes that version's JIT cache: never the machine's), no outcome seed, no
    CUDA toolkit."""
    cold = request.node.get_closest_marker("cold_cache")
    monkeypatch.setenv("SM120KIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache") if cold else session_cache))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path_factory.mktemp("flashinfer-home")))
    # The shipped outcome seed (patches/outcomes.json) off: the tests exercise the transforms,
    # which the seed would answer for (tests/test_outcome_seed.py turns it on).
    monkeypatch.setenv("SM120KIT_NO_OUTCOME_SEED", "1")
    # No CUDA toolkit unless a test gives one: the host's nvcc must not decide a launch rule.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path_factory.getbasetemp() / "no-cuda-toolkit"))


@pytest.fixture
def site(tmp_path: Path) -> Path:
    path = tmp_path / "site-packages"
    path.mkdir()
    return path


class Cli:
    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> tuple[int, dict]:
        import json

        code, out, _ = self(*argv, "--json")
        return code, json.loads(out)


@pytest.fixture
def cli(capsys) -> Cli:
    return Cli(capsys)


FAKE_EPOCH = 1_800_000_000.0  # a fake clock's wall time at its monotonic 0


class FakeClock:
    """serve's and the fleet's Clock for their state machines, moved only by sleep()."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return FAKE_EPOCH + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# How often a test's HTTP server looks for a shutdown request: shutdown() waits for the next
# look, and serve_forever's default (0.5 s) made each stop cost half a second.
SERVER_POLL_S = 0.01


@contextlib.contextmanager
def http_served(server: socketserver.BaseServer) -> Iterator[str]:
    """Serve `server` (bound to 127.0.0.1) from a daemon thread; yields its URL. On exit it
    stops within SERVER_POLL_S and frees its port."""
    threading.Thread(target=server.serve_forever, args=(SERVER_POLL_S,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (ledger included) with its bytes: "nothing changed" means equal."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock"
    }


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        found = tiers.needs(item)
        for need in sorted(found):
            item.add_marker(need)
        if found:
            item.add_marker("integration")


def watch_fast_tier(monkeypatch) -> list[str]:
    """Wrap what a fast-tier test must not use (a child process, a wheel fetch, a Triton
    compile); returns the list that notes each use, as "processes (os.system)"."""
    done: list[str] = []

    def watch(owner, name: str, need: str, replaces_this_process: bool = False) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def watched(*args, **kwargs):
            done.append(f"{need} ({getattr(owner, '__name__', owner)}.{name})")
            if replaces_this_process:  # an exec would end pytest itself: nothing left to fail the test
                pytest.fail(f"this test is in the fast tier but called {done[-1]}", pytrace=False)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    import subprocess

    from sm120kit.tune import aot

    watch(subprocess.Popen, "__init__", "processes")
    for name in tiers.OS_PROCESS_CALLS:
        watch(os, name, "processes", replaces_this_process=name.startswith("exec"))
    watch(wheels, "fetch", "wheels")
    watch(wheels, "_pip_download", "wheels")
    watch(aot, "compile_for", "triton")
    return done


@pytest.fixture(autouse=True)
def fast_tier_guard(request, monkeypatch):
    """A test left in the fast tier fails when it did what the tier promises it does not."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    done = watch_fast_tier(monkeypatch)
    yield
    if done:
        pytest.fail(
            f"this test is in the fast tier but used {', '.join(dict.fromkeys(done))}: "
            "teach tests/tiers.py to see it (its tables name what sm120kit's code hides)",
            pytrace=False,
        )
