"""The slots of a launch (what the kernel table speaks of) from sglang's resolved record,
or from the rendered flags when sglang's own resolution could not run.

Each release spells its fields its own way (nsa_* until 0.5.12, dsa_* from 0.5.13); the
first spelling the record has wins. A slot that the chosen attention backend never reads
runs nothing and is left out: the DSA backends exist only under the nsa/dsa attention
backend, per phase.
"""

from __future__ import annotations

from collections.abc import Mapping

FIELDS: dict[str, tuple[str, ...]] = {
    "attention.prefill": ("prefill_attention_backend", "attention_backend"),
    "attention.decode": ("decode_attention_backend", "attention_backend"),
    "dsa.prefill": ("dsa_prefill_backend", "nsa_prefill_backend"),
    "dsa.decode": ("dsa_decode_backend", "nsa_decode_backend"),
    "moe.runner": ("moe_runner_backend",),
    "kv_cache_dtype": ("kv_cache_dtype",),
    "quantization": ("quantization",),
    "sampling": ("sampling_backend",),
    "fp8_gemm": ("fp8_gemm_runner_backend", "fp8_gemm_backend"),
    "fp4_gemm": ("fp4_gemm_runner_backend", "fp4_gemm_backend"),
    "speculative": ("speculative_algorithm",),
}
# What a resolution keeps of sglang's record: every field a slot reads, and the switches.
RECORD_FIELDS = tuple(
    sorted(
        {name for names in FIELDS.values() for name in names}
        | {
            "disable_custom_all_reduce",
            "enable_flashinfer_allreduce_fusion",
            "disable_cuda_graph",
            "cuda_graph_backend_decode",  # 0.5.20 on: "disabled" turns decode graphs off
            "cuda_graph_backend_prefill",
            "page_size",
            "moe_a2a_backend",
            "linear_attn_backend",
            "mamba_backend",
            "dsa_topk_backend",
        }
    )
)
DSA_ATTENTION = ("nsa", "dsa")  # the attention backends that dispatch the DSA backends
# The quantization a checkpoint declares, as sglang names it (quantization_config.quant_method,
# or ModelOpt's hf_quant_config.json quant_algo).
MODELOPT = {"NVFP4": "modelopt_fp4", "FP8": "modelopt_fp8", "W4A8_AWQ": "w4afp8"}


def _first(record: Mapping[str, object], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = record.get(name)
        if value is not None and value != "":
            return str(value).lower() if isinstance(value, bool) else str(value)
    return None


def declared_quantization(config: Mapping | None) -> str | None:
    """The quantization the model's config.json (or its hf_quant_config.json) declares."""
    if not config:
        return None
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(method := quant.get("quant_method"), str):
        if method == "modelopt" and isinstance(algo := quant.get("quant_algo"), str):
            return MODELOPT.get(algo.upper(), method)
        return method
    hf_quant = config.get("hf_quant_config")
    if isinstance(hf_quant, dict):
        algo = (
            (hf_quant.get("quantization") or {}).get("quant_algo")
            if isinstance(hf_quant.get("quantization"), dict)
            else None
        )
        if isinstance(algo, str):
            return MODELOPT.get(algo.upper(), algo.lower())
    return None


def fill(record: Mapping[str, object], config: Mapping | None = None) -> dict[str, str]:
    """slot -> value for one launch; slots sglang leaves unset, or that nothing reads, are absent."""
    slots = {slot: value for slot, names in FIELDS.items() if (value := _first(record, names)) is not None}
    for phase in ("prefill", "decode"):
        if slots.get(f"attention.{phase}") not in DSA_ATTENTION:
            slots.pop(f"dsa.{phase}", None)
    if "quantization" not in slots and (declared := declared_quantization(config)):
        slots["quantization"] = declared
    if record.get("enable_flashinfer_allreduce_fusion"):
        slots["allreduce"] = "flashinfer_fusion"
    elif "disable_custom_all_reduce" in record:
        slots["allreduce"] = "nccl" if record.get("disable_custom_all_reduce") else "custom"
    if "disable_cuda_graph" in record:
        off = record.get("disable_cuda_graph") or record.get("cuda_graph_backend_decode") == "disabled"
        slots["cuda_graph"] = "off" if off else "on"
    architectures = (config or {}).get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        slots["architecture"] = architectures[0]
    return slots


def from_flags(flags: list[str]) -> dict[str, object]:
    """A record of what the flags say (`--attention-backend x` -> attention_backend = "x",
    a flag with no value -> True): the fallback when sglang's resolution cannot run. What
    the flags leave to sglang is absent, and so is not judged."""
    record: dict[str, object] = {}
    for i, word in enumerate(flags):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        following = flags[i + 1] if i + 1 < len(flags) else None
        if eq:
            record[name.replace("-", "_")] = value
        elif following is not None and not following.startswith("--"):
            record[name.replace("-", "_")] = following
        else:
            record[name.replace("-", "_")] = True
    return record
