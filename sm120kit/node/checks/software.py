"""Checks of what runs on the node: CUDA and NCCL variables, the Python environment's
packages (from metadata, nothing imported), flashinfer's JIT cache, the model on disk."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.model_config import hub_cache
from sm120kit.node.check import Check, Status
from sm120kit.node.nvml_schema import visible

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs

PACKAGES = ("torch", "sglang", "flashinfer-python", "triton")


def environment(inputs: CheckInputs) -> Check:
    node, profile = inputs.node, inputs.profile
    problems, warns = [], []
    cvd = node.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and node.gpus:
        entries = [v for v in cvd.split(",") if v.strip()]
        seen = visible(node.gpus, node.env)
        if len(seen) < len(entries):
            problems.append(
                f"CUDA_VISIBLE_DEVICES={cvd} names a GPU NVML does not have (CUDA stops at it: {len(seen)} visible)"
            )
        if node.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            warns.append(
                "CUDA_VISIBLE_DEVICES is set but CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                "CUDA's order may differ from nvidia-smi's"
            )
    for name, want in (profile.env if profile else {}).items():
        have = node.env.get(name)
        if name.startswith(("NCCL_", "CUDA_")) and have is not None and have != want:
            warns.append(f"{name}={have} here; the profile sets {want} for the server")
    if problems:
        return Check(
            "environment",
            Status.FAIL,
            "; ".join(problems + warns),
            "fix CUDA_VISIBLE_DEVICES (indices or UUIDs from `nvidia-smi -L`)",
        )
    if warns:
        return Check(
            "environment",
            Status.WARN,
            "; ".join(warns),
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID; let the profile's env win",
        )
    return Check("environment", Status.OK, "CUDA and NCCL variables consistent")


def software(inputs: CheckInputs) -> Check:
    """The versions that matter, also recorded by bench (data["versions"])."""
    target = inputs.node.target
    if target is None:
        return Check("software", Status.INFO, "no Python environment given")
    found = {n: target.find(n) for n in PACKAGES}
    data = {"versions": {n: d.version if d else None for n, d in found.items()}}
    detail = ", ".join(f"{n} {d.version}" for n, d in found.items() if d) or "none of torch, sglang, flashinfer, triton"
    torch = found["torch"]
    cuda = re.search(r"\+cu(\d+)", torch.version) if torch else None
    if cuda and int(cuda.group(1)) < 128:
        return Check(
            "software",
            Status.FAIL,
            detail + f": torch built for CUDA {cuda.group(1)} has no sm_120 kernels",
            "pip install torch built for CUDA 12.8 or newer (cu128+)",
            data,
        )
    if not found["sglang"]:  # nothing to serve with: serve refuses such a target, doctor fails it
        return Check(
            "software",
            Status.FAIL,
            f"{detail}; sglang is not installed in {target.description}: there is no server to start",
            "install sglang there, or point sm120kit at the serving environment: --python EXE",
            data,
        )
    return Check("software", Status.OK, detail, data=data)


def jit_cache(inputs: CheckInputs) -> Check:
    target = inputs.node.target
    dist = target.find("flashinfer-python") if target else None
    if dist is None:
        return Check("jit cache", Status.INFO, "flashinfer is not installed")
    from sm120kit.patching import jit_cache as jc

    prebuilt = jc.prebuilt_package(dist)
    if prebuilt and target and (aot := target.find(prebuilt)):  # only when it is installed: else every node would warn
        return Check(
            "jit cache",
            Status.WARN,
            f"{aot.name} {aot.version} is installed: its prebuilt kernels win over patched sources",
            f"pip uninstall {aot.name}",
        )
    dirs = [p for p in jc.cache_dirs(dist) if p.exists()]
    return Check(
        "jit cache",
        Status.OK,
        f"{len(dirs)} flashinfer JIT cache dir(s) for {dist.version}"
        if dirs
        else f"empty for flashinfer {dist.version}",
    )


def disk(inputs: CheckInputs) -> Check:
    """The model on disk, or the free space to download it (model.size_gb)."""
    profile, env = inputs.profile, inputs.node.env
    if profile is None or not profile.model.path:
        return Check("disk", Status.INFO, "no model to look for")
    path = profile.model.path
    local = Path(path).expanduser()
    if not local.is_absolute() and not local.exists():
        local = hub_cache(env) / ("models--" + path.replace("/", "--"))
    where = local if local.exists() else next((p for p in local.parents if p.exists()), Path("/"))
    stat = os.statvfs(where)
    free_gb = stat.f_bavail * stat.f_frsize / 1000**3
    if local.exists():
        return Check("disk", Status.OK, f"model {path} present at {local}; {free_gb:,.0f} GB free there")
    size = profile.model.size_gb
    detail = f"model {path} not downloaded yet ({local}); {free_gb:,.0f} GB free at {where}"
    fix = f"huggingface-cli download {path}, or point model.path at a copy"
    if size and free_gb < size:
        return Check(
            "disk",
            Status.FAIL,
            detail + f", the model needs {size} GB",
            "free space there, set HF_HOME to a larger disk, or " + fix,
        )
    return Check("disk", Status.INFO, detail + (f" (the model needs {size} GB)" if size else ""), fix)


NVCC_FOR_SM120 = (12, 9)  # below it flashinfer 0.6.3-0.6.6 and 0.7.1+ build compute_120a (flashinfer-compute-120a)


def nvcc(inputs: CheckInputs) -> Check | None:
    """The CUDA toolkit flashinfer's JIT compiles with (sm120kit.cuda_toolkit), in the
    server's environment."""
    from sm120kit.cuda_toolkit import flashinfer_nvcc

    target = inputs.node.target
    dist = target.find("flashinfer-python") if target else None
    if dist is None:
        return None
    found = flashinfer_nvcc(inputs.server_env)
    if found is None:
        return Check("nvcc", Status.INFO, "no nvcc: flashinfer's JIT falls back to torch's CUDA version")
    compiler, release = found
    if release is None:
        return Check("nvcc", Status.INFO, f"{compiler}: its release is not readable (the toolkit's version.json)")
    said = f"flashinfer {dist.version} compiles with {compiler} (CUDA {'.'.join(map(str, release))})"
    if release < NVCC_FOR_SM120:
        return Check(
            "nvcc",
            Status.WARN,
            f"{said}: below 12.9 flashinfer's JIT has no 120f/121 target (0.6.7-0.7.0 refuse to build; 0.6.3-0.6.6 "
            "and 0.7.1+ build compute_120a: known failure flashinfer-compute-120a)",
            "install the CUDA 12.9+ toolkit and point CUDA_HOME at it",
        )
    return Check("nvcc", Status.OK, said)
