"""Checks of the GPUs, from the snapshot's NVML document: driver, the GPUs against a
profile, persistence, PCIe links, processes holding memory, peer-to-peer, topology."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.node.check import Check, Status
from sm120kit.node.nvml_schema import Gpu, visible

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs
    from sm120kit.node.snapshot import Snapshot
    from sm120kit.profiles.model import Profile

CUDA_FOR_SM120 = 12080  # CUDA 12.8: the first toolkit and driver API with sm_120
DEFAULT_MEM_FRACTION = 0.8  # sglang's --mem-fraction-static when the profile leaves it out
NO_GPU_CHECK = "or `sm120kit serve --no-gpu-check` to start anyway"


def ranges(indices: list[int]) -> str:
    """[0,1,2,3,6] -> "0-3, 6"."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ", ".join(out)


def driver(inputs: CheckInputs) -> Check:
    nvml = inputs.node.nvml
    if nvml.error:  # the gpus check leaves this failure to this check when both run
        missing = "nvidia-ml-py" in nvml.error
        fix = (
            "pip install nvidia-ml-py (a dependency of sm120kit)"
            if missing
            else "install the NVIDIA driver (570 or newer for Blackwell), then check `nvidia-smi`"
        )
        return Check("driver", Status.FAIL, nvml.error, fix)
    cuda = nvml.cuda_driver_version
    cuda_text = f"CUDA {cuda // 1000}.{cuda % 1000 // 10}" if cuda else "CUDA unknown"
    detail = f"driver {nvml.driver_version or '?'}, {cuda_text}"
    if cuda and cuda < CUDA_FOR_SM120:
        return Check(
            "driver",
            Status.FAIL,
            detail + ": SM120 needs a CUDA 12.8 driver or newer",
            "upgrade the NVIDIA driver (570+)",
        )
    return Check("driver", Status.OK, detail)


def _inventory(seen: list[Gpu]) -> str:
    names: dict[str, list[int]] = {}
    for g in seen:
        names.setdefault(f"{g.name} (CC {g.compute_capability}, {g.memory_total_mib // 1024} GiB)", []).append(g.index)
    return f"{len(seen)} GPU(s): " + "; ".join(f"{ranges(ix)}: {n}" for n, ix in names.items())


