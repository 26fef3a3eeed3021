"""A profile's MoE as one GPU of the sglang server runs it, read from the model's config.json.

config.json is found and read by sm120kit.model_config (a local directory or the Hugging
Face cache, never the network). Its numbers and the profile's tp/ep, quantization and MoE
runner give the shape sglang names its Triton fused-MoE config file after — or the reason sglang would
not run this MoE on that kernel at all, in which case no tuned file would ever be read.

The rules below restate sglang 0.5.9-0.5.23 (the file is named next to each rule);
tests/test_tune_shapes.py holds them against the releases' own code and shipped config files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from packaging.version import Version

from sm120kit.errors import UserError
from sm120kit.model_config import find_model_config, read_model_config
from sm120kit.profiles.model import Profile
from sm120kit.tune.shape import MoeShape


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its MoE numbers in config.json, and which of sglang's
    shared-expert fusion gates applies to it (None: its shared experts are never fused)."""

    experts: str
    intermediate: str
    top_k: str
    shared: str | None = None
    fusion: str | None = None
    text_config: bool = False  # a multimodal wrapper: the numbers sit under "text_config"


_DEEPSEEK = Family("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", shared="n_shared_experts")
_QWEN = Family("num_experts", "moe_intermediate_size", "num_experts_per_tok")  # shared experts (Qwen2) run apart

# By config.json's architectures[0], as sglang picks the model class.
FAMILIES: dict[str, Family] = {
    "DeepseekV2ForCausalLM": _DEEPSEEK,  # the gate only knows the V3 class (models/deepseek_v2.py)
    "DeepseekV3ForCausalLM": replace(_DEEPSEEK, fusion="deepseek"),  # DeepSeek-V3/R1, Kimi K2 / K2-Thinking
    "GlmMoeDsaForCausalLM": replace(_DEEPSEEK, fusion="deepseek"),  # GLM-5 (models/glm4_moe.py)
    "KimiK25ForConditionalGeneration": replace(_DEEPSEEK, fusion="deepseek", text_config=True),  # Kimi K2.5
    "Glm4MoeForCausalLM": replace(_DEEPSEEK, fusion="glm4"),  # GLM-4.5 / 4.6 / 4.7
    "Qwen3MoeForCausalLM": _QWEN,
    "Qwen2MoeForCausalLM": _QWEN,
    "MixtralForCausalLM": Family("num_local_experts", "intermediate_size", "num_experts_per_tok"),
}
# Keys that make a config a MoE one: a dense model has none of them.
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")

# sglang's --moe-runner-backend triton moves compressed-tensors WNA16 experts from Marlin to
# the Triton kernel from 0.5.11 (quantization/compressed_tensors/compressed_tensors.py,
# get_moe_scheme; before it only ROCm took that path).
WNA16_TRITON_SINCE = "0.5.11"
# DeepSeek's fusion gate refuses W4A16 checkpoints from 0.5.16 (is_wint4afp8_or_wint4a16_config).
W4A16_UNFUSED_SINCE = "0.5.16"
# bf16 and fp8 experts run on Triton in every release of the window (0.5.9-0.5.23).
TRITON_ALWAYS = "0.5.9"


@dataclass(frozen=True)
class Quant:
    """How sglang runs one quantization's experts on SM120."""

    name: str  # for messages, e.g. "compressed-tensors W4A16 (int4, group 32)"
    dtype: str | None = None  # get_config_dtype_str on the Triton runner
    block_shape: tuple[int, int] | None = None  # [block_n, block_k] the kernel gets
    per_channel: bool = False
    pack: int = 1  # w2.shape[2] = per-GPU intermediate // pack on the Triton runner
    triton: str | None = "default"  # "default": auto picks Triton; "on-request": only with
    # --moe-runner-backend triton; None: sglang has no Triton path for it
    runner: str = "triton"  # what moe_runner_backend auto runs it on, on SM120
    why: str = ""  # why that runner is not Triton
    int4: bool = False


class NotTritonMoe(UserError):
    """The profile's MoE does not run on sglang's Triton fused-MoE kernel, so no tuned
    config file would be read for it. `triton_since` is the sglang release from which
    engine.moe_runner_backend = "triton" would put it there (None: never)."""

    def __init__(self, profile: str, runner: str, reason: str, triton_since: str | None) -> None:
        self.profile, self.runner, self.reason, self.triton_since = profile, runner, reason, triton_since
        hint = (
            f"run it on Triton with --set engine.moe_runner_backend=triton (sglang >= {triton_since}), "
            "or tune a profile whose MoE runs on Triton"
            if triton_since
            else "tune a profile whose MoE runs on Triton (bf16, fp8, or compressed-tensors W8A8 / W4A16 experts)"
        )
        super().__init__(
            f"profile {profile}'s MoE runs on {runner} ({reason}); "
            "sglang would not load Triton fused-MoE configs for it",
            hint,
        )


