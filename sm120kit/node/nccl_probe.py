"""A two-rank NCCL all-reduce on two GPUs: does it finish, how fast, and through which transport.

This file runs in the TARGET's interpreter (the one that serves sglang, with torch), started by
sm120kit.node.checks.nccl as `<python> nccl_probe.py ...` in a process group of its own, with
CUDA_VISIBLE_DEVICES naming the two GPUs and the NCCL variables of the run (the server's, or those
with NCCL_P2P_DISABLE=1). It imports the standard library and torch only: never sm120kit, which the
target need not have (its JSON-lines channel, shared with the other scripts run there, is
sm120kit/target_script.py, loaded by its path).

    python nccl_probe.py [--size-mib 64] [--warmup 2] [--iterations 20] [--timeout 60] [--world 2]
                         [--scratch DIR]
        the launcher: starts --world rank processes (rank r on visible device r), which meet through
        a file store in DIR (default: a temporary directory it removes; no port), and waits for them
    python nccl_probe.py --rank R --store FILE [same options]
        one rank (what the launcher starts)

Output: one JSON object a line on stdout (everything else goes to stderr; NCCL's INFO log goes to
a file per rank, read back for the transport):

    {"event": "ready", "torch", "nccl", "devices": [names], "world", "pid"}           the launcher
    {"event": "stage", "rank", "stage": "init" | "first" | "timed", "t"}              each rank, before
        each stage: init (process group and communicator), first (the first all-reduce, which
        connects the ranks: where a broken P2P path hangs), timed (the timed all-reduces); t is
        seconds since the rank started
    {"event": "result", "rank": 0, "bytes", "iterations", "seconds", "algbw_gbps", "busbw_gbps",
     "transport": ["P2P/CUMEM", ...]}                                                 rank 0
    {"event": "done", "seconds"}                                                      the launcher
    {"event": "fatal", "kind", "error"}, exit status 3; kind is one of
        bad-args, no-torch, no-gpu (fewer visible GPUs than ranks), no-nccl, nccl (a rank's NCCL or
        CUDA error), wrong-sum (the all-reduce gave a wrong sum), rank (a rank died: the launcher)

Bus bandwidth is as nccl-tests gives it for all-reduce: bytes / time x 2 (world - 1) / world.
"""

from __future__ import annotations

import sys

# Run as a script, this file's directory (sm120kit/node) leads sys.path, and its neighbours'
# names (check, render, snapshot, ...) would shadow top-level modules that torch imports.
if sys.path and sys.path[0] and __name__ == "__main__":
    import os.path as _p

    if _p.realpath(sys.path[0]) == _p.dirname(_p.realpath(__file__)):
        del sys.path[0]

import argparse
import os
import re
import runpy
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

PROTOCOL = 1
EXIT_FATAL = 3
RANK_GRACE_S = 5.0  # how long the other ranks get once one has died (a peer waits for it forever)
SHARED = Path(__file__).resolve().parent.parent / "target_script.py"
TRANSPORT = re.compile(r"Channel \S+ : \d+\[\S+\] -> \d+\[\S+\] (?:\[\S+\] )?via (\S+)")


# Fatal and the JSON-lines channel, shared with the other scripts run in the target: read from
# sm120kit/target_script.py by its path, as this interpreter need not have sm120kit.
_shared = runpy.run_path(str(SHARED))
Fatal, emit, first_line = _shared["Fatal"], _shared["emit"], _shared["first_line"]
keep_stdout_for_protocol = _shared["keep_stdout_for_protocol"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a fatal event, not argparse's exit status 2
        raise Fatal("bad-args", message)


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="nccl_probe.py", add_help=False)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int)
    p.add_argument("--store")
    p.add_argument("--scratch")  # the launcher's directory for the store and NCCL's logs (default: a new one)
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.iterations < 1 or args.warmup < 0 or args.timeout <= 0:
        raise Fatal("bad-args", "--size-mib and --iterations must be >= 1, --warmup >= 0, --timeout > 0")
    if args.world < 1:
        raise Fatal("bad-args", f"--world {args.world}: at least one rank")
    if (args.rank is None) != (args.store is None):
        raise Fatal("bad-args", "--rank and --store go together (a rank is started by the launcher)")
    if args.rank is not None and not 0 <= args.rank < args.world:
        raise Fatal("bad-args", f"--rank {args.rank} is not in 0..{args.world - 1}")
    return args


def import_torch():
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:
        raise Fatal("no-torch", f"torch cannot be imported here: {first_line(exc)}") from exc
    return torch, dist


# ----------------------------------------------------------------------------- one rank


