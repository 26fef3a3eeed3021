"""How long `sm120kit bench --serve --vary ... --dry-run` takes for 24 variants, against a
real sglang release (its wheel from the cache, unpacked as the tests do it, with the
flashinfer-python it pins) whose environment is reached through a `--python` shim, as on a
node: the command as a user runs it (a fresh process: Python's start, the imports, asking
that python for its site directories, loading the profile 25 times, reading the flag
schema, rendering every variant), and the planning alone, in this process.

    python scripts/bench_vary_dry_run.py [--runs 7] [--version 0.5.23]

The 24 variants: engine.max_running_requests 512/1024/2048 x cuda_graphs x radix_cache x
chunked_prefill_size 4096/8192 on glm5-nvfp4. The first command run fills the flag-schema
cache (sm120kit's outcome cache, as a first `profile check` does); it is reported apart
and the median is of the runs after it. Target: under 1 s. Needs the test extra.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

VARY = [
    "engine.max_running_requests=512,1024,2048",
    "engine.cuda_graphs=true,false",
    "engine.radix_cache=true,false",
    "engine.chunked_prefill_size=4096,8192",
]


def environment(root: Path, version: str) -> Path:
    """A python whose environment has sglang==version and its flashinfer-python (real files)."""
    from support.process_scope import scope_to_this_run
    from support.sites import install

    scope_to_this_run()  # as in the tests: an sglang the host runs is not this run's business

    site = root / "site-packages"
    site.mkdir(parents=True)
    install(site, version)
    shim = root / "python"
    shim.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f'os.environ["PYTHONPATH"] = {str(site)!r}\n'
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    shim.chmod(0o755)
    return shim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--version", default="0.5.23")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["SM120KIT_CACHE_DIR"] = str(tmp / "cache")  # a cold cache for the first run
        os.environ["SM120KIT_STATE_DIR"] = str(tmp / "state")
        python = environment(tmp / "env", args.version)
        argv = ["bench", "glm5-nvfp4", "--serve", "--python", str(python), "--dry-run"]
        argv += [w for v in VARY for w in ("--vary", v)]
        walls = []
        for _ in range(args.runs + 1):
            began = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "sm120kit", *argv], capture_output=True, text=True)
            walls.append(time.perf_counter() - began)
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                return 1
        planned = sum(line.split()[-1:] in (["runnable"], ["skipped"]) for line in done.stdout.splitlines())

        from sm120kit.bench import variant_plan, variant_reading
        from sm120kit.target import resolve_target

        target = resolve_target(str(python))
        found = variant_reading.vary_variants(VARY)
        inside = []
        for _ in range(args.runs):
            began = time.perf_counter()
            plan = variant_plan.plan("glm5-nvfp4", None, [], found, target, str(python), "--vary")
            inside.append(time.perf_counter() - began)
    print(f"sglang {args.version}: {len(found)} variants (+ as-written), {planned} listed by the command")
    print(f"  the command (a fresh process), first run, cold flag-schema cache: {walls[0]:.3f} s")
    print(f"  the command (a fresh process), median of {args.runs} runs after it: {statistics.median(walls[1:]):.3f} s")
    print(f"    (min {min(walls[1:]):.3f} s, max {max(walls[1:]):.3f} s)")
    print(f"  the planning alone (load + render 25 profiles), median of {args.runs}: {statistics.median(inside):.3f} s")
    print(f"  runnable {len(plan.runnable)}, skipped {len(plan.skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