# -- the shape ------------------------------------------------------------------------------


def moe_shape(
    profile: Profile,
    config_path: Path | None = None,
    *,
    sglang_version: str | None = None,
    env: Mapping[str, str] = os.environ,
) -> MoeShape:
    """The fused-MoE shape of one GPU of `profile`'s server. Raises NotTritonMoe when sglang
    would run this MoE on another kernel, UserError for a dense model or a config sm120kit
    cannot read. `sglang_version` picks the rules of that release (default: the newest);
    `env` is where the Hugging Face cache is looked up when config_path is not given."""
    if config_path is None:
        if not profile.model.path:
            raise UserError(f"profile {profile.name} names no model ([model] path)", "set [model] path in the profile")
        config_path = find_model_config(profile.model.path, env=env)
    config = read_model_config(config_path)
    cfg = _Config(config, Path(config_path))
    family, text = _family(cfg)
    routed = text.positive(family.experts)
    intermediate = text.positive(family.intermediate)
    top_k = text.positive(family.top_k)
    quant = _quantization(profile, cfg, text)
    _require_triton(profile, quant, sglang_version)

    ep = profile.parallel.ep or 1
    tp = profile.parallel.tp
    if tp % ep:
        raise UserError(
            f"profile {profile.name}: parallel.ep = {ep} does not divide parallel.tp = {tp}",
            "sglang shards experts over ep and each expert over tp / ep: pick an ep that divides tp",
        )
    moe_tp = tp // ep
    if routed % ep or intermediate % moe_tp:
        raise UserError(
            f"profile {profile.name}: {routed} experts of width {intermediate} ({cfg.path}) do not split over "
            f"ep = {ep} and tp / ep = {moe_tp}",
            "pick tp and ep that divide the model's expert count and moe intermediate size",
        )
    per_gpu = intermediate // moe_tp
    if quant.block_shape and all(quant.block_shape) and per_gpu % quant.block_shape[0]:
        raise UserError(  # sglang's Fp8MoEMethod.create_weights refuses it the same way
            f"profile {profile.name}: the per-GPU expert width {intermediate} / {moe_tp} = {per_gpu} is not a multiple "
            f"of the fp8 weight block {quant.block_shape[0]} ({cfg.path})",
            "use a smaller tp, or expert parallelism (parallel.ep), so that each GPU holds whole weight blocks",
        )
    fused = _fused_shared_experts(profile, family, text, quant, ep, sglang_version)
    return MoeShape(
        experts=routed // ep + fused,
        hidden=text.positive("hidden_size"),
        intermediate=per_gpu,
        shard=per_gpu // quant.pack,
        top_k=top_k + fused,
        dtype=quant.dtype,
        block_shape=quant.block_shape,
        per_channel_quant=quant.per_channel,
        model=profile.model.path or str(config_path),
    )


def _newer(version: str | None, since: str) -> bool:
    return version is None or Version(version) >= Version(since)


def _fused_shared_experts(
    profile: Profile, family: Family, text: _Config, quant: Quant, ep: int, version: str | None
) -> int:
    """Shared experts sglang appends to the routed ones in w13/w2 (E and top-k grow by them).
    deepseek: DeepseekV2ForCausalLM.determine_num_fused_shared_experts (0.5.9-0.5.22),
    .shared_experts_fusion_disable_reason (0.5.23); glm4: the same on Glm4MoeForCausalLM."""
    shared = text.get(family.shared) if family.shared else None
    if not family.fusion or not shared or profile.engine.disable_shared_experts_fusion:
        return 0
    if ep > 1:  # on CUDA only AMD MI30x fuses under expert parallelism
        return 0
    if family.fusion == "deepseek":
        if text.get(family.experts) != 256 or shared != 1:  # 384 (Kimi) only for Quark MXFP4 (0.5.13+)
            return 0
        if quant.int4 and _newer(version, W4A16_UNFUSED_SINCE):
            return 0
    return int(shared)


def _require_triton(profile: Profile, quant: Quant, version: str | None) -> None:
    backend = profile.engine.moe_runner_backend or "auto"
    since = WNA16_TRITON_SINCE if quant.triton == "on-request" else None
    if backend == "auto":
        if quant.triton != "default":
            raise NotTritonMoe(profile.name, quant.runner, quant.why, since)
    elif backend == "triton":
        if quant.triton is None:
            raise NotTritonMoe(profile.name, quant.runner, f"{quant.name} has no Triton path in sglang", None)
        if quant.triton == "on-request" and not _newer(version, WNA16_TRITON_SINCE):
            raise NotTritonMoe(
                profile.name,
                quant.runner,
                f"sglang {version} ignores --moe-runner-backend triton for {quant.name}; {WNA16_TRITON_SINCE} added it",
                since,
            )
    else:
        raise NotTritonMoe(
            profile.name,
            backend,
            f"engine.moe_runner_backend = {backend!r} in the profile",
            TRITON_ALWAYS if quant.triton == "default" else since,
        )


