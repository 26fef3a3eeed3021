"""The node a launch is judged for: the compute capability presented to sglang's
resolution and to the launch rules, and where it was read.

`--capability` first (a node that is not this machine); then the profile's
node.compute_capability (serve's GPU check holds the node to it); then NVML's GPU 0; else
the SM120 node this kit is for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.resolution.run import Node

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile

CAPABILITIES = ("12.0", "12.1")


def presented_node(profile: Profile, explicit: str | None = None) -> Node:
    gpus = max(profile.node.gpus, profile.parallel.tp)
    memory = (profile.node.gpu_memory_gb or 96) * 1024
    if explicit:
        return Node(explicit, gpus, memory, source="--capability")
    if profile.node.compute_capability:
        return Node(profile.node.compute_capability, gpus, memory, source=f"profile {profile.name}")
    from sm120kit.node.nvml import gpus_here

    found = gpus_here()
    if found:
        gpu = found[0]
        return Node(gpu.compute_capability, len(found), gpu.memory_total_mib, gpu.name, source="NVML")
    return Node("12.0", gpus, memory, source="assumed: an SM120 node")
