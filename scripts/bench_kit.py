#!/usr/bin/env python3
"""Speed of the kit's everyday reads, as medians of several runs of the real CLI in a
subprocess (interpreter start included, as a user sees it).

    python scripts/bench_kit.py [--runs 9]
    PYTHONPATH=<a checkout of another commit> python scripts/bench_kit.py   # that commit's code

The second line measures another commit the same way (the children inherit PYTHONPATH and
run in a scratch directory, so that no sm120kit of the working directory comes first), e.g.
the baseline: `git worktree add /tmp/base HEAD`. The children run with bytecode caching on
(PYTHONDONTWRITEBYTECODE unset), as an installed tool runs.

  patch --check, a release the shipped seed does not cover    target <= 0.3 s: the patches'
    (sglang 0.5.23's code as 0.5.24.dev0, a build of main),   quick reads (ast and tokens)
    outcome cache empty                                       decide, no libcst is imported
  the same, outcome cache warm
  patch --check, sglang 0.5.23 (the seed covers it), empty
  ps with one record (a live supervisor)                      no pydantic: the record is
                                                              plainly valid
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

import sm120kit
from sm120kit import wheels
from sm120kit.patching.registry import load_patches

CLI = [sys.executable, "-m", "sm120kit"]
UNCOVERED = "0.5.24.dev0"  # newer than the window: the seed has no verdict for it
# `python -m` and `-c` put the working directory first on sys.path: the children run in one
# that holds no sm120kit (made in main), so they import the code this script imported.
SCRATCH = Path.cwd()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


def timed(cmd: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, env=env, cwd=SCRATCH)
    elapsed = time.perf_counter() - start
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return elapsed


def median(runs: int, cmd: list[str], ok: tuple[int, ...] = (0,), cold: bool = False, **env: str) -> float:
    """The median of `runs` runs after one to warm the page cache (and, warm, the outcome cache);
    cold: each run with an empty outcome cache of its own."""

    def once() -> float:
        cache = {"SM120KIT_CACHE_DIR": tempfile.mkdtemp(dir=SCRATCH)} if cold else {}
        return timed(cmd, _env(**env, **cache), ok)

    once()
    return statistics.median(once() for _ in range(runs))


def imports(module: str, argv: list[str], **env: str) -> bool:
    """Whether the command imports `module` (run once in a child, in-process CLI)."""
    code = (
        "import sys\nfrom sm120kit.cli import main\n"
        f"code = main({argv!r})\nprint({module!r} in sys.modules)\nsys.exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(**env), cwd=SCRATCH)
    return done.stdout.strip().splitlines()[-1:] == ["True"]


def raise_version(site: Path, package: str, new: str) -> None:
    """The installed release as a newer build with the same code: METADATA's version, the
    dist-info's name and RECORD's rows for it (as tests/support/sites.py's raise_version)."""
    [old] = site.glob(f"{package.replace('-', '_')}-*.dist-info")
    new_info = site / f"{package.replace('-', '_')}-{new}.dist-info"
    metadata = (old / "METADATA").read_text()
    (old / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {new}", metadata, count=1, flags=re.M))
    (old / "RECORD").write_text((old / "RECORD").read_text().replace(f"{old.name}/", f"{new_info.name}/"))
    old.rename(new_info)


def install(site: Path, version: str) -> None:
    """sglang `version` and the flashinfer-python it pins, the files the patches read."""
    members = sorted({r.path for p in load_patches() for r in p.rewrites})
    if pin := wheels.flashinfer_pin(version):
        wheels.install(site, "flashinfer-python", pin, members)
    wheels.install(site, "sglang", version, members)


def one_record(state: Path) -> None:
    """A run record as a live supervisor writes it: this process stands in for the supervisor."""
    run = state / "serve" / "glm5-nvfp4"
    run.mkdir(parents=True)
    me = psutil.Process()
    now = time.time()
    record = {
        "profile": "glm5-nvfp4",
        "status": "ready",
        "supervisor_pid": me.pid,
        "supervisor_started": me.create_time(),
        "since": now - 3600,
        "server_pid": me.pid,
        "restarts": 0,
        "host": "127.0.0.1",
        "port": 30000,
        "marker": "bench",
        "last_health": {"at": now - 5, "ok": True, "detail": "generate 200", "seconds": 0.2},
    }
    (run / "state.json").write_text(json.dumps(record, indent=2))


def main() -> int:
    global SCRATCH
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        SCRATCH = Path(tmp)
        covered, uncovered, state = Path(tmp) / "covered", Path(tmp) / "uncovered", Path(tmp) / "state"
        install(covered, "0.5.23")
        install(uncovered, "0.5.23")
        raise_version(uncovered, "sglang", UNCOVERED)
        one_record(state)
        check = [*CLI, "patch", "--check", "--site"]
        warm_cache = tempfile.mkdtemp(dir=tmp)
        # exit 1: patches would apply to a fresh release
        rows = [
            ("python -c 'import sm120kit' (baseline)", median(runs, [sys.executable, "-c", "import sm120kit"])),
            ("sm120kit --help", median(runs, [*CLI, "--help"])),
            (
                f"patch --check, sglang {UNCOVERED} (not seeded), cache empty",
                median(runs, [*check, str(uncovered)], ok=(1,), cold=True),
            ),
            (
                "  the same, cache warm",
                median(runs, [*check, str(uncovered)], ok=(1,), SM120KIT_CACHE_DIR=warm_cache),
            ),
            (
                "patch --check, sglang 0.5.23 (seeded), cache empty",
                median(runs, [*check, str(covered)], ok=(1,), cold=True),
            ),
            ("ps, one record", median(runs, [*CLI, "ps"], SM120KIT_STATE_DIR=str(state))),
        ]
        libcst = imports(
            "libcst",
            ["patch", "--check", "--site", str(uncovered)],
            SM120KIT_CACHE_DIR=tempfile.mkdtemp(dir=tmp),
        )
        pydantic = imports("pydantic", ["ps"], SM120KIT_STATE_DIR=str(state))
    base = rows[0][1]
    code = Path(sm120kit.__file__).parent.parent
    print(f"median of {runs} runs, {sys.implementation.name} {sys.version.split()[0]}, the code of {code}")
    for name, seconds in rows:
        print(f"  {name:<58} {seconds * 1000:6.0f} ms  {seconds / base:5.1f}x baseline")
    print(
        f"  the uncovered cold check imports libcst: {'yes' if libcst else 'no'}; ps imports pydantic: "
        f"{'yes' if pydantic else 'no'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
