"""The doctor's checks. Each is one small unit, like a patch: what it reads (through the
Host seam: a root for /proc and /sys, the environment, the NVML document, the Python
environment), how it judges, and the fix. A check returns a Result; it never raises for
what it finds, and a file it cannot read makes it say "unknown", not fail."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
GIB = 1 << 30
SHM_MIN = 1 * GIB  # below this sglang's shared-memory queues fail (docker's default is 64 MB)
SHM_GOOD = 16 * GIB
NOFILE_GOOD = 65535  # sglang raises its own soft limit to this
CUDA_FOR_SM120 = 12080  # CUDA 12.8: the first toolkit and driver API with sm_120


@dataclass
class Host:
    """The node as the checks see it. Tests point root at a fixture tree and nvml at a
    recorded document; on a node root is "/" and nvml is the live answer."""

    root: Path
    env: dict[str, str]
    nvml: dict
    target: object | None = None  # the Python environment (sm120kit.target.Target)

    def text(self, path: str) -> str | None:
        try:
            return (self.root / path.lstrip("/")).read_text(errors="replace")
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return (self.root / path.lstrip("/")).exists()

    def entries(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.root / path.lstrip("/")))
        except OSError:
            return []

    @property
    def gpus(self) -> list[dict]:
        return self.nvml.get("gpus", [])


@dataclass
class Result:
    id: str
    status: str
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "check": self.id,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            **({"data": self.data} if self.data else {}),
        }


def _ranges(indices: list[int]) -> str:
    """[0,1,2,3,6] -> "0-3, 6"."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ", ".join(out)


# -- GPUs ------------------------------------------------------------------------------


def driver(host: Host, profile) -> Result:
    if "error" in host.nvml:  # serve's preflight refuses for the same reason
        missing = "nvidia-ml-py" in host.nvml["error"]
        fix = (
            "pip install nvidia-ml-py (a dependency of sm120kit)"
            if missing
            else "install the NVIDIA driver (570 or newer for Blackwell), then check `nvidia-smi`"
        )
        return Result("driver", FAIL, host.nvml["error"], fix)
    cuda = host.nvml.get("cuda_driver_version")
    cuda_text = f"CUDA {cuda // 1000}.{cuda % 1000 // 10}" if cuda else "CUDA unknown"
    detail = f"driver {host.nvml.get('driver_version', '?')}, {cuda_text}"
    if cuda and cuda < CUDA_FOR_SM120:
        return Result(
            "driver", FAIL, detail + ": SM120 needs a CUDA 12.8 driver or newer", "upgrade the NVIDIA driver (570+)"
        )
    return Result("driver", OK, detail)


def inventory(host: Host, profile) -> Result:
    gpus = host.gpus
    if "error" in host.nvml:
        return Result("gpus", INFO, "not read (no NVML)")
    names = {}
    for g in gpus:
        names.setdefault(f"{g['name']} (CC {g['compute_capability']}, {g['memory_total_mib'] // 1024} GiB)", []).append(
            g["index"]
        )
    detail = (
        f"{len(gpus)} GPU(s): " + "; ".join(f"{_ranges(ix)}: {n}" for n, ix in names.items())
        if gpus
        else "no GPU found"
    )
    if profile is None:
        return Result("gpus", OK if gpus else FAIL, detail, "" if gpus else "check `nvidia-smi`")
    node, problems = profile.node, []
    if len(gpus) < node.gpus:
        problems.append(f"profile {profile.name} needs {node.gpus} GPUs, {len(gpus)} found")
    wrong = [g["index"] for g in gpus if node.compute_capability and g["compute_capability"] != node.compute_capability]
    if wrong:
        problems.append(
            f"profile {profile.name} is for compute capability {node.compute_capability} (SM{node.compute_capability.replace('.', '')}); GPU {_ranges(wrong)} is not"
        )
    small = [
        g["index"]
        for g in gpus
        if node.gpu_memory_gb and g["memory_total_mib"] < node.gpu_memory_gb * 0.95 * 1000**3 / (1 << 20)
    ]
    if small:
        problems.append(
            f"profile {profile.name} is sized for {node.gpu_memory_gb} GB per GPU; GPU {_ranges(small)} has less"
        )
    if problems:
        return Result(
            "gpus",
            FAIL,
            detail + " — " + "; ".join(problems),
            f"run it on a node with what profile {profile.name} needs, or use a profile for this hardware (`sm120kit profiles`)",
        )
    return Result("gpus", OK, detail + f" — meets profile {profile.name}")


