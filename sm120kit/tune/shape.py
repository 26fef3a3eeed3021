"""One fused-MoE layer as one GPU of the server runs it: the numbers sglang builds its
config file name from, and the ones the kernel is compiled and timed with."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoeShape:
    experts: int  # E: w2.shape[0] on one GPU (after expert parallelism and shared-expert fusion)
    hidden: int  # the model's hidden_size: K of the up GEMM, N of the down GEMM
    intermediate: int  # per-GPU moe_intermediate_size: the up GEMM's N is 2x this, the down GEMM's K
    shard: int  # N as sglang names the file: w2.shape[2] (== intermediate unless the weights are packed)
    top_k: int  # experts per token (plus fused shared experts)
    dtype: str | None  # sglang's config dtype: None (bf16/fp16), "fp8_w8a8", "int8_w8a8", "int4_w4a16", ...
    block_shape: tuple[int, int] | None = None  # [block_n, block_k] of block-wise quantization
    per_channel_quant: bool = False
    model: str = ""  # where the numbers came from, for messages

    def to_json(self) -> dict:
        return asdict(self)
