"""On a machine with NVIDIA GPUs: does the `nccl all-reduce` check (`sm120kit doctor --nccl`) run the
real NCCL all-reduce, measure it, and stay inside its bound?

Runs the check's own orchestration (sm120kit.node.checks.nccl.probe, which starts the real worker
sm120kit/node/nccl_probe.py with this interpreter) and its verdict (judge):

- two or more GPUs: a two-rank 64 MiB all-reduce on --gpus (default 0,1), once with
  NCCL_P2P_DISABLE=1 and once with P2P, each bounded by --timeout; prints both bus bandwidths, the
  transports NCCL chose and the verdict doctor would give;
- one GPU: the answer doctor gives there (the worker says it sees too few GPUs), then the same
  runs with one rank (NCCL's communicator, the all-reduce, the timing: everything but a peer);
- always: the bound on real processes: a run given less time than it needs is killed with its
  ranks, and afterwards no process of the worker is left and none holds the GPUs (nvidia-smi).

Needs torch with NCCL in this interpreter, and sm120kit importable (the repository root is put on
sys.path; nothing is installed). The variables that keep NVLink multicast off are kept set.

    python scripts/nccl_probe_gpu_proof.py [--gpus 0,1] [--timeout 120] [--json FILE]

Exit 0 when every run that should finish finished with a correct sum and the bound held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm120kit.node.checks import nccl  # noqa: E402

SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def shell(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({argv[0]}: {exc})"


def gpu_count() -> int:
    out = shell(sys.executable, "-c", "import torch; print(torch.cuda.device_count())")
    return int(out.splitlines()[-1]) if out and out.splitlines()[-1].isdigit() else 0


def leftovers() -> list[str]:
    """Processes of the worker still alive, and processes nvidia-smi says hold a GPU."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if "nccl_probe.py" in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"pid {proc.info['pid']}: {cmd[:120]}")
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        apps = ""  # no nvidia-smi: nothing to ask
    found += [f"on a GPU: {line}" for line in apps.splitlines() if line.strip()]
    return found


def show(run: nccl.ProbeRun, timeout_s: float) -> None:
    print(
        f"  {run.mode:13} {run.outcome:11} {run.said(timeout_s)}  "
        f"(wall {run.seconds:.1f} s, algbw {run.algbw_gbps}, stage {run.stage}, torch {run.ready.get('torch')}, "
        f"NCCL {run.ready.get('nccl')})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    env = {**os.environ, **SAFE}
    env.pop("NCCL_P2P_DISABLE", None)
    print(shell("nvidia-smi", "-L"))
    print(shell("nvidia-smi", "topo", "-m"))
    count = gpu_count()
    print(f"torch sees {count} GPU(s); worker {nccl.WORKER}")
    problems, record = [], {"gpus": count}
    world = 2 if count >= 2 else 1
    devices = args.gpus if count >= 2 else "0"
    if count < 2:
        said = nccl.probe(sys.executable, devices, env, "P2P", args.timeout, nccl.WORKER)
        print(f"two ranks on one GPU: {said.outcome} ({said.kind}): {said.error}")
        record["two_ranks_on_one_gpu"] = said.as_json()
        if (said.outcome, said.kind) != ("unavailable", "no-gpu"):
            problems.append("with one GPU the worker should say it sees too few")
    print(f"{world} rank(s) on GPU {devices}, {nccl.SIZE_MIB} MiB, {nccl.ITERATIONS} timed all-reduces:")
    off = nccl.probe(
        sys.executable, devices, {**env, "NCCL_P2P_DISABLE": "1"}, "P2P disabled", args.timeout, nccl.WORKER, world
    )
    show(off, args.timeout)
    on = nccl.probe(sys.executable, devices, env, "P2P", args.timeout, nccl.WORKER, world)
    show(on, args.timeout)
    record["runs"] = {"p2p": on.as_json(), "p2p_disabled": off.as_json()}
    problems += [f"{run.mode}: {run.said(args.timeout)}" for run in (off, on) if not run.ok]
    if world == 2:
        verdict = nccl.judge(f"GPU {devices.replace(',', ' and ')}", on, off, False, args.timeout)
        print(
            f"doctor's verdict: {verdict.status.value.upper()}: {verdict.detail}"
            + (f"\n  fix: {verdict.fix}" if verdict.fix else "")
        )
        record["verdict"] = verdict.as_json()
    # The bound, on real processes: about half the time a whole run took, so that it is cut in
    # the middle of torch's start or NCCL's set-up.
    bound = max(1.0, round(min(off.seconds or 4.0, on.seconds or 4.0) * 0.5, 1))
    began = time.monotonic()
    cut = nccl.probe(sys.executable, devices, env, "P2P", bound, nccl.WORKER, world)
    took = time.monotonic() - began
    left = leftovers()
    print(f"bound {bound:g} s: {cut.outcome}, {cut.said(bound)}; returned after {took:.1f} s")
    print(f"left running afterwards: {left or 'nothing'}")
    record["bound"] = {"bound_s": bound, "took_s": round(took, 3), "run": cut.as_json(), "left": left}
    if cut.outcome != "hung" or left or cut.left_running or took > bound + nccl.KILL_GRACE_S + 2:
        problems.append(f"the bound did not hold: {cut.outcome}, {took:.1f} s, left {left or cut.left_running}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print("PROBLEMS:\n  " + "\n  ".join(problems) if problems else "all good")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
