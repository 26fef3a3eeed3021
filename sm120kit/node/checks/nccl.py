"""The `nccl all-reduce` check (`doctor --nccl`): a two-rank NCCL all-reduce on two of the node's
GPUs, run by the target's python (sm120kit/node/nccl_probe.py, torch and the standard library
only), once with NCCL_P2P_DISABLE=1 and once with P2P as the server's environment has it, each run
bounded in time and, past its bound, killed with its whole process group.

Why: on PCIe-only nodes (no NVLink) sglang's custom all-reduce is off above two GPUs and
FlashInfer's SM12x all-reduce is not adopted (sgl-project/sglang#32330), so every all-reduce of
TP=8 is NCCL's, and NCCL's P2P path can hang on the first collective when ACS or the IOMMU sits
between the GPUs (NVIDIA/nccl#1999) while NVML's P2P matrix says "ok". Only running NCCL tells.

Why only when asked: it takes seconds, needs the two GPUs idle (a server on them would be
disturbed and would disturb the figures), and a hung P2P run can leave the GPUs busy until they
are reset. The run with P2P disabled goes first, so that such a hang cannot spoil it.
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit import child_process
from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status
from sm120kit.node.inputs import NcclRequest

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs
    from sm120kit.node.nvml_schema import Gpu
    from sm120kit.node.snapshot import Snapshot

ID = "nccl all-reduce"
WORKER = Path(__file__).resolve().parent.parent / "nccl_probe.py"
RUN_TIMEOUT_S = 90.0  # one run: the interpreter and torch start, NCCL connects, 23 all-reduces of 64 MiB
KILL_GRACE_S = child_process.KILL_GRACE_S
SIZE_MIB = 64
ITERATIONS = 20
SLOWER = 0.9  # one path below this fraction of the other's bus bandwidth is "slower"
# nvmlGpuTopologyLevel_t's names (sm120kit.node.nvml.TOPOLOGY), nearest first: the farthest pair is probed
LINKS = ("internal", "single-switch", "multiple-switches", "host-bridge", "numa-node", "across-sockets")
STAGES = {
    "init": "setting up the communicator",
    "first": "the first all-reduce (where the ranks connect)",
    "timed": "the timed all-reduces",
}
UNAVAILABLE = ("no-torch", "no-gpu", "no-nccl")  # the worker's fatal kinds that mean "cannot be run here"
FIX_P2P = (
    "to keep P2P, disable ACS on the PCIe bridges (BIOS, or the kernel's pci=noacs) and boot with iommu=pt, "
    "then run `sm120kit doctor --nccl` again"
)
FIX_HANG = (
    "set NCCL_P2P_DISABLE=1 in the profile's [env] (try it first: `--set env.NCCL_P2P_DISABLE=1`); " + FIX_P2P + ". "
    "A hung P2P run can leave the GPUs busy until `nvidia-smi -r` or a reboot "
    "(https://github.com/NVIDIA/nccl/issues/1999)"
)
# NCCL's INFO line for a channel's connection: "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"
TRANSPORT = re.compile(r"Channel \S+ : \d+\[\S+\] -> \d+\[\S+\] (?:\[\S+\] )?via (\S+)")


def request(
    python: str | None, site: str | None, gpus: str | None, elsewhere: str | None, executable: str
) -> NcclRequest:
    """The Request for doctor's --nccl/--nccl-gpus (bad input is a UserError). elsewhere: the option
    (--nvml, --root) that says doctor reads another node, where this node's NCCL proves nothing."""
    if elsewhere:
        raise UserError(
            f"--nccl runs NCCL on this node, and {elsewhere} describes another one",
            f"run `sm120kit doctor --nccl` on the node itself, without {elsewhere}",
        )
    if site and not python:
        raise UserError(
            "--site names files, not an interpreter: the NCCL probe runs the target's python", "pass --python EXE"
        )
    pair = None
    if gpus is not None:
        parts = [p.strip() for p in gpus.split(",")]
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or parts[0] == parts[1]:
            raise UserError(f"--nccl-gpus {gpus}: two different GPU indices are needed", "e.g. --nccl-gpus 0,4")
        pair = (int(parts[0]), int(parts[1]))
    return NcclRequest(python or executable, pair, RUN_TIMEOUT_S, WORKER)


