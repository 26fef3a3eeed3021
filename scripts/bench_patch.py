#!/usr/bin/env python3
"""Speed of the patch commands, as medians of several runs of the real CLI in a
subprocess (interpreter start included, as a user sees it).

    python scripts/bench_patch.py [--runs 7]

Run it with bytecode caching on (unset PYTHONDONTWRITEBYTECODE), as an installed tool runs.

  patch --check on an unpacked sglang 0.5.23   target < 0.5 s, within 3x of `import sm120kit`
  the same, patched                            target within 1.2x of the unpatched check (the
                                               ledger's validation is cached: no pydantic import)
  both with an empty outcome cache             target <= 0.3 s (the shipped seed,
                                               patches/outcomes.json, answers: no file is parsed)
  patch on an unpacked sglang 0.5.10           target < 3 s
  --help                                       target < 0.3 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sm120kit import wheels

CLI = [sys.executable, "-m", "sm120kit"]


def timed(cmd: list[str], ok=(0,), before=None, cold=False, seed=True) -> float:
    if before:
        before()
    env = dict(os.environ)
    if cold:  # an empty outcome cache: verdicts come from the shipped seed, or from parsing the file
        env["SM120KIT_CACHE_DIR"] = tempfile.mkdtemp()
    if not seed:
        env["SM120KIT_NO_OUTCOME_SEED"] = "1"
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {done.returncode}: {done.stderr.decode()}")
    return elapsed


def median(runs: int, *args, **kwargs) -> float:
    timed(*args, **kwargs)  # warm the page cache
    return statistics.median(timed(*args, **kwargs) for _ in range(runs))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        site23, site23p, site10 = Path(tmp) / "site23", Path(tmp) / "site23p", Path(tmp) / "site10"
        wheels.install(site23, "sglang", "0.5.23")
        wheels.install(site23p, "sglang", "0.5.23")
        subprocess.run([*CLI, "patch", "--site", str(site23p)], capture_output=True, check=True)
        wheels.install(site10, "sglang", "0.5.10")
        unpatch = lambda: subprocess.run([*CLI, "unpatch", "--site", str(site10)], capture_output=True, check=True)  # noqa: E731
        rows = [
            ("python -c 'import sm120kit' (baseline)", median(runs, [sys.executable, "-c", "import sm120kit"])),
            ("sm120kit --help", median(runs, [*CLI, "--help"])),
            # exit 1: the shared-memory and page-table patches would apply to a fresh 0.5.23
            (
                "sm120kit patch --check, sglang 0.5.23",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23)], ok=(1,)),
            ),
            (
                "  the same, outcome cache empty",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23)], ok=(1,), cold=True),
            ),
            (
                "  the same, outcome cache empty, no seed",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23)], ok=(1,), cold=True, seed=False),
            ),
            (
                "sm120kit patch --check, sglang 0.5.23 patched",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23p)]),
            ),
            (
                "  the same, outcome cache empty",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23p)], cold=True),
            ),
            (
                "  the same, outcome cache empty, no seed",
                median(runs, [*CLI, "patch", "--check", "--site", str(site23p)], cold=True, seed=False),
            ),
            ("sm120kit patch, sglang 0.5.10", median(runs, [*CLI, "patch", "--site", str(site10)], before=unpatch)),
            (
                "sm120kit patch --check, sglang 0.5.10 patched",
                median(runs, [*CLI, "patch", "--check", "--site", str(site10)]),
            ),
            (
                "  the same, outcome cache empty",
                median(runs, [*CLI, "patch", "--check", "--site", str(site10)], cold=True),
            ),
        ]
    base = rows[0][1]
    print(f"median of {runs} runs, {sys.implementation.name} {sys.version.split()[0]}")
    for name, seconds in rows:
        print(f"  {name:<48} {seconds * 1000:7.0f} ms   {seconds / base:5.1f}x baseline")
    timings = dict(rows)
    unpatched, patched = (
        timings["sm120kit patch --check, sglang 0.5.23"],
        timings["sm120kit patch --check, sglang 0.5.23 patched"],
    )
    print(f"  patch --check, 0.5.23 patched / unpatched: {patched / unpatched:.2f}x (target <= 1.2x)")
    cold = max(seconds for name, seconds in rows if name == "  the same, outcome cache empty")
    print(f"  patch --check with an empty outcome cache, the slowest: {cold * 1000:.0f} ms (target <= 300 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