def gpus(inputs: CheckInputs) -> Check:
    """The GPUs a server with the profile would see (CUDA_VISIBLE_DEVICES applied): their
    count, compute capability, memory size and free memory against the profile."""
    node, profile = inputs.node, inputs.profile
    if node.nvml.error:
        if "driver" in inputs.running:  # one broken thing is reported once
            return Check("gpus", Status.INFO, "not read (no NVML)")
        need = profile.node.gpus if profile else 1
        return Check(
            "gpus",
            Status.FAIL,
            f"cannot tell whether the {need} GPU{'s' * (need != 1)} the profile needs "
            f"{'are' if need != 1 else 'is'} here: {node.nvml.error}",
            f"install the NVIDIA driver (570 or newer for Blackwell) and check `nvidia-smi`; {NO_GPU_CHECK}",
        )
    env = inputs.server_env
    seen = visible(node.gpus, env)
    detail = _inventory(seen) if seen else "no GPU found"
    if len(seen) < len(node.gpus):
        detail += f" of {len(node.gpus)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})"
    if profile is None:
        if not seen:
            return Check("gpus", Status.FAIL, detail, "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
        if other := [g.index for g in seen if not g.compute_capability.startswith("12.")]:
            return Check(
                "gpus",
                Status.WARN,
                detail + f" — GPU {ranges(other)} is not SM120 (compute capability 12.x): sm120kit's patches and "
                "profiles target SM120, so its profiles do not fit here and its patches may not be what this GPU needs",
                "run sm120kit on an SM120 node (RTX PRO 6000 Blackwell, RTX 50xx), or check a profile's own "
                "requirements with --profile NAME",
            )
        return Check("gpus", Status.OK, detail)
    who = f"profile {profile.name}" if profile.name else "the profile"
    hardware = _hardware_problems(profile, who, seen, "found" if len(seen) == len(node.gpus) else "visible")
    memory = _memory_problems(profile, seen[: profile.node.gpus])
    if not hardware and not memory:
        return Check("gpus", Status.OK, detail + f" — meets {who}")
    fixes = []
    if hardware:
        fixes.append(
            f"run it on a node with what {who} needs, or use a profile for this hardware (`sm120kit profiles`)"
        )
    if memory:
        fixes.append("free the GPUs (stale sglang processes: `--kill-stale`)")
    return Check("gpus", Status.FAIL, detail + " — " + "; ".join(hardware + memory), "; ".join([*fixes, NO_GPU_CHECK]))


def _hardware_problems(profile: Profile, who: str, seen: list[Gpu], found: str) -> list[str]:
    need, cc, size_gb = profile.node.gpus, profile.node.compute_capability, profile.node.gpu_memory_gb
    used = seen[:need]
    problems = [f"{who} needs {need} GPUs, {len(seen)} {found}"] if len(seen) < need else []
    if cc and (wrong := [g.index for g in used if g.compute_capability != cc]):
        problems.append(f"{who} is for compute capability {cc} (SM{cc.replace('.', '')}); GPU {ranges(wrong)} is not")
    if small := [g.index for g in used if size_gb and g.memory_total_mib < size_gb * 0.95 * 1000**3 / (1 << 20)]:
        problems.append(f"{who} is sized for {size_gb} GB per GPU; GPU {ranges(small)} has less")
    return problems


def _memory_problems(profile: Profile, used: list[Gpu]) -> list[str]:
    """sglang takes mem_fraction_static of each GPU's memory at start: it must be free."""
    fraction = profile.engine.mem_fraction_static or DEFAULT_MEM_FRACTION
    problems = []
    for g in used:
        if g.free_mib < fraction * g.memory_total_mib:
            holders = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in g.pids.items()) or "no process NVML can name"
            problems.append(
                f"GPU {g.index} has {g.free_mib} of {g.memory_total_mib} MiB free, below {fraction:g} of it; "
                f"held by {holders}"
            )
    return problems


def persistence(inputs: CheckInputs) -> Check:
    found = inputs.node.gpus
    if off := [g.index for g in found if g.persistence_mode is False]:
        return Check(
            "persistence",
            Status.WARN,
            f"persistence mode off on GPU {ranges(off)}: each start re-initialises the GPUs",
            "sudo nvidia-smi -pm 1 (or enable nvidia-persistenced)",
        )
    return Check("persistence", Status.OK if found else Status.INFO, "on" if found else "no GPU")


def pcie(inputs: CheckInputs) -> Check:
    found = inputs.node.gpus
    if narrow := [g for g in found if g.pcie.narrow]:
        what = "; ".join(f"GPU {g.index} at x{g.pcie.width} of x{g.pcie.max_width}" for g in narrow)
        return Check(
            "pcie",
            Status.WARN,
            f"{what}: one slow link throttles every rank of a TP group",
            "reseat the card or move it to a full-width slot; check the BIOS bifurcation setting",
        )
    if not found:
        return Check("pcie", Status.INFO, "no GPU")
    links = sorted({f"Gen{g.pcie.max_gen} x{g.pcie.max_width}" for g in found})
    return Check("pcie", Status.OK, "full width: " + ", ".join(links) + " (an idle GPU may show a lower generation)")


def gpu_processes(inputs: CheckInputs) -> Check:
    found = inputs.node.gpus
    if busy := [(g.index, pid, mib) for g in found for pid, mib in g.processes.items()]:
        listing = ", ".join(f"pid {pid} on GPU {i} ({mib} MiB)" for i, pid, mib in busy)
        return Check(
            "gpu processes",
            Status.WARN,
            f"memory already held: {listing}",
            "stop them (stale sglang ones: `sm120kit serve NAME --check --kill-stale`)",
        )
    return Check("gpu processes", Status.OK if found else Status.INFO, "none" if found else "no GPU")