# ----------------------------------------------------------------------------- one run


@dataclass
class ProbeRun:
    """One run of the worker: its outcome ("ok", "hung", "failed", "unavailable") and figures."""

    mode: str  # "P2P" or "P2P disabled"
    outcome: str
    busbw_gbps: float | None = None
    algbw_gbps: float | None = None
    transport: list[str] = field(default_factory=list)
    stage: str | None = None  # the stage the least advanced rank had reached
    kind: str = ""  # the worker's fatal kind
    error: str = ""
    seconds: float = 0.0  # the run's wall time
    ready: dict = field(default_factory=dict)  # torch, NCCL, devices
    left_running: list[int] = field(default_factory=list)  # pids not gone after the kill

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def said(self, timeout_s: float) -> str:
        """The run in a few words: its bus bandwidth, or where it hung, or why it failed."""
        via = ", ".join(self.transport)
        if self.ok:
            return f"{self.busbw_gbps:.1f} GB/s" + (f" via {via}" if via else "")
        if self.outcome == "hung":
            if self.stage in STAGES:
                where = f"in {STAGES[self.stage]}"
            elif self.ready:
                where = "while the ranks started (importing torch)"
            else:
                where = "before the worker was ready (importing torch, or the driver)"
            return f"hung {where}" + (f", connected via {via}" if via else "") + f"; killed after {timeout_s:g} s"
        return "failed" + (f" (connected via {via})" if via else "") + f": {self.error}"

    def as_json(self) -> dict:
        return asdict(self)