def transports(log_dir: Path, pid: int) -> list[str]:
    """The transports NCCL's INFO log names for this process's channels (P2P/CUMEM, SHM/direct, ...)."""
    found: set[str] = set()
    for path in log_dir.glob(f"nccl.{pid}.log*"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found.update(m.group(1) for m in TRANSPORT.finditer(text))
    return sorted(found)


def rank_main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    torch, dist = import_torch()
    rank, world = args.rank, args.world

    def stage(name: str) -> None:
        emit("stage", rank=rank, stage=name, t=round(time.perf_counter() - started, 3))

    stage("init")
    device = torch.device("cuda", rank)
    try:
        torch.cuda.set_device(device)
        store = dist.FileStore(args.store, world)
        options = {"backend": "nccl", "store": store, "rank": rank, "world_size": world}
        options["timeout"] = timedelta(seconds=args.timeout)
        try:  # eager communicator (torch 2.3+): init and the first collective fail apart
            dist.init_process_group(**options, device_id=device)
        except TypeError:
            dist.init_process_group(**options)
        count = args.size_mib * (1 << 20) // 4
        data = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
        stage("first")
        dist.all_reduce(data)
        torch.cuda.synchronize(device)
        expected = world * (world + 1) / 2
        if not bool((data == expected).all()):
            wrong = float(data[(data != expected).nonzero()[0]].item())
            raise Fatal("wrong-sum", f"rank {rank}: the all-reduce gave {wrong}, not {expected:g}")
        for _ in range(args.warmup):
            data.fill_(1.0)
            dist.all_reduce(data)
        data.fill_(1.0)  # sums double each time: 2**iterations stays exact in float32 up to 2**127
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[rank])
        stage("timed")
        begun = time.perf_counter()
        for _ in range(args.iterations):
            dist.all_reduce(data)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - begun
        dist.destroy_process_group()
    except Fatal:
        raise
    except Exception as exc:  # NCCL's and CUDA's errors (torch.distributed.DistBackendError, ...)
        raise Fatal("nccl", f"rank {rank}: {first_line(exc)}") from exc
    if rank == 0:
        size = count * 4
        algbw = size * args.iterations / seconds / 1e9
        emit(
            "result",
            rank=rank,
            bytes=size,
            iterations=args.iterations,
            seconds=round(seconds, 6),
            algbw_gbps=round(algbw, 3),
            busbw_gbps=round(algbw * 2 * (world - 1) / world, 3),
            transport=transports(Path(args.store).parent, os.getpid()),
        )


# ----------------------------------------------------------------------------- the launcher


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    started = time.perf_counter()
    torch, dist = import_torch()
    try:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        raise Fatal("no-gpu", f"torch cannot talk to the GPUs: {first_line(exc)}") from exc
    if visible < args.world:
        where = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise Fatal(
            "no-gpu",
            f"torch sees {visible} GPU(s), {args.world} needed"
            + (f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else ""),
        )
    if not dist.is_available() or not dist.is_nccl_available():
        raise Fatal("no-nccl", f"torch {torch.__version__} was built without NCCL")
    try:
        version = torch.cuda.nccl.version()  # (2, 27, 3); an int (2708) in old releases
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        nccl = None
    emit(
        "ready",
        protocol=PROTOCOL,
        torch=torch.__version__,
        nccl=nccl,
        devices=[torch.cuda.get_device_name(i) for i in range(args.world)],
        world=args.world,
        pid=os.getpid(),
    )
    own = args.scratch is None  # a directory the caller gave is the caller's to remove (after a kill too)
    scratch = Path(tempfile.mkdtemp(prefix="sm120kit-nccl-") if own else args.scratch)
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")}
    env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(scratch / "nccl.%p.log"), PYTHONUNBUFFERED="1")
    ranks = []
    try:
        for rank in range(args.world):
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.realpath(__file__),
                        *argv,
                        "--rank",
                        str(rank),
                        "--store",
                        str(scratch / "store"),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=_shared["channel"](),
                    env=env,
                )
            )
        failed = wait_ranks(ranks)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        raise Fatal("rank", failed)
    emit("done", seconds=round(time.perf_counter() - started, 3))


def wait_ranks(ranks: list[subprocess.Popen]) -> str:
    """Wait for every rank; once one has died, the others get RANK_GRACE_S (they would wait for
    it in the next collective) and are killed. Returns what went wrong, "" when nothing did."""
    failed, deadline = "", None
    while any(p.poll() is None for p in ranks):
        if not failed:
            for rank, proc in enumerate(ranks):
                if proc.poll() not in (None, 0):
                    code = proc.returncode
                    what = f"signal {-code}" if code < 0 else f"status {code}"
                    failed, deadline = f"rank {rank} exited with {what}", time.monotonic() + RANK_GRACE_S
                    break
        if deadline is not None and time.monotonic() > deadline:
            for proc in ranks:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    if not failed:
        for rank, proc in enumerate(ranks):
            if proc.returncode:
                code = proc.returncode
                failed = f"rank {rank} exited with {f'signal {-code}' if code < 0 else f'status {code}'}"
                break
    return failed


def main(argv: list[str]) -> int:
    keep_stdout_for_protocol()
    try:
        args = parse(argv)
        if args.rank is None:
            launch(args, argv)
        else:
            rank_main(args)
        return 0
    except Fatal as fatal:
        emit("fatal", kind=fatal.kind, error=fatal.error)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
