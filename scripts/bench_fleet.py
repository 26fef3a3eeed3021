"""How fast a fleet routes around a dead replica, against three replicas of the sglang
stand-in (tests/fixtures/sglang_standin.py, a test fixture: the real server needs GPUs)
behind the REAL sglang router (the sglang-router wheel, on the CPU).

    python scripts/bench_fleet.py [--runs 5]

Each run kills one replica's server (SIGKILL to its launcher) while four clients send
requests through the router (half of them streamed, 16 tokens at 40 tokens/s each), and
measures from the fleet's own record:

- kill -> out of the router: until the fleet took it out through the worker API;
- kill -> routed again: until its supervisor restarted it, it generated, and the fleet
  added it back (the stand-in starts in about a second; a real 18 GB load takes minutes);
- requests: how many the clients sent meanwhile, how many failed, and how many the killed
  replica left unfinished (the upper bound on what may fail: whole answers are retried
  by the router on another replica, a stream cut off mid-answer is not).

Medians of --runs runs; needs the test extra (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

import psutil  # noqa: E402
from support.process_scope import scope_to_this_run  # noqa: E402
from support.standin import Served, free_port, make_env_python  # noqa: E402

scope_to_this_run()  # as in the tests: an sglang the host runs is not this run's business

VERSION = "0.5.23"
REPLICAS = 3


def generate(port: int, stream: bool) -> bool:
    body = {"text": "Count: one two", "stream": stream, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            answer = r.read()
            return r.status == 200 and (not stream or b"data: [DONE]" in answer)
    except (OSError, urllib.error.HTTPError):
        return False


def one_run(tmp: Path, python: Path) -> dict:
    ports = [free_port() for _ in range(REPLICAS)]
    log = tmp / "requests.jsonl"
    fleet = Served(
        tmp,
        python,
        {"request_tokens_per_s": 40, "requests_log": str(log)},
        [f"fleet.replica=[{', '.join(f'{{port={p}}}' for p in ports)}]", f"fleet.router.prometheus_port={free_port()}"],
        [],
        {},
        profile="standin-fleet",
    ).start()
    try:
        fleet.wait("ready", timeout=60)
        end = time.monotonic() + 30
        while time.monotonic() < end and len(fleet.events("routed")) < REPLICAS:
            time.sleep(0.05)
        results, stop = [], threading.Event()

        def client(stream: bool) -> None:
            while not stop.is_set():
                results.append(generate(fleet.port, stream))

        clients = [threading.Thread(target=client, args=(i % 2 == 0,), daemon=True) for i in range(4)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        victim = json.loads((fleet.dir / "replica-1" / "state.json").read_text())["server_pid"]
        killed = time.time()
        psutil.Process(victim).kill()
        fleet.wait("unrouted", timeout=30)
        end = time.monotonic() + 60
        while time.monotonic() < end and len(fleet.events("routed")) < REPLICAS + 1:
            time.sleep(0.05)
        time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join(15)
        out = fleet.events("unrouted")[0]["t"] - killed
        back = fleet.events("routed")[REPLICAS]["t"] - killed
        on_victim = [
            json.loads(line)
            for line in log.read_text().splitlines()
            if json.loads(line)["port"] == ports[1] and json.loads(line)["path"] == "/generate"
        ]
        cut = sum(e["event"] == "start" for e in on_victim) - sum(e["event"] == "end" for e in on_victim)
        return {"out_s": out, "back_s": back, "sent": len(results), "failed": results.count(False), "cut": cut}
    finally:
        if fleet.proc.poll() is None:
            fleet.signal(signal.SIGTERM, timeout=60)
        fleet.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        python = make_env_python(Path(tmp), VERSION)
        runs = [one_run(Path(tmp) / f"run{i}", python) for i in range(args.runs)]
    for key, what in (("out_s", "kill -> out of the router"), ("back_s", "kill -> routed again")):
        values = [r[key] for r in runs]
        print(f"{what}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    sent, failed, cut = (sum(r[k] for r in runs) for k in ("sent", "failed", "cut"))
    print(f"requests through the router: {sent} in {len(runs)} runs, {failed} failed, {cut} cut on the killed replica")


if __name__ == "__main__":
    main()
