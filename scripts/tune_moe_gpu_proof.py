#!/usr/bin/env python3
"""The GPU proof of tune-moe's timing: tune the Kimi-K2-class MoE shape on this machine's GPUs with
the installed sglang's own fused-MoE kernel (sm120kit.tune.timing and .compare, the code tune-moe
runs), then time sglang's default config against the tuned one per batch size in one worker run
(replay about replay, median of many), and print the table and the cost of the tune with its
projection to 8 GPUs.

    python scripts/tune_moe_gpu_proof.py --dtype fp8_w8a8 --out OUT_DIR
    python scripts/tune_moe_gpu_proof.py --dtype bf16 --sample 200 --budget 400 --out OUT_DIR

The shape: Kimi K2 (DeepseekV3ForCausalLM architecture: 384 routed experts, hidden 7168,
moe_intermediate_size 2048, top-8) at TP=8: 2048 / 8 = 256 per GPU (N=256 in sglang's file name).
E=384, the routed experts only (sglang's tuning script adds one for a fused shared expert where the
server fuses it). FP8 checkpoints use block [128, 128]; the INT4 checkpoint (compressed-tensors
W4A16, group 32) runs Marlin unless --moe-runner-backend triton, where it is int4_w4a16, [0, 32].

Candidates: sglang's tuning space for the shape (sm120kit.tune.space), or --fits FILE, a JSON list
of configs (e.g. those that fit sm_120, from tune-moe --plan --json), optionally a seeded sample of
--sample N of them (the full space takes hours on one GPU: see the projection printed at the end).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sm120kit.errors import UserError
from sm120kit.tune import compare, timing
from sm120kit.tune.shape import MoeShape
from sm120kit.tune.space import search_space

KIMI_K2 = {"experts": 384, "hidden": 7168, "intermediate": 256, "shard": 256, "top_k": 8}
DTYPES = {"bf16": (None, None), "fp8_w8a8": ("fp8_w8a8", (128, 128)), "int4_w4a16": ("int4_w4a16", (0, 32))}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def lpt_makespan(costs: list[float], workers: int, first_extra: float = 0.0) -> float:
    """The longest worker's time when batch sizes go, largest first, to the next free worker (as
    timing.time_candidates hands them out), each worker paying `first_extra` once."""
    loads = [(0.0, i) for i in range(workers)]
    started = set()
    for cost in sorted(costs, reverse=True):
        load, i = heapq.heappop(loads)
        extra = first_extra if i not in started else 0.0
        started.add(i)
        heapq.heappush(loads, (load + cost + extra, i))
    return max(load for load, _ in loads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp8_w8a8")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--fits", type=Path, help="a JSON list of candidate configs (instead of the whole space)")
    parser.add_argument("--sample", type=int, help="time a seeded random sample of this many candidates")
    parser.add_argument("--budget", type=float, help="seconds for the tune (what finishes is kept)")
    parser.add_argument("--repeats", type=int, default=50, help="replays per config in the default-vs-tuned run")
    parser.add_argument("--gpus", default="0")
    parser.add_argument("--compile-jobs", type=int, help="compile processes (default: timing's own choice)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the state and the JSON results")
    args = parser.parse_args()

    dtype, block = DTYPES[args.dtype]
    shape = MoeShape(**KIMI_K2, dtype=dtype, block_shape=block, model="Kimi-K2-class, TP=8")
    space = json.loads(args.fits.read_text()) if args.fits else search_space(shape)
    candidates = space
    if args.sample and args.sample < len(space):
        candidates = random.Random(0).sample(space, args.sample)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    gpus = [int(x) for x in args.gpus.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    python = Path(sys.executable)

    print(f"shape: {shape}", flush=True)
    print(f"candidates: {len(candidates)} of {len(space)} in the space; batch sizes {batch_sizes}; GPUs {gpus}")
    last = [0.0]

    def progress(done: int, total: int, detail: str) -> None:
        if time.monotonic() - last[0] > 30 or done == total:
            last[0] = time.monotonic()
            print(f"  tune: {done}/{total} candidates timed ({detail})", flush=True)

    try:
        tuned = timing.time_candidates(
            python,
            shape,
            batch_sizes,
            candidates,
            gpus,
            budget_s=args.budget,
            state_path=args.out / f"state-{args.dtype}.json",
            progress=progress,
            compile_jobs=args.compile_jobs,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.out / f"tune-{args.dtype}.json").write_text(json.dumps(tuned.as_json(), indent=1))
    print(f"\ntune: stop={tuned.stop.value}, {tuned.elapsed_s:.0f} s on {tuned.device}, {tuned.versions}")
    for note in tuned.notes:
        print(f"  note: {note}")
    print(f"{'batch':>6} {'default us':>11} {'best us':>9} {'speedup':>8} {'ok':>5} {'fail':>5} {'wrong':>5}  best")
    for row in tuned.rows:
        best = row.best or {}
        tile = (
            "-"
            if not best
            else (
                f"{best['BLOCK_SIZE_M']}x{best['BLOCK_SIZE_N']}x{best['BLOCK_SIZE_K']} "
                f"w{best['num_warps']} s{best['num_stages']} g{best['GROUP_SIZE_M']}"
            )
        )
        print(
            f"{row.batch_size:>6} {row.default_us or 0:>11.1f} {row.best_us or 0:>9.1f} {row.speedup or 0:>7.2f}x "
            f"{row.timed:>5} {row.failed:>5} {row.incorrect:>5}  {tile}"
        )

    best = tuned.best_configs()
    compared = compare.compare_with_default(python, shape, best, gpus[0], repeats=args.repeats)
    (args.out / f"compare-{args.dtype}.json").write_text(json.dumps([c.to_json() for c in compared], indent=1))
    print(f"\ndefault vs tuned, one worker run per table, {args.repeats} replays each, turn about (median):")
    print(f"{'batch':>6} {'default us':>11} {'tuned us':>9} {'speedup':>8}")
    for c in compared:
        if c.error:
            print(f"{c.batch_size:>6}  error: {c.error}")
        else:
            print(f"{c.batch_size:>6} {c.default_us or 0:>11.1f} {c.tuned_us or 0:>9.1f} {c.speedup or 0:>7.2f}x")

    rows = tuned.rows  # resumed ones too: their cost was measured by the run that timed them
    if rows:
        # The compile phase ran `compile_jobs` processes here; its CPU work, spread over an 8-GPU
        # node's compile processes (8 a GPU with 16 cores a GPU, as here), then the timing, one
        # worker per GPU, the batch sizes largest first to the next free worker.
        compile_work = tuned.compile_s * max(tuned.compile_jobs, 1)
        # a batch size that compiled in its timing worker (a compile process had died) counts
        # what a warm one costs there: its compile share is already in compile_work's kind
        warm_compile = sorted(r.compile_s for r in rows)[len(rows) // 2]
        costs = [r.elapsed_s - r.compile_s + warm_compile for r in rows]
        scale = len(space) / len(candidates)
        node_jobs = min(64, max(tuned.compile_jobs, 1) * 8)
        one = tuned.compile_s + lpt_makespan(costs, 1, 0.0)
        eight = compile_work / node_jobs + lpt_makespan(costs, 8, 0.0)
        resumed = f" ({len(tuned.resumed)} batch sizes timed by an earlier run)" if tuned.resumed else ""
        print(
            f"\ncost: {tuned.elapsed_s:.0f} s this run: compiling {tuned.compile_s:.0f} s on {tuned.compile_jobs} "
            f"processes; timing {sum(costs):.0f} s for {len(rows)} batch sizes{resumed} "
            f"({sum(costs) / len(rows) / len(candidates):.2f} s per candidate and batch size)"
        )
        print(
            f"projection for these {len(candidates)} candidates: 1 GPU {one / 60:.1f} min, "
            f"8 GPUs {eight / 60:.1f} min ({node_jobs} compile processes)"
        )
        if scale > 1:
            print(
                f"projection for the whole space ({len(space)} candidates, x{scale:.1f}): "
                f"1 GPU {one * scale / 60:.0f} min, 8 GPUs {eight * scale / 60:.0f} min"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
