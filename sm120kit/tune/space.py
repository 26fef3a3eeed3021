"""The candidate configs for one MoE shape: the search space of sglang's own tuning script.

Source: sglang's benchmark/kernels/fused_moe_triton/common_utils.py,
`get_configs_compute_bound()` (its CUDA branch), and the block-shape filter in
tuning_fused_moe_triton.py's main(); the script is not in the wheel. The same values stand
in vLLM's benchmark_moe.py, which it was adapted from. Configs are dicts with the keys, in
the order, of sglang's config JSON files (`sort_config`).
"""

from __future__ import annotations

import itertools

from sm120kit.tune.shape import MoeShape

# Loop order of get_configs_compute_bound(): stages, M, K, N, warps, group.
SPACE = {
    "num_stages": (2, 3, 4, 5),
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "num_warps": (4, 8),
    "GROUP_SIZE_M": (1, 16, 32, 64),
}
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# The dtypes whose kernel reads one activation/weight scale per BLOCK_SIZE_K step of a block-
# quantised K (fused_moe_kernel's group_k path): there a tile may not straddle a quant block.
BLOCK_K_DIVIDES = ("fp8_w8a8", "int8_w8a8")


def full_space() -> list[dict]:
    """All 1920 configs, in the tuning script's order."""
    configs = []
    for values in itertools.product(*SPACE.values()):
        point = dict(zip(SPACE, values))
        configs.append({key: point[key] for key in CONFIG_KEYS})
    return configs


def search_space(shape: MoeShape) -> list[dict]:
    """The configs sglang's tuning script would time for this shape. With block-wise w8a8
    quantisation it keeps only BLOCK_SIZE_K that divide the quant block's k
    (`block_k % BLOCK_SIZE_K == 0`: 64 and 128 for [128, 128]); BLOCK_SIZE_N is not filtered
    (the kernel reads the N scales per column).

    One departure, on purpose: the script applies that filter to any block_shape, including
    the [0, group_size] of int4_w4a16 / int8_w8a16, where it leaves nothing for a group size
    below 64 (e.g. 32). fused_moe_kernel_gptq_awq indexes the scales per element of K, so no
    BLOCK_SIZE_K is wrong there: the full space is kept for those dtypes."""
    configs = full_space()
    if shape.block_shape and shape.dtype in BLOCK_K_DIVIDES:
        block_k = shape.block_shape[1]
        configs = [c for c in configs if block_k % c["BLOCK_SIZE_K"] == 0]
    return configs