def persistence(host: Host, profile) -> Result:
    off = [g["index"] for g in host.gpus if g.get("persistence_mode") is False]
    if off:
        return Result(
            "persistence",
            WARN,
            f"persistence mode off on GPU {_ranges(off)}: each start re-initialises the GPUs",
            "sudo nvidia-smi -pm 1 (or enable nvidia-persistenced)",
        )
    return Result("persistence", OK if host.gpus else INFO, "on" if host.gpus else "no GPU")


def pcie(host: Host, profile) -> Result:
    narrow = [
        g
        for g in host.gpus
        if g["pcie"].get("width") and g["pcie"].get("max_width") and g["pcie"]["width"] < g["pcie"]["max_width"]
    ]
    links = sorted({f"Gen{g['pcie'].get('max_gen')} x{g['pcie'].get('max_width')}" for g in host.gpus})
    if narrow:
        what = "; ".join(f"GPU {g['index']} at x{g['pcie']['width']} of x{g['pcie']['max_width']}" for g in narrow)
        return Result(
            "pcie",
            WARN,
            f"{what}: one slow link throttles every rank of a TP group",
            "reseat the card or move it to a full-width slot; check the BIOS bifurcation setting",
        )
    return Result(
        "pcie",
        OK if host.gpus else INFO,
        ("full width: " + ", ".join(links) + " (an idle GPU may show a lower generation)") if host.gpus else "no GPU",
    )


def gpu_processes(host: Host, profile) -> Result:
    busy = [(g["index"], pid, mib) for g in host.gpus for pid, mib in g.get("processes", {}).items()]
    if busy:
        listing = ", ".join(f"pid {pid} on GPU {i} ({mib} MiB)" for i, pid, mib in busy)
        return Result(
            "gpu processes",
            WARN,
            f"memory already held: {listing}",
            "stop them (stale sglang ones: `sm120kit serve NAME --check --kill-stale`)",
        )
    return Result("gpu processes", OK if host.gpus else INFO, "none" if host.gpus else "no GPU")


def peer_to_peer(host: Host, profile) -> Result:
    p2p = host.nvml.get("p2p") or []
    if len(host.gpus) < 2:
        return Result("p2p", INFO, "fewer than two GPUs")
    bad = [
        (i, j, c)
        for i, row in enumerate(p2p)
        for j, c in enumerate(row)
        if c and (c["read"] != "ok" or c["write"] != "ok")
    ]
    if not bad:
        return Result("p2p", OK, f"read and write between all {len(host.gpus)} GPUs")
    why = sorted({c["read"] if c["read"] != "ok" else c["write"] for _, _, c in bad})
    in_vm = virtualisation(host, profile).data.get("vm")
    fix = (
        "GPU peer-to-peer does not pass this VM's IOMMU (VFIO): run in an LXC container or on the host"
        if in_vm
        else "disable ACS in the BIOS (or PCIe switch), boot with iommu=pt, and check `nvidia-smi topo -p2p r`"
    )
    pairs = len({tuple(sorted((i, j))) for i, j, _ in bad})
    return Result(
        "p2p", FAIL, f"{pairs} GPU pair(s) without P2P ({', '.join(why)}): NCCL falls back to host memory", fix
    )


