"""How fast the supervisor notices, stops and idles, against the sglang stand-in
(tests/fixtures/sglang_standin.py, a test fixture: the real server needs GPUs).

    python scripts/bench_serve.py [--runs 7] [--idle-seconds 30]

- death -> noticed: from the moment a scheduler fails (the stand-in stamps it, then
  sends SIGQUIT to its launcher, which kills its tree, as sglang does) to the moment the
  supervisor records the death. Target: under 1 s.
- SIGTERM -> all gone: a TP=8 tree (launcher, 8 schedulers, detokenizer: 10 processes)
  that honours SIGTERM, from the signal to the supervisor until no process of the tree is
  left (watched from outside), and the supervisor's own count of its stop.
- idle CPU: the supervisor's CPU time while the server is ready, the log quiet and the
  probe every 10 s (the shipped profiles' interval), as a share of one core. Target < 1%.

Medians of --runs runs; needs the test extra (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

import psutil  # noqa: E402
from support.process_scope import scope_to_this_run  # noqa: E402
from support.standin import Served, make_env_python  # noqa: E402

from sm120kit.serve.status import EventKind  # noqa: E402

scope_to_this_run()  # as in the tests: an sglang the host runs is not this run's business

VERSION = "0.5.23"


def death_to_notice(tmp: Path, python: Path, runs: int) -> list[float]:
    stamps = tmp / "stamps"
    s = Served(
        tmp / "death",
        python,
        {"die_after_ready_s": 0.3, "timestamps": str(stamps)},
        [f"health.max_restarts={runs - 1}", "health.backoff_initial_s=0.05", "health.backoff_max_s=0.05"],
        ["--quiet"],
        {},
    )
    s.run(timeout=120)
    died = [float(line.split()[1]) for line in stamps.read_text().splitlines() if line.startswith("died ")]
    noticed = [e["noticed_at"] for e in s.events(EventKind.DIED)]
    return [n - d for d, n in zip(died, noticed)]


def stop_tree(tmp: Path, python: Path, runs: int) -> tuple[list[float], list[float], int]:
    outside, inside, size = [], [], 0
    for i in range(runs):
        s = Served(tmp / f"stop{i}", python, {"load_s": 0.2}, ["parallel.tp=8", "node.gpus=8"], ["--quiet"], {}).start()
        try:
            s.wait(EventKind.READY)
            tree = s.ours()
            size = len(tree)
            sent = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            gone = psutil.wait_procs(tree, timeout=30)[0]
            outside.append(time.monotonic() - sent)
            assert len(gone) == size, "a process outlived the stop"
            s.proc.wait(30)
            inside.append(s.wait(EventKind.STOPPED)["seconds"])
        finally:
            s.cleanup()
    return outside, inside, size


def idle_cpu(tmp: Path, python: Path, seconds: float) -> float:
    s = Served(tmp / "idle", python, {"load_s": 0.2}, ["health.probe_interval_s=10"], [], {}).start()
    try:
        s.wait(EventKind.READY)
        time.sleep(2)  # past the first probes
        proc = psutil.Process(s.proc.pid)
        before, began = proc.cpu_times(), time.monotonic()
        time.sleep(seconds)
        after, wall = proc.cpu_times(), time.monotonic() - began
        return (after.user + after.system - before.user - before.system) / wall
    finally:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)
        s.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "env").mkdir()
        python = make_env_python(tmp / "env", VERSION)
        notice = death_to_notice(tmp, python, args.runs)
        outside, inside, size = stop_tree(tmp, python, args.runs)
        cpu = idle_cpu(tmp, python, args.idle_seconds)
    result = {
        "death_to_noticed_ms": {
            "median": round(statistics.median(notice) * 1000, 1),
            "max": round(max(notice) * 1000, 1),
            "runs": len(notice),
        },
        "sigterm_to_all_gone_ms": {
            "processes": size,
            "median": round(statistics.median(outside) * 1000, 1),
            "max": round(max(outside) * 1000, 1),
        },
        "supervisor_stop_ms": {"median": round(statistics.median(inside) * 1000, 1)},
        "idle_cpu_percent_of_one_core": round(cpu * 100, 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