# -- reading the config ---------------------------------------------------------------------


class _Config:
    """One JSON object of config.json, with errors that name the file and the key."""

    def __init__(self, data: dict, path: Path, prefix: str = "") -> None:
        self.data, self.path, self.prefix = data, path, prefix

    def get(self, key: str):
        return self.data.get(key)

    def key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def positive(self, key: str) -> int:
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            found = "is missing" if value is None else f"= {value!r} is not a positive integer"
            raise UserError(
                f"{self.path}: {self.key(key)} {found}",
                "check that this is the model's config.json (sm120kit reads the MoE sizes from it)",
            )
        return value

    def sub(self, key: str) -> _Config | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise UserError(f"{self.path}: {self.key(key)} is not a JSON object", "download the config.json again")
        return _Config(value, self.path, f"{self.prefix}{key}.")


def _family(cfg: _Config) -> tuple[Family, _Config]:
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    family = FAMILIES.get(arch or "")
    if family is None:
        sizes = cfg.sub("text_config") or cfg
        if not any(sizes.get(k) for k in EXPERT_KEYS):
            raise UserError(
                f"{cfg.path}: {arch or 'this model'} has no MoE (none of {', '.join(EXPERT_KEYS)} is set): "
                "there is no fused-MoE kernel to tune",
                "tune-moe is for mixture-of-experts models; pick a profile whose model has experts",
            )
        raise UserError(
            f"{cfg.path}: architectures = {archs!r} is a MoE sm120kit does not know how to read",
            f"known: {', '.join(FAMILIES)}",
        )
    text = cfg.sub("text_config") if family.text_config else cfg
    if text is None:
        raise UserError(f"{cfg.path}: text_config is missing ({arch} keeps its sizes there)", None)
    if not text.get(family.experts):
        raise UserError(
            f"{cfg.path}: {text.key(family.experts)} is not set: {arch} without experts is a dense model, "
            "with no fused-MoE kernel to tune",
            "tune-moe is for mixture-of-experts models; pick a profile whose model has experts",
        )
    return family, text


# sglang's --dtype auto serves float32 checkpoints in bf16/fp16, so every one of these runs
# under the config dtype None.
UNQUANTIZED_DTYPES = ("bfloat16", "float16", "half", "float32", "float")


def _unquantized(text: _Config, cfg: _Config) -> Quant:
    for where in (text, cfg):
        for key in ("torch_dtype", "dtype"):
            value = where.get(key)
            if value is None:
                continue
            if value not in UNQUANTIZED_DTYPES:
                raise UserError(
                    f"{cfg.path}: {where.key(key)} = {value!r} is a dtype sm120kit does not know for MoE weights",
                    f"known: {', '.join(UNQUANTIZED_DTYPES)} (or a quantization_config)",
                )
            return Quant(f"{value} experts")
    return Quant("bf16 experts")


def _quant_config(cfg: _Config, text: _Config) -> tuple[dict | None, str]:
    """quantization_config where sglang finds it: config.json (or its text_config),
    compression_config, or a ModelOpt hf_quant_config.json next to it."""
    for where in (cfg, text):
        for key in ("quantization_config", "compression_config"):
            found = where.sub(key)
            if found is not None:
                return found.data, f"{cfg.path}: {where.key(key)}"
    sidecar = cfg.path.parent / "hf_quant_config.json"
    if sidecar.is_file():
        doc = read_model_config(sidecar)
        inner = doc.get("quantization")
        if isinstance(inner, dict):
            return {"quant_method": "modelopt", **inner}, f"{sidecar}: quantization"
    return None, f"{cfg.path}: quantization_config"


NVFP4_WHY = "NVFP4 experts: sglang runs them on FlashInfer/CUTLASS FP4 kernels, it has no Triton fused-MoE path"


