"""A node as doctor and serve's checks read it: /proc and /sys trees written in the kernel's
own formats, the NVML document of an RTX PRO 6000 Blackwell Server Edition node (8 cards,
CC 12.0, two sockets; tests/fixtures/doctor), and what a check looks at."""

from __future__ import annotations

import json
from pathlib import Path

from sm120kit.node.registry import CheckInputs
from sm120kit.node.snapshot import Snapshot
from support.paths import FIXTURES

DOCTOR_FIXTURES = FIXTURES / "doctor"
# NVML as it answers on the healthy SM120 node (written from the cards' specifications).
SM120_NVML = json.loads((DOCTOR_FIXTURES / "rtx-pro-6000-x8.json").read_text())
# The PCI buses of its 8 GPUs: the first four on NUMA node 0, the others on node 1.
BUS = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max open files            {nofile:<20} 1048576              files
Max locked memory         {memlock:<20} unlimited            bytes
"""


def node_tree(
    root: Path,
    *,
    cmdline="BOOT_IMAGE=/vmlinuz-6.8.0-49-generic ro amd_iommu=on iommu=pt",
    hmm="Y",
    vendor="Supermicro",
    product="AS -4125GS-TNRT",
    hypervisor=False,
    shm="tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0",
    docker=False,
    nofile="1048576",
    memlock="unlimited",
    iommu_type=None,
) -> Path:
    """The healthy node's /proc and /sys under `root` (doctor's --root), each keyword one of
    the seeds' broken states."""
    files = {
        "proc/cmdline": cmdline + "\n",
        "proc/mounts": "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n" + shm + "\n",
        "proc/self/limits": LIMITS.format(nofile=nofile, memlock=memlock),
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu vme de pse tsc msr pae sse sse2 avx2"
        + (" hypervisor" if hypervisor else "")
        + "\n",
        "proc/1/environ": "",
        "proc/1/cgroup": "0::/init.scope\n",
        "sys/module/nvidia_uvm/parameters/uvm_disable_hmm": hmm + "\n",
        "sys/class/dmi/id/sys_vendor": vendor + "\n",
        "sys/class/dmi/id/product_name": product + "\n",
        **{f"sys/bus/pci/devices/0000:{b}:00.0/numa_node": f"{i // 4}\n" for i, b in enumerate(BUS)},
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for group in range(40):  # the domain type follows iommu=pt, unless the kernel's default says otherwise
        (root / "sys/kernel/iommu_groups" / str(group)).mkdir(parents=True, exist_ok=True)
        (root / "sys/kernel/iommu_groups" / str(group) / "type").write_text(
            (iommu_type or ("identity" if "iommu=pt" in cmdline else "DMA-FQ")) + "\n"
        )
    if docker:
        (root / ".dockerenv").write_text("")
    return root


def check_inputs(profile=None, env=None, gpus=None, **choices) -> CheckInputs:
    """What a check looks at: this environment, and NVML answering with these GPUs."""
    doc = {"gpus": [g.model_dump() for g in gpus or []]}
    return CheckInputs(Snapshot(Path("/"), env or {}, lambda: doc), profile, **choices)
