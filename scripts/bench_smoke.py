"""The smoke's own cost, client side: `sm120kit smoke` against a local sglang stand-in
(tests/fixtures/sglang_standin.py, a test fixture: its request side alone, in a process
of its own, answers at once), so that what is measured is the smoke's requests, checks
and threads, not a model.

    python scripts/bench_smoke.py [--runs 7] [--concurrency 64]

Per run: the wall time of one whole smoke (32 tasks alone, the first task of each kind
again streamed, a burst of --concurrency, the logprob request), and this process's CPU time
over it (the client alone: the server runs elsewhere). Printed: the medians, per task and
per request. The wall time includes the stand-in's own handling, so it bounds the overhead
from above.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "fixtures" / "sglang_standin.py"

SERVER = f"""
import importlib.util, sys, threading
from http.server import ThreadingHTTPServer
spec = importlib.util.spec_from_file_location("standin", {str(STANDIN)!r})
standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)
standin.State.starting = False
args = {{"api_key": None, "served_name": "bench", "model_path": "standin/bench", "tp": 1, "port": 0}}
server = ThreadingHTTPServer(("127.0.0.1", 0), standin.handler(args))
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()

    from sm120kit.quality import tasks
    from sm120kit.quality.command import smoke
    from sm120kit.quality.options import SmokeOptions

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        options = SmokeOptions(url=url, concurrency=args.concurrency)
        smoke(options)  # warm: imports, the first connections
        walls, cpus, requests, streamed = [], [], 0, 0
        for _ in range(args.runs):
            cpu, wall = time.process_time(), time.perf_counter()
            report = smoke(options)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            assert report.passed, report.failures
            streamed = len({task.kind for task in tasks.generate(options.seed, options.tasks)})
            requests = options.tasks + streamed + options.concurrency + 1
    finally:
        server.terminate()
        server.wait()
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(
        f"smoke against an instant local stand-in, median of {args.runs} runs: {wall * 1000:.0f} ms wall "
        f"({min(walls) * 1000:.0f}-{max(walls) * 1000:.0f}), {cpu * 1000:.0f} ms client CPU; "
        f"{options.tasks} tasks + {streamed} streamed + a burst of {options.concurrency} + 1 logprob request "
        f"= {requests} requests"
    )
    print(
        f"per task: {wall / options.tasks * 1000:.2f} ms wall, {cpu / options.tasks * 1000:.2f} ms client CPU; "
        f"per request: {wall / requests * 1000:.2f} ms wall, {cpu / requests * 1000:.2f} ms client CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
