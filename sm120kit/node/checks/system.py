"""Checks of the kernel and the machine, from /proc and /sys under the snapshot's root:
IOMMU, nvidia_uvm's HMM, virtualisation, /dev/shm, resource limits."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs

GIB = 1 << 30
SHM_MIN = 1 * GIB  # below this sglang's shared-memory queues fail (docker's default is 64 MB)
SHM_GOOD = 16 * GIB
NOFILE_GOOD = 65535  # sglang raises its own soft limit to this
HYPERVISORS = ("KVM", "QEMU", "VMware", "VirtualBox", "Xen", "Microsoft Corporation", "Amazon EC2", "Google")


def iommu(inputs: CheckInputs) -> Check:
    node = inputs.node
    cmdline = (node.text("/proc/cmdline") or "").split()
    groups = node.entries("/sys/kernel/iommu_groups")
    if not groups:
        return Check("iommu", Status.OK, "no IOMMU groups: DMA is not translated")
    if "iommu=pt" in cmdline or "iommu.passthrough=1" in cmdline:
        return Check("iommu", Status.OK, "IOMMU on, iommu=pt (passthrough) on the kernel command line")
    types = {(node.text(f"/sys/kernel/iommu_groups/{g}/type") or "").strip() for g in groups} - {""}
    if types == {"identity"}:  # a kernel built with passthrough as its default domain
        return Check("iommu", Status.OK, "IOMMU on, every group in passthrough (identity) domains")
    return Check(
        "iommu",
        Status.FAIL,
        "IOMMU on without iommu=pt: GPU peer-to-peer DMA is translated and NCCL hangs",
        "add iommu=pt to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot",
    )


def uvm_hmm(inputs: CheckInputs) -> Check:
    value = inputs.node.text("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    if value is None:
        return Check("nvidia_uvm hmm", Status.INFO, "nvidia_uvm is not loaded (it loads with the first CUDA program)")
    if value.strip().upper() in ("N", "0"):
        return Check(
            "nvidia_uvm hmm",
            Status.WARN,
            "HMM is on in nvidia_uvm: on some kernels CUDA does not initialise until it is off",
            "echo 'options nvidia_uvm uvm_disable_hmm=1' | sudo tee /etc/modprobe.d/nvidia-uvm.conf; "
            "reload nvidia_uvm or reboot",
        )
    return Check("nvidia_uvm hmm", Status.OK, "HMM off (uvm_disable_hmm=1)")


def virtualisation(inputs: CheckInputs) -> Check:
    node = inputs.node
    vendor = " ".join(
        filter(None, (node.text("/sys/class/dmi/id/sys_vendor"), node.text("/sys/class/dmi/id/product_name")))
    ).strip()
    flags = re.search(r"^flags\s*:(.*)$", node.text("/proc/cpuinfo") or "", re.M)
    vm = next((v for v in HYPERVISORS if v.lower() in vendor.lower()), None)
    if vm is None and flags and "hypervisor" in flags.group(1).split():
        vm = "a hypervisor"
    environ = node.text("/proc/1/environ") or ""
    cgroup = node.text("/proc/1/cgroup") or ""
    container = (
        "docker"
        if node.exists("/.dockerenv")
        else "podman"
        if node.exists("/run/.containerenv")
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
    return Check("virtualisation", Status.INFO, ", ".join(parts), data={"vm": vm, "container": container})


def shm(inputs: CheckInputs) -> Check:
    for line in (inputs.node.text("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[1] == "/dev/shm":
            return _shm_size(fields[3])
    return Check("/dev/shm", Status.WARN, "not mounted", "mount a tmpfs on /dev/shm (docker: --shm-size 32g)")


def _shm_size(options: str) -> Check:
    size = re.search(r"size=(\d+)([kmg]?)", options)
    if not size:
        return Check("/dev/shm", Status.OK, "mounted, no size limit (half of RAM by default)")
    n = int(size.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[size.group(2)]
    text = f"{n / GIB:.2f} GiB" if n >= GIB else f"{n >> 20} MiB"
    fix = "docker run --shm-size 32g (or --ipc=host); for LXC raise the tmpfs size"
    if n < SHM_MIN:
        return Check(
            "/dev/shm",
            Status.FAIL,
            f"{text}: too small for sglang's shared-memory queues (docker's default is 64 MB)",
            fix,
        )
    if n < SHM_GOOD:
        return Check("/dev/shm", Status.WARN, f"{text}: small for 8 ranks at high concurrency", fix)
    return Check("/dev/shm", Status.OK, text)


def limits(inputs: CheckInputs) -> Check:
    text = inputs.node.text("/proc/self/limits") or ""
    soft = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)", text, re.M)}
    problems = []
    nofile = soft.get("Max open files")
    if nofile and nofile != "unlimited" and int(nofile) < NOFILE_GOOD:
        problems.append(f"open files {nofile} (sglang wants {NOFILE_GOOD})")
    memlock = soft.get("Max locked memory")
    if memlock and memlock != "unlimited":
        problems.append(f"locked memory {int(memlock) >> 10} KiB (NCCL and pinned buffers want unlimited)")
    if problems:
        return Check(
            "limits",
            Status.WARN,
            "; ".join(problems),
            "ulimit -n 65535 -l unlimited (systemd: LimitNOFILE=65535, LimitMEMLOCK=infinity; "
            "docker: --ulimit memlock=-1)",
        )
    return Check(
        "limits", Status.OK if text else Status.INFO, "open files and locked memory fine" if text else "unknown"
    )