def probe(
    python: str, devices: str, env: dict[str, str], mode: str, timeout_s: float, worker: Path, world: int = 2
) -> ProbeRun:
    """Run the worker once, `world` ranks, with env (CUDA_VISIBLE_DEVICES=devices) in a session of
    its own; past timeout_s its whole process group is killed. Nothing it started is left running,
    and its scratch directory (the ranks' meeting file, NCCL's logs) is removed."""
    with tempfile.TemporaryDirectory(prefix="sm120kit-nccl-") as scratch:
        argv = [python, str(worker), "--size-mib", str(SIZE_MIB), "--iterations", str(ITERATIONS)]
        argv += ["--world", str(world), "--timeout", f"{timeout_s:g}", "--scratch", scratch]
        env = {**env, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
        began = time.monotonic()
        try:  # its own process group: the ranks are killed with it
            done = child_process.run(argv, env=env, deadline_s=timeout_s, grace_s=KILL_GRACE_S)
        except OSError as exc:
            return ProbeRun(mode, "unavailable", kind="no-python", error=f"cannot run {python}: {exc.strerror or exc}")
        run = _read_events(mode, done)
        if not run.transport:  # a run that hung or failed: how far NCCL had connected
            run.transport = _logged_transports(Path(scratch))
    run.seconds = round(time.monotonic() - began, 3)
    run.left_running = done.left_running
    return run


def _logged_transports(scratch: Path) -> list[str]:
    found: set[str] = set()
    for path in scratch.glob("nccl.*.log*"):
        try:
            found.update(m.group(1) for m in TRANSPORT.finditer(path.read_text(errors="replace")))
        except OSError:
            continue
    return sorted(found)


def _read_events(mode: str, child: child_process.ChildRun) -> ProbeRun:
    ready, result, fatal, done, stages = {}, None, None, False, {}
    for event in child.objects():
        kind = event.get("event")
        if kind == "ready":
            ready = event
        elif kind == "stage":
            stages[event.get("rank")] = event.get("stage")
        elif kind == "result" and result is None:
            result = event
        elif kind == "fatal" and fatal is None:  # a rank's own reason comes before the launcher's
            fatal = event
        elif kind == "done":
            done = True
    order = list(STAGES)
    stage = min(stages.values(), key=lambda s: order.index(s) if s in order else -1) if stages else None
    run = ProbeRun(mode, "failed", stage=stage, ready={k: v for k, v in ready.items() if k != "event"})
    if child.hung:
        run.outcome = "hung"
    elif fatal:
        run.kind = str(fatal.get("kind", ""))
        run.error = str(fatal.get("error", ""))
        run.outcome = "unavailable" if run.kind in UNAVAILABLE else "failed"
    elif result and done and child.returncode == 0:
        run.outcome = "ok"
        run.busbw_gbps = float(result["busbw_gbps"])
        run.algbw_gbps = float(result["algbw_gbps"])
        run.transport = [str(t) for t in result.get("transport") or ()]
    else:
        tail = " | ".join(child.stderr_tail(3))
        run.error = f"the worker exited with status {child.returncode} without a result" + (f": {tail}" if tail else "")
    return run


# ----------------------------------------------------------------------------- the check


def farthest_pair(node: Snapshot, seen: list[Gpu]) -> tuple[list[Gpu], str]:
    """The two visible GPUs whose link NVML ranks farthest (across the sockets first), and the
    link's name; the first two when NVML gave no topology."""
    position = {g.index: i for i, g in enumerate(node.gpus)}
    matrix = node.nvml.topology
    best, link = seen[:2], ""
    rank = -1
    for i, a in enumerate(seen):
        for b in seen[i + 1 :]:
            try:
                name = matrix[position[a.index]][position[b.index]]
            except (IndexError, KeyError):
                continue
            if name in LINKS and LINKS.index(name) > rank:
                best, link, rank = [a, b], name, LINKS.index(name)
    return best, link


def nccl_all_reduce(inputs: CheckInputs) -> Check:
    asked: NcclRequest | None = inputs.nccl
    if asked is None:
        return Check(
            ID,
            Status.SKIP,
            "not run (--nccl): it runs NCCL on two idle GPUs for some seconds",
            "sm120kit doctor --nccl [--nccl-gpus A,B]",
        )
    node = inputs.node
    if node.nvml.error:
        return Check(ID, Status.INFO, f"not run: the GPUs cannot be listed ({node.nvml.error})")
    from sm120kit.node.checks.gpus import ranges
    from sm120kit.node.nvml_schema import visible

    env = inputs.server_env
    seen = visible(node.gpus, env)
    if asked.gpus:
        by_index = {g.index: g for g in seen}
        if missing := [i for i in asked.gpus if i not in by_index]:
            where = f"of the visible {ranges([g.index for g in seen])}" if seen else "visible"
            raise UserError(
                f"--nccl-gpus {','.join(map(str, asked.gpus))}: no GPU {missing[0]} {where}",
                "name two GPUs that `sm120kit doctor` lists",
            )
        pair, link = [by_index[i] for i in asked.gpus], ""
    elif len(seen) < 2:
        return Check(ID, Status.INFO, f"not run: fewer than two GPUs ({len(seen)} visible)")
    else:
        pair, link = farthest_pair(node, seen)
    names = f"GPU {pair[0].index} and {pair[1].index}" + (f" ({link})" if link else "")
    if busy := [(g.index, pid) for g in pair for pid in g.pids]:
        held = ", ".join(f"pid {pid} on GPU {i}" for i, pid in busy)
        return Check(
            ID,
            Status.INFO,
            f"not run on {names}: in use ({held}); an all-reduce beside them would disturb both",
            "stop them, or name idle GPUs with --nccl-gpus A,B",
        )
    if all(g.uuid for g in pair):
        devices, order = ",".join(g.uuid for g in pair), {}
    else:  # NVML's indices are in PCI bus order; CUDA's default order is another
        devices, order = f"{pair[0].index},{pair[1].index}", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    base = {k: v for k, v in env.items() if k != "NCCL_P2P_DISABLE"} | order
    off = probe(asked.python, devices, {**base, "NCCL_P2P_DISABLE": "1"}, "P2P disabled", asked.timeout_s, asked.worker)
    if off.outcome == "unavailable":
        return Check(
            ID,
            Status.INFO,
            f"not run: {off.error}",
            "run doctor with --python naming the interpreter that serves sglang, on the node with its GPUs",
            {"gpus": [g.index for g in pair], "python": asked.python},
        )
    on = probe(asked.python, devices, base, "P2P", asked.timeout_s, asked.worker)
    server_disables = env.get("NCCL_P2P_DISABLE", "").strip() not in ("", "0")
    found = judge(names, on, off, server_disables, asked.timeout_s)
    data = {
        "gpus": [g.index for g in pair],
        "link": link or None,
        "size_mib": SIZE_MIB,
        "server_p2p_disabled": server_disables,
        "runs": {"p2p": on.as_json(), "p2p_disabled": off.as_json()},
    }
    return Check(found.id, found.status, found.detail, found.fix, data)


def judge(names: str, on: ProbeRun, off: ProbeRun, server_disables: bool, timeout_s: float) -> Check:
    """The verdict on the two runs. The server's path is the run with P2P disabled when its
    environment sets NCCL_P2P_DISABLE, else the P2P run: that one must work."""
    figures = f"{names}, {SIZE_MIB} MiB all-reduce, bus bandwidth: P2P {on.said(timeout_s)}; "
    figures += f"P2P disabled {off.said(timeout_s)}"
    left = sorted({*on.left_running, *off.left_running})
    if left:  # not expected: the kill reaches the whole group
        return Check(
            ID,
            Status.FAIL,
            figures + f"; still running after the kill: pid {', '.join(map(str, left))}",
            f"kill {' '.join(map(str, left))} (and check `nvidia-smi`)",
        )
    if not on.ok and not off.ok:
        return Check(
            ID,
            Status.FAIL,
            figures + ": NCCL cannot all-reduce between these GPUs, with P2P or without",
            "check that the GPUs are idle and healthy (`nvidia-smi`), the driver and torch's NCCL; rerun with "
            "NCCL_DEBUG=INFO; " + FIX_P2P,
        )
    p2p_note = (
        ""
        if not on.ok or any(t.startswith("P2P") for t in on.transport) or not on.transport
        else (" (NCCL did not use P2P between these GPUs)")
    )
    on_gbps, off_gbps = on.busbw_gbps or 0.0, off.busbw_gbps or 0.0  # compared only where both runs are ok: set
    if server_disables:
        said = "the server's environment sets NCCL_P2P_DISABLE"
        if not off.ok:
            return Check(
                ID,
                Status.FAIL,
                figures + f": {said}, and without P2P the all-reduce fails",
                "remove NCCL_P2P_DISABLE from the profile's [env] (P2P works here)",
            )
        if not on.ok:
            return Check(ID, Status.OK, figures + f": P2P is broken here, and {said}")
        if on_gbps * SLOWER > off_gbps and not p2p_note:
            return Check(
                ID,
                Status.WARN,
                figures + f": {said}, though P2P works and is faster here",
                "remove NCCL_P2P_DISABLE from the profile's [env]",
            )
        return Check(ID, Status.OK, figures + f" ({said})")
    if not on.ok:
        return Check(ID, Status.FAIL, figures + ": the server's NCCL would use P2P, and P2P does not work", FIX_HANG)
    if off.ok and on_gbps < off_gbps * SLOWER:
        return Check(
            ID,
            Status.WARN,
            figures + p2p_note + ": P2P is slower than NCCL without it",
            "set NCCL_P2P_DISABLE=1 in the profile's [env], or find what slows P2P: ACS on the PCIe bridges "
            "(disable it in the BIOS, or pci=noacs), an IOMMU not in passthrough (iommu=pt)",
        )
    return Check(ID, Status.OK, figures + p2p_note)