def numa_of(host: Host, bus_id: str) -> int | None:
    """/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node; NVML's bus id has an 8-digit domain."""
    domain, _, rest = bus_id.lower().partition(":")
    value = host.text(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def topology(host: Host, profile) -> Result:
    if len(host.gpus) < 2:
        return Result("topology", INFO, "fewer than two GPUs")
    numa = {g["index"]: numa_of(host, g["pci_bus_id"]) for g in host.gpus}
    groups: dict = {}
    for i, n in numa.items():
        groups.setdefault(n, []).append(i)
    detail = "NUMA " + "; ".join(
        f"{'?' if n is None or n < 0 else n}: GPU {_ranges(ix)}"
        for n, ix in sorted(groups.items(), key=lambda kv: str(kv[0]))
    )
    levels = host.nvml.get("topology") or []
    across = any(level == "across-sockets" for row in levels for level in row if level)
    data = {"numa": numa}
    if across or len([n for n in groups if n is not None and n >= 0]) > 1:
        level = (profile.env if profile else {}).get("NCCL_P2P_LEVEL") or host.env.get("NCCL_P2P_LEVEL")
        detail += ": peer traffic between the groups crosses the CPU socket"
        if level != "SYS":
            return Result(
                "topology",
                WARN,
                detail + f" and NCCL_P2P_LEVEL is {level or 'unset'}",
                "set NCCL_P2P_LEVEL=SYS (the sm120-base profile does) so NCCL keeps P2P across the socket",
                data,
            )
        return Result("topology", OK, detail + " (NCCL_P2P_LEVEL=SYS)", data=data)
    return Result("topology", OK, detail, data=data)


# -- kernel and virtualisation ---------------------------------------------------------


def iommu(host: Host, profile) -> Result:
    cmdline = (host.text("/proc/cmdline") or "").split()
    groups = host.entries("/sys/kernel/iommu_groups")
    if not groups:
        return Result("iommu", OK, "no IOMMU groups: DMA is not translated")
    if "iommu=pt" in cmdline or "iommu.passthrough=1" in cmdline:
        return Result("iommu", OK, "IOMMU on, iommu=pt (passthrough) on the kernel command line")
    types = {(host.text(f"/sys/kernel/iommu_groups/{g}/type") or "").strip() for g in groups} - {""}
    if types == {"identity"}:  # a kernel built with passthrough as its default domain
        return Result("iommu", OK, "IOMMU on, every group in passthrough (identity) domains")
    return Result(
        "iommu",
        FAIL,
        "IOMMU on without iommu=pt: GPU peer-to-peer DMA is translated and NCCL hangs",
        "add iommu=pt to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot",
    )


def uvm_hmm(host: Host, profile) -> Result:
    value = host.text("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    if value is None:
        return Result("nvidia_uvm hmm", INFO, "nvidia_uvm is not loaded (it loads with the first CUDA program)")
    if value.strip().upper() in ("N", "0"):
        return Result(
            "nvidia_uvm hmm",
            WARN,
            "HMM is on in nvidia_uvm: on some kernels CUDA does not initialise until it is off",
            "echo 'options nvidia_uvm uvm_disable_hmm=1' | sudo tee /etc/modprobe.d/nvidia-uvm.conf; reload nvidia_uvm or reboot",
        )
    return Result("nvidia_uvm hmm", OK, "HMM off (uvm_disable_hmm=1)")


def virtualisation(host: Host, profile) -> Result:
    vendor = " ".join(
        filter(None, (host.text("/sys/class/dmi/id/sys_vendor"), host.text("/sys/class/dmi/id/product_name")))
    ).strip()
    flags = re.search(r"^flags\s*:(.*)$", host.text("/proc/cpuinfo") or "", re.M)
    vm = next(
        (
            v
            for v in ("KVM", "QEMU", "VMware", "VirtualBox", "Xen", "Microsoft Corporation", "Amazon EC2", "Google")
            if v.lower() in vendor.lower()
        ),
        None,
    )
    if vm is None and flags and "hypervisor" in flags.group(1).split():
        vm = "a hypervisor"
    environ = host.text("/proc/1/environ") or ""
    cgroup = host.text("/proc/1/cgroup") or ""
    container = (
        "docker"
        if host.exists("/.dockerenv")
        else "podman"
        if host.exists("/run/.containerenv")
        else "lxc"
        if "container=lxc" in environ or "/lxc" in cgroup
        else "docker"
        if "docker" in cgroup
        else None
    )
    parts = [
        f"virtual machine ({vm})" if vm else "bare metal",
        f"in a {container} container" if container else "no container",
    ]
    return Result("virtualisation", INFO, ", ".join(parts), data={"vm": vm, "container": container})


def shm(host: Host, profile) -> Result:
    for line in (host.text("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[1] == "/dev/shm":
            size = re.search(r"size=(\d+)([kmg]?)", fields[3])
            if not size:
                return Result("/dev/shm", OK, "mounted, no size limit (half of RAM by default)")
            n = int(size.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[size.group(2)]
            text = f"{n / GIB:.2f} GiB" if n >= GIB else f"{n >> 20} MiB"
            fix = "docker run --shm-size 32g (or --ipc=host); for LXC raise the tmpfs size"
            if n < SHM_MIN:
                return Result(
                    "/dev/shm",
                    FAIL,
                    f"{text}: too small for sglang's shared-memory queues (docker's default is 64 MB)",
                    fix,
                )
            if n < SHM_GOOD:
                return Result("/dev/shm", WARN, f"{text}: small for 8 ranks at high concurrency", fix)
            return Result("/dev/shm", OK, text)
    return Result("/dev/shm", WARN, "not mounted", "mount a tmpfs on /dev/shm (docker: --shm-size 32g)")


def limits(host: Host, profile) -> Result:
    text = host.text("/proc/self/limits") or ""
    soft = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)", text, re.M)}
    problems = []
    nofile = soft.get("Max open files")
    if nofile and nofile != "unlimited" and int(nofile) < NOFILE_GOOD:
        problems.append(f"open files {nofile} (sglang wants {NOFILE_GOOD})")
    memlock = soft.get("Max locked memory")
    if memlock and memlock != "unlimited":
        problems.append(f"locked memory {int(memlock) >> 10} KiB (NCCL and pinned buffers want unlimited)")
    if problems:
        return Result(
            "limits",
            WARN,
            "; ".join(problems),
            "ulimit -n 65535 -l unlimited (systemd: LimitNOFILE=65535, LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)",
        )
    return Result("limits", OK if text else INFO, "open files and locked memory fine" if text else "unknown")


# -- environment and software ----------------------------------------------------------


def environment(host: Host, profile) -> Result:
    from sm120kit.serve.gpus import Gpu, visible

    problems, warns = [], []
    cvd = host.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and host.gpus:
        gpus = [Gpu(g["index"], g["name"], g["uuid"], g["compute_capability"], 0, 0) for g in host.gpus]
        entries = [v for v in cvd.split(",") if v.strip()]
        seen = visible(gpus, host.env)
        if len(seen) < len(entries):
            problems.append(
                f"CUDA_VISIBLE_DEVICES={cvd} names a GPU NVML does not have (CUDA stops at it: {len(seen)} visible)"
            )
        if host.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            warns.append(
                "CUDA_VISIBLE_DEVICES is set but CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA's order may differ from nvidia-smi's"
            )
    for name, want in (profile.env if profile else {}).items():
        have = host.env.get(name)
        if name.startswith(("NCCL_", "CUDA_")) and have is not None and have != want:
            warns.append(f"{name}={have} here; the profile sets {want} for the server")
    if problems:
        return Result(
            "environment",
            FAIL,
            "; ".join(problems + warns),
            "fix CUDA_VISIBLE_DEVICES (indices or UUIDs from `nvidia-smi -L`)",
        )
    if warns:
        return Result(
            "environment", WARN, "; ".join(warns), "export CUDA_DEVICE_ORDER=PCI_BUS_ID; let the profile's env win"
        )
    return Result("environment", OK, "CUDA and NCCL variables consistent")


def software(host: Host, profile) -> Result:
    if host.target is None:
        return Result("software", INFO, "no Python environment given")
    found = {n: host.target.find(n) for n in ("torch", "sglang", "flashinfer-python", "triton")}
    parts = [f"{n} {d.version}" for n, d in found.items() if d]
    detail = ", ".join(parts) or "none of torch, sglang, flashinfer, triton"
    torch = found["torch"]
    cuda = re.search(r"\+cu(\d+)", torch.version) if torch else None
    if cuda and int(cuda.group(1)) < 128:
        return Result(
            "software",
            FAIL,
            detail + f": torch built for CUDA {cuda.group(1)} has no sm_120 kernels",
            "pip install torch built for CUDA 12.8 or newer (cu128+)",
        )
    if not found["sglang"]:
        return Result(
            "software",
            WARN,
            detail + "; sglang is not installed here",
            "install sglang, or point sm120kit at its environment with --python EXE",
        )
    return Result("software", OK, detail)


def patches(host: Host, profile) -> Result:
    if host.target is None or not host.target.find("sglang"):
        return Result("patches", INFO, "no sglang to check")
    from sm120kit.patching import engine
    from sm120kit.patching.registry import load_patches, select

    chosen = select(load_patches(None), profile.patches) if profile and profile.patches else load_patches(None)
    plan = engine.plan(host.target, chosen, need_bytes=False)
    code = plan.exit_code(check=True)
    counts: dict[str, int] = {}
    for f in plan.findings:
        counts[f.outcome.value] = counts.get(f.outcome.value, 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if unproven := sorted({f"{f.patch.id} ({f.unproven})" for f in plan.unproven}):
        detail += "; " + "; ".join(unproven)
    if code == 1:
        return Result("patches", WARN, detail, "sm120kit patch --verify")
    if code == 2:
        hints = [f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint]
        return Result(
            "patches",
            FAIL,
            detail,
            hints[0] if hints else "sm120kit status shows which; sm120kit patch --force only if the edits are yours",
        )
    if unproven:
        return Result(
            "patches",
            WARN,
            detail,
            "run by the shape of the code on a release newer than they were proven on: watch the first requests",
        )
    return Result("patches", OK, detail)


def jit_cache(host: Host, profile) -> Result:
    dist = host.target.find("flashinfer-python") if host.target else None
    if dist is None:
        return Result("jit cache", INFO, "flashinfer is not installed")
    from sm120kit.patching import jit_cache as jc

    dirs = [p for p in jc.cache_dirs(dist) if p.exists()]
    prebuilt = jc.prebuilt_package(dist)
    if prebuilt:
        return Result(
            "jit cache",
            WARN,
            f"{prebuilt} is installed: its prebuilt kernels win over patched sources",
            f"pip uninstall {prebuilt}",
        )
    return Result(
        "jit cache",
        OK,
        f"{len(dirs)} flashinfer JIT cache dir(s) for {dist.version}"
        if dirs
        else f"empty for flashinfer {dist.version}",
    )


def disk(host: Host, profile) -> Result:
    """The model on disk, or the free space to download it (model.size_gb)."""
    path = profile.model.path if profile and profile.model.path else None
    if not path:
        return Result("disk", INFO, "no model to look for")
    local = Path(path).expanduser()
    if not local.is_absolute() and not local.exists():
        hub = Path(
            host.env.get("HF_HUB_CACHE") or Path(host.env.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"
        )
        local = hub / ("models--" + path.replace("/", "--"))
    where = local if local.exists() else next((p for p in local.parents if p.exists()), Path("/"))
    stat = os.statvfs(where)
    free_gb = stat.f_bavail * stat.f_frsize / 1000**3
    if local.exists():
        return Result("disk", OK, f"model {path} present at {local}; {free_gb:,.0f} GB free there")
    size = profile.model.size_gb
    detail = f"model {path} not downloaded yet ({local}); {free_gb:,.0f} GB free at {where}"
    fix = f"huggingface-cli download {path}, or point model.path at a copy"
    if size and free_gb < size:
        return Result(
            "disk",
            FAIL,
            detail + f", the model needs {size} GB",
            "free space there, set HF_HOME to a larger disk, or " + fix,
        )
    return Result("disk", INFO, detail + (f" (the model needs {size} GB)" if size else ""), fix)


CHECKS = (
    driver,
    inventory,
    persistence,
    pcie,
    gpu_processes,
    peer_to_peer,
    topology,
    iommu,
    uvm_hmm,
    virtualisation,
    shm,
    limits,
    environment,
    software,
    patches,
    jit_cache,
    disk,
)


def run_all(host: Host, profile=None) -> list[Result]:
    results = []
    for check in CHECKS:
        try:
            results.append(check(host, profile))
        except Exception as exc:  # a check's bug must not hide the other checks
            results.append(
                Result(
                    check.__name__,
                    WARN,
                    f"the check itself failed: {type(exc).__name__}: {exc}",
                    "report it (rerun with --debug)",
                )
            )
    return results