def _quantization(profile: Profile, cfg: _Config, text: _Config) -> Quant:
    qcfg, where = _quant_config(cfg, text)
    declared = None
    if qcfg is not None:
        declared = qcfg.get("quant_method") or ("modelopt" if "quant_algo" in qcfg else None)
    method = profile.model.quantization or declared
    named_at = f"{profile.source or 'the profile'}: model.quantization" if profile.model.quantization else where
    if method is None:
        return _unquantized(text, cfg)
    if method == "fp8":  # Fp8MoEMethod (quantization/fp8.py)
        block = (qcfg or {}).get("weight_block_size") if declared == "fp8" else None
        if block is None:
            return Quant("fp8 (per-tensor)", dtype="fp8_w8a8")
        return Quant(f"fp8 (block {block})", dtype="fp8_w8a8", block_shape=_pair(block, where, "weight_block_size"))
    if method in ("modelopt", "modelopt_fp4", "modelopt_fp8"):  # quantization/modelopt_quant.py
        algo = str((qcfg or {}).get("quant_algo", "")).upper()
        if method == "modelopt_fp4" or (method == "modelopt" and algo == "NVFP4"):
            return Quant("modelopt NVFP4", triton=None, runner="FlashInfer/CUTLASS FP4 kernels", why=NVFP4_WHY)
        if method == "modelopt_fp8" or algo == "FP8":
            return Quant("modelopt fp8 (per-tensor)", dtype="fp8_w8a8")
        raise UserError(f"{where}.quant_algo = {algo or None!r} is a ModelOpt scheme sm120kit does not know", None)
    if method == "compressed-tensors":
        return _compressed_tensors(qcfg, where)
    raise UserError(
        f"{named_at}: quantization {method!r} is not one sm120kit knows how sglang runs",
        "known: none (bf16/fp16), fp8, modelopt_fp8, modelopt_fp4, compressed-tensors",
    )


def _pair(value, where: str, key: str) -> tuple[int, int]:
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return value[0], value[1]
    raise UserError(f"{where}.{key} = {value!r} is not a [block_n, block_k] pair", None)


def _compressed_tensors(qcfg: dict | None, where: str) -> Quant:
    """The experts' scheme as CompressedTensorsConfig.get_moe_scheme classifies it
    (quantization/compressed_tensors/compressed_tensors.py)."""
    groups = (qcfg or {}).get("config_groups")
    schemes = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    if not schemes:
        raise UserError(f"{where}.config_groups is missing: no compressed-tensors scheme to read", None)
    scheme = schemes[0]
    if any(
        (s.get("weights"), s.get("input_activations")) != (scheme.get("weights"), scheme.get("input_activations"))
        for s in schemes
    ):
        raise UserError(
            f"{where}.config_groups holds several schemes: sm120kit cannot tell which one the experts use", None
        )
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        weights = {}
    acts = scheme.get("input_activations")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    group = weights.get("group_size")
    if acts is None and kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        name = f"compressed-tensors W{bits}A16 (int{bits}, " + (
            f"group {group})" if strategy == "group" else "channel)"
        )
        marlin = "sglang's CompressedTensorsWNA16MoE runs WNA16 experts on Marlin unless asked for Triton"
        # CompressedTensorsWNA16TritonMoE: int4 only, symmetric, group 32 or 128, no actorder
        # (_is_wna16_triton_moe_supported, 0.5.23); it views w2 as uint8, two int4 per byte.
        triton_ok = (
            bits == 4
            and strategy == "group"
            and group in (32, 128)
            and weights.get("symmetric", True)
            and not weights.get("actorder")
        )
        if not triton_ok:
            why = f"{marlin}; its Triton path takes symmetric int4 in groups of 32 or 128 only"
            return Quant(name, triton=None, runner="marlin", why=why, int4=bits == 4)
        return Quant(
            name,
            dtype="int4_w4a16",
            # the kernel's group size (32 or 128: triton_ok says so); sglang leaves [0, k] out of the file name
            block_shape=(0, cast(int, group)),
            pack=2,
            triton="on-request",
            runner="marlin",
            why=marlin,
            int4=True,
        )
    if isinstance(acts, dict) and kind == "float" and bits == 8 and acts.get("num_bits") == 8:
        if strategy == "tensor":  # CompressedTensorsW8A8Fp8MoE
            return Quant("compressed-tensors FP8 (per-tensor)", dtype="fp8_w8a8")
        if strategy == "channel":
            return Quant("compressed-tensors FP8 (per-channel)", dtype="fp8_w8a8", per_channel=True)
        if strategy == "block":
            block = _pair(weights.get("block_structure"), where, "config_groups.*.weights.block_structure")
            return Quant(f"compressed-tensors FP8 (block {list(block)})", dtype="fp8_w8a8", block_shape=block)
    if kind == "float" and bits == 4:
        return Quant("compressed-tensors NVFP4", triton=None, runner="FlashInfer/CUTLASS FP4 kernels", why=NVFP4_WHY)
    raise UserError(
        f"{where}.config_groups: weights {weights or None} with input_activations {acts} is a compressed-tensors "
        "scheme sm120kit does not know how sglang runs",
        "known: W4A16/W8A16 int (group or channel), FP8 W8A8 (tensor, channel or block), NVFP4",
    )
