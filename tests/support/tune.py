"""What tune-moe's tests share: the GPU they tune for, the Kimi K2 model (its config.json, and
an fp8 MoE shape no release ships a table for), a release's MoE layers unpacked with a Triton
beside them, and tables to install."""

from __future__ import annotations

import shutil
from pathlib import Path

from sm120kit import wheels
from sm120kit.target import resolve_target
from sm120kit.tune.install import TuneMeta
from sm120kit.tune.shape import MoeShape
from support.sites import MEMBERS

SERVER = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
TUNED_RELEASE = "0.5.23"  # the release tune-moe's end-to-end tests tune (its MoE layers and kernel)
TRITON = "3.6.0"
# sglang's MoE layers and kernels: what a release install needs for tune-moe.
MOE_MEMBERS = ["sglang/srt/layers/moe/*", "sglang/kernels/ops/moe/*"]
MOE = "sglang/srt/layers/moe/*"
# Kimi K2 (moonshotai/Kimi-K2-Thinking config.json): DeepseekV3, 384 routed experts, hidden
# 7168, moe_intermediate 2048, top-8; compressed-tensors W4A16, symmetric, group 32.
KIMI_K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
            }
        },
        "ignore": ["lm_head"],
    },
}
# A Kimi-K2-class fp8 shape on one of 8 GPUs (384 experts, 2048/8 per GPU): no release ships it.
KIMI_K2_FP8_TP8 = MoeShape(384, 7168, 256, 256, 8, "fp8_w8a8", (128, 128), model="Kimi-K2 fp8, tp 8")


def release(site: Path, version: str, *, triton: str = TRITON, patches: bool = False):
    """sglang==version's MoE layers (and with `patches`, the files the patches touch) in
    `site`, with a Triton distribution of that version beside it. Returns the target."""
    wheels.install(site, "sglang", version, [*MEMBERS, MOE] if patches else [MOE])
    set_triton(site, triton)
    return resolve_target(site=str(site))


def set_triton(site: Path, version: str) -> None:
    """The installed Triton as its dist-info names it (what sm120kit reads its version from)."""
    for old in site.glob("triton-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"triton-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {version}\n\n")


def configs(seed: int, sizes=(1, 16, 256, 1024)) -> dict[int, dict]:
    """A table of configs, one per batch size, told apart by `seed`."""
    return {
        m: {
            "BLOCK_SIZE_M": 16 * (1 + i % 3),
            "BLOCK_SIZE_N": 64,
            "BLOCK_SIZE_K": 128,
            "GROUP_SIZE_M": seed,
            "num_warps": 4,
            "num_stages": 2 + i % 3,
        }
        for i, m in enumerate(sizes)
    }


def meta(version: str, shape: MoeShape, *, down: bool = False, device: str = SERVER) -> TuneMeta:
    return TuneMeta(shape, version, TRITON, device, profile="kimi-k2-fp8", down=down)
