#!/usr/bin/env python3
"""What sglang's own resolution costs a launch check, per release: medians of several runs.

    python scripts/bench_resolution.py --python TORCH_PY --overlays DIR [--runs 5] [RELEASE ...]

The environments are the ones scripts/resolution_envs.py builds (each release beside a
PyPI torch, no GPU). For each release, one launch (GLM-5-NVFP4's model config, TP=8, the
node presented as 12.0):

  cold    a child starts, imports sglang, resolves: what a first `profile check` pays
  warm    the answer read from the resolution cache: every check after it with the same
          release, flags, environment, capability and config.json
  batch   the way-out search's shape: one child, eight launches (per launch)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm120kit.resolution import run  # noqa: E402

MODEL = ROOT / "scripts" / "resolution_models" / "glm5-nvfp4"


def argv(extra: list[str] | None = None) -> list[str]:
    return ["python", "-m", "sglang.launch_server", "--model-path", str(MODEL), "--tp", "8", *(extra or [])]


def timed(fn) -> float:
    started = time.perf_counter()
    answers = fn()
    assert all(a.ok or a.rejected for a in answers), [a.error for a in answers]
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True)
    parser.add_argument("--overlays", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("releases", nargs="*", default=["0.5.12.post1", "0.5.16", "0.5.23"])
    args = parser.parse_args()
    node = run.Node("12.0")
    print(f"{'release':<14}{'cold (s)':>10}{'warm (ms)':>11}{'batch of 8 (s/launch)':>24}")
    for release in args.releases:
        env = {"PYTHONPATH": os.pathsep.join([str(args.overlays / release), str(args.overlays / "common")])}
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SM120KIT_CACHE_DIR"] = cache

            def once(launches, use_cache, env=env, release=release):
                return lambda: run.resolve(args.python, launches, env, node, release, use_cache=use_cache)

            cold = [timed(once([argv()], False)) for _ in range(args.runs)]
            timed(once([argv()], True))
            warm = [timed(once([argv()], True)) for _ in range(args.runs)]
            batch = [
                argv(["--kv-cache-dtype", kv, "--mem-fraction-static", str(0.8 + i / 100)])
                for i, kv in enumerate(["auto", "bf16", "fp8_e4m3", "auto"] * 2)
            ]
            batched = [timed(once(batch, False)) / len(batch) for _ in range(max(2, args.runs // 2))]
        print(
            f"{release:<14}{statistics.median(cold):>10.2f}{statistics.median(warm) * 1000:>11.1f}"
            f"{statistics.median(batched):>24.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
