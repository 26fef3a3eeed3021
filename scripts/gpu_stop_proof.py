"""On a machine with NVIDIA GPUs: prove that the supervisor's stop releases GPU memory.

A process tree shaped like sglang's (a launcher with one holder process per rank, each
holding GPU memory through torch; the last one leaves the process group, as sglang's
orphaned schedulers do) runs under the real Supervisor, in a process of its own. Once it
is ready the script sends the supervisor SIGTERM, as systemd would, and reads NVML before,
during and after: the memory each GPU uses, and which processes hold it.

    python scripts/gpu_stop_proof.py --holders 8 --gib 4 [--json]

Needs torch, psutil and nvidia-ml-py; sm120kit's serve package needs nothing else.
Exit 0 when the memory came back and none of the tree's processes is left on a GPU.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sm120kit.serve.status import EventKind

HERE = str(Path(__file__).resolve())
MIB = 1 << 20


def hold(rank: int, gib: float, ready_fd: int, leave_group: bool) -> None:
    """One holder: memory on GPU rank % n, then sleep until killed."""
    import torch

    if leave_group:
        os.setsid()
    device = rank % torch.cuda.device_count()
    block = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=f"cuda:{device}")
    block.fill_(1)
    torch.cuda.synchronize()
    os.write(ready_fd, f"{rank} {device} {os.getpid()}\n".encode())
    while True:
        time.sleep(1)


def tree(port: int, holders: int, gib: float) -> None:
    """The launcher: start the holders, then answer /health_generate 200 once all hold."""
    pipes = []
    for rank in range(holders):
        r, w = os.pipe()
        os.set_inheritable(w, True)
        subprocess.Popen(
            [sys.executable, HERE, "--hold", str(rank), str(gib), str(w), str(int(rank == holders - 1))], pass_fds=(w,)
        )
        os.close(w)
        pipes.append(r)
    for r in pipes:
        print("holder ready:", os.read(r, 100).decode().strip(), flush=True)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    print("The server is fired up and ready to roll!", flush=True)
    server.serve_forever()


def supervise(state: str, port: int, holders: int, gib: float) -> int:
    from sm120kit.serve.machine import Policy, ServerSpec
    from sm120kit.serve.rundir import RunRecord
    from sm120kit.serve.supervisor import Supervisor

    argv = [sys.executable, HERE, "--tree", str(port), str(holders), str(gib)]
    server = ServerSpec(
        "gpu-proof", argv, argv, dict(os.environ), "127.0.0.1", port, [("server.port", "127.0.0.1", port)]
    )
    policy = Policy(
        startup_timeout_s=300,
        probe_interval_s=2,
        probe_timeout_s=5,
        failures_before_restart=3,
        max_restarts=0,
        backoff_initial_s=1,
        backoff_max_s=1,
        stop_timeout_s=30,
        stable_after_s=600,
    )
    return Supervisor(server, policy, RunRecord(Path(state)), echo=False).run()


def nvml_snapshot() -> list[dict]:
    import pynvml as nv

    nv.nvmlInit()
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            procs = {p.pid: (p.usedGpuMemory or 0) // MIB for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
            gpus.append({"gpu": i, "used_mib": nv.nvmlDeviceGetMemoryInfo(h).used // MIB, "processes": procs})
        return gpus
    finally:
        nv.nvmlShutdown()


def events(state: Path) -> list[dict]:
    path = state / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--holders", type=int, default=8)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--port", type=int, default=31999)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    before = nvml_snapshot()
    began = time.monotonic()
    sup = subprocess.Popen(
        [sys.executable, HERE, "--supervise", str(state), str(args.port), str(args.holders), str(args.gib)],
        stdout=sys.stderr,
    )
    while not any(e["event"] == EventKind.READY for e in events(state)):
        if sup.poll() is not None or time.monotonic() - began > 300:
            print("the tree never became ready:", events(state), file=sys.stderr)
            return 2
        time.sleep(0.2)
    ready_s = time.monotonic() - began
    log = (state / "server.log").read_text()
    tree_pids = {int(line.split()[-1]) for line in log.splitlines() if line.startswith("holder ready:")}
    during = nvml_snapshot()

    sent = time.monotonic()
    sup.terminate()  # SIGTERM, as systemd stops a service
    code = sup.wait(120)
    stopped_s = time.monotonic() - sent
    released_s = None
    while time.monotonic() - sent < 60:
        after = nvml_snapshot()
        if all(a["used_mib"] <= b["used_mib"] + 64 for a, b in zip(after, before)):
            released_s = time.monotonic() - sent
            break
        time.sleep(0.1)
    stopped = next(e for e in events(state) if e["event"] == EventKind.STOPPED)
    on_gpu_during = sorted(pid for g in during for pid in g["processes"] if pid in tree_pids)
    on_gpu_after = sorted(pid for g in after for pid in g["processes"] if pid in tree_pids)
    import psutil

    alive_after = sorted(
        pid for pid in tree_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    )
    result = {
        "holders": args.holders,
        "gib_each": args.gib,
        "ready_after_s": round(ready_s, 2),
        "used_mib_before": [g["used_mib"] for g in before],
        "used_mib_during": [g["used_mib"] for g in during],
        "used_mib_after": [g["used_mib"] for g in after],
        "tree_pids": sorted(tree_pids),
        "tree_pids_nvml_lists_during": on_gpu_during,
        "tree_pids_nvml_lists_after": on_gpu_after,
        "tree_pids_alive_after": alive_after,
        "supervisor_exit_code": code,
        "sigterm_to_supervisor_exit_s": round(stopped_s, 3),
        "sigterm_to_memory_released_s": None if released_s is None else round(released_s, 3),
        "stopped_event": {
            k: stopped[k]
            for k in ("clean", "processes", "sigkilled", "left", "seconds", "on_gpu", "gpu_released_after_s")
        },
    }
    ok = code == 0 and released_s is not None and not on_gpu_after and not alive_after and stopped["clean"]
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hold"]:
        hold(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
    elif sys.argv[1:2] == ["--tree"]:
        tree(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1:2] == ["--supervise"]:
        sys.exit(supervise(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
    else:
        sys.exit(main())