def peer_to_peer(inputs: CheckInputs) -> Check:
    from sm120kit.node.checks.system import virtualisation

    count = len(inputs.node.gpus)
    if count < 2:
        return Check("p2p", Status.INFO, "fewer than two GPUs")
    bad = [(i, j, c) for i, row in enumerate(inputs.node.nvml.p2p) for j, c in enumerate(row) if c and not c.ok]
    if not bad:
        return Check("p2p", Status.OK, f"read and write between all {count} GPUs")
    why = sorted({c.read if c.read != "ok" else c.write for _, _, c in bad})
    fix = (
        "GPU peer-to-peer does not pass this VM's IOMMU (VFIO): run in an LXC container or on the host"
        if virtualisation(inputs).data.get("vm")
        else "disable ACS in the BIOS (or PCIe switch), boot with iommu=pt, and check `nvidia-smi topo -p2p r`"
    )
    pairs = len({tuple(sorted((i, j))) for i, j, _ in bad})
    return Check(
        "p2p", Status.FAIL, f"{pairs} GPU pair(s) without P2P ({', '.join(why)}): NCCL falls back to host memory", fix
    )


def numa_of(node: Snapshot, bus_id: str) -> int | None:
    """/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node; NVML's bus id has an 8-digit domain."""
    domain, _, rest = bus_id.lower().partition(":")
    value = node.text(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def topology(inputs: CheckInputs) -> Check:
    """The NUMA node of each GPU (from /sys): GPUs on two or more sockets need NCCL_P2P_LEVEL=SYS
    to keep P2P between them. Unknown NUMA nodes (NVML replayed on another machine, or no
    /sys entry) are said to be unknown, never grouped."""
    node, profile = inputs.node, inputs.profile
    if len(node.gpus) < 2:
        return Check("topology", Status.INFO, "fewer than two GPUs")
    numa = {g.index: numa_of(node, g.pci_bus_id) for g in node.gpus}
    data = {"numa": numa}
    groups: dict[int, list[int]] = {}
    for i, n in numa.items():
        if n is not None and n >= 0:
            groups.setdefault(n, []).append(i)
    missing = [i for i, n in numa.items() if n is None]
    unset = [i for i, n in numa.items() if n is not None and n < 0]
    parts = [f"{n}: GPU {ranges(ix)}" for n, ix in sorted(groups.items())]
    if missing:
        parts.append(f"unknown: GPU {ranges(missing)}")
    if unset:
        parts.append(f"none given (-1): GPU {ranges(unset)}")
    detail = "NUMA " + "; ".join(parts)
    if not groups and missing:
        return Check(
            "topology",
            Status.INFO,
            "the NUMA node of each GPU is unknown here (no /sys/bus/pci/devices/<bus id>/numa_node); "
            "run doctor on the node, or --root a copy of its /sys",
            data=data,
        )
    if not groups:
        return Check("topology", Status.INFO, "the kernel gives no NUMA node for the GPUs (numa_node is -1)", data=data)
    if len(groups) < 2:
        return Check("topology", Status.OK, detail, data=data)
    level = (profile.env if profile else {}).get("NCCL_P2P_LEVEL") or node.env.get("NCCL_P2P_LEVEL")
    detail += f": GPUs on {len(groups)} NUMA nodes; peer traffic between them crosses the CPU socket"
    if level != "SYS":
        return Check(
            "topology",
            Status.WARN,
            detail + f" and NCCL_P2P_LEVEL is {level or 'unset'}",
            "set NCCL_P2P_LEVEL=SYS (the sm120-base profile does) so NCCL keeps P2P across the socket",
            data,
        )
    return Check("topology", Status.OK, detail + " (NCCL_P2P_LEVEL=SYS)", data=data)
