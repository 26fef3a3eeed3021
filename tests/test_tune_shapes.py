"""tune-moe's shapes: every shipped MoE profile read from a config.json written from its
model's published numbers, held against the real releases (their shared-expert fusion
gate, their config file names and the tuned files they ship); the Hugging Face cache
lookup; and every bad input answered with a UserError that names the file and the key."""

from __future__ import annotations

import ast
import builtins
import dis
import json
import logging
import os
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version
from support.sites import WINDOW, wheel_bytes

from sm120kit import wheels
from sm120kit.errors import UserError
from sm120kit.model_config import find_model_config
from sm120kit.profiles.loader import list_profiles, load_profile
from sm120kit.tune.model_config import (
    W4A16_UNFUSED_SINCE,
    WNA16_TRITON_SINCE,
    NotTritonMoe,
    moe_shape,
)

# -- the published architectures -----------------------------------------------------------
# The MoE keys and values of each model's config.json on the Hugging Face Hub (other keys left out).

GLM5 = {  # zai-org/GLM-5 (lukealonso/GLM-5-NVFP4 keeps them): 256 routed + 1 shared, top-8
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
}
MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
QWEN3_30B = {  # Qwen/Qwen3-30B-A3B: 128 experts, top-8, no shared expert
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "torch_dtype": "bfloat16",
}
KIMI_INT4 = {  # moonshotai/Kimi-K2.5 (and K2-Thinking): INT4 QAT, compressed-tensors pack-quantized
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "group_size": 32,
                "strategy": "group",
                "dynamic": False,
                "actorder": None,
            },
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}
KIMI_TEXT = {  # DeepSeek-V3 architecture with 384 routed experts (moonshotai/Kimi-K2-Instruct)
    "hidden_size": 7168,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
}
KIMI_K25 = {  # moonshotai/Kimi-K2.5: a vision wrapper, the language model under text_config
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {**KIMI_TEXT, "model_type": "kimi_k2", "quantization_config": KIMI_INT4},
}
KIMI_K2_THINKING = {  # moonshotai/Kimi-K2-Thinking: the same, text only
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    **KIMI_TEXT,
    "quantization_config": KIMI_INT4,
}
GLM46_FP8 = {  # zai-org/GLM-4.6-FP8: 160 routed + 1 shared, top-8; FP8 per channel, dynamic per token
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "first_k_dense_replace": 3,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
    },
}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CONFIGS = {  # the model of every shipped profile
    "lukealonso/GLM-5-NVFP4": {**GLM5, "quantization_config": MODELOPT_NVFP4},
    "lukealonso/GLM-5.1-NVFP4": {**GLM5, "quantization_config": MODELOPT_NVFP4},
    "nvidia/Qwen3-30B-A3B-NVFP4": {**QWEN3_30B, "quantization_config": MODELOPT_NVFP4},
    "moonshotai/Kimi-K2.5": KIMI_K25,
    "zai-org/GLM-4.6-FP8": GLM46_FP8,
}
SHIPPED = [name for name, _, _ in list_profiles([]) if load_profile(name, []).model.path]


def write_config(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root / "config.json"


def profile(name: str, *sets: str, quantization: str | bool | None = False):
    p = load_profile(name, [], list(sets))
    if quantization is not False:
        p = p.model_copy(update={"model": p.model.model_copy(update={"quantization": quantization})})
    return p


def test_every_shipped_profile_with_a_model_is_covered():
    assert {load_profile(name, []).model.path for name in SHIPPED} <= set(CONFIGS)


# -- the shipped profiles -----------------------------------------------------------------

# (profile, the runner it runs its MoE on instead of Triton, the release that can switch it)
NOT_TRITON = [
    ("glm5-nvfp4", "flashinfer_cutlass", None),  # NVFP4: no release runs it on Triton
    ("glm51-nvfp4", "flashinfer_cutlass", None),
    ("qwen3-30b-a3b-nvfp4-1gpu", "flashinfer_cutlass", None),
    ("kimi-k2-int4", "marlin", WNA16_TRITON_SINCE),
]


@pytest.mark.parametrize("name, runner, since", NOT_TRITON)
def test_a_profile_whose_moe_is_not_triton_says_on_what_it_runs(tmp_path, name, runner, since):
    p = profile(name)
    with pytest.raises(NotTritonMoe) as err:
        moe_shape(p, write_config(tmp_path, CONFIGS[p.model.path]))
    assert (err.value.runner, err.value.triton_since, err.value.profile) == (runner, since, name)
    assert "Triton fused-MoE configs" in str(err.value) and name in str(err.value)
    # the NVFP4 experts stay off Triton even with the runner cleared: sglang has no Triton kernel for them
    if p.model.quantization == "modelopt_fp4":
        with pytest.raises(NotTritonMoe) as err:
            moe_shape(profile(name, "engine.moe_runner_backend=triton"), tmp_path / "config.json")
        assert err.value.triton_since is None and "NVFP4" in err.value.reason


def test_kimi_k2_on_triton_is_int4_with_w2_packed_two_per_byte(tmp_path):
    t = KIMI_TEXT
    for config in (KIMI_K25, KIMI_K2_THINKING):
        shape = moe_shape(profile("kimi-k2-int4-triton"), write_config(tmp_path / config["model_type"], config))
        per_gpu = t["moe_intermediate_size"] // 8
        assert (shape.experts, shape.top_k) == (t["n_routed_experts"], t["num_experts_per_tok"])  # 384: not fused
        assert (shape.hidden, shape.intermediate, shape.shard) == (t["hidden_size"], per_gpu, per_gpu // 2)
        assert (shape.dtype, shape.block_shape, shape.per_channel_quant) == ("int4_w4a16", (0, 32), False)
    # before 0.5.11 sglang ignores --moe-runner-backend triton for these experts and runs Marlin
    with pytest.raises(NotTritonMoe) as err:
        moe_shape(profile("kimi-k2-int4-triton"), tmp_path / "kimi_k2" / "config.json", sglang_version="0.5.10.post1")
    assert err.value.runner == "marlin" and WNA16_TRITON_SINCE in err.value.reason


def test_w4a16_that_sglangs_triton_kernel_does_not_take_stays_on_marlin(tmp_path):
    weights = KIMI_INT4["config_groups"]["group_0"]["weights"]
    for odd in ({"group_size": 64}, {"symmetric": False}, {"actorder": "group"}, {"num_bits": 8}):
        quant = {**KIMI_INT4, "config_groups": {"group_0": {"weights": {**weights, **odd}, "input_activations": None}}}
        path = write_config(tmp_path, {**KIMI_K2_THINKING, "quantization_config": quant})
        with pytest.raises(NotTritonMoe) as err:
            moe_shape(profile("kimi-k2-int4-triton"), path)
        assert (err.value.runner, err.value.triton_since) == ("marlin", None), odd


def test_a_modelopt_sidecar_file_declares_the_quantization(tmp_path):
    """ModelOpt checkpoints may keep it in hf_quant_config.json next to config.json, as sglang reads it."""
    path = write_config(tmp_path, QWEN3_30B)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    shape = moe_shape(profile("qwen3-30b-a3b-nvfp4-1gpu", "engine.moe_runner_backend=triton", quantization=None), path)
    assert (shape.dtype, shape.block_shape, shape.per_channel_quant) == ("fp8_w8a8", None, False)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(NotTritonMoe, match="NVFP4"):
        moe_shape(profile("qwen3-30b-a3b-nvfp4-1gpu", "engine.moe_runner_backend=triton", quantization=None), path)


def test_glm46_fp8_fuses_its_shared_expert_per_channel(tmp_path):
    c = GLM46_FP8
    shape = moe_shape(profile("glm46-fp8"), write_config(tmp_path, c))
    assert (shape.experts, shape.top_k) == (c["n_routed_experts"] + 1, c["num_experts_per_tok"] + 1)
    assert (shape.intermediate, shape.shard) == (c["moe_intermediate_size"] // 8,) * 2
    assert (shape.dtype, shape.block_shape, shape.per_channel_quant) == ("fp8_w8a8", None, True)
    # expert parallelism shards the routed experts and turns fusion off (CUDA); so does the profile
    ep = moe_shape(profile("glm46-fp8", "parallel.ep=8"), tmp_path / "config.json")
    assert (ep.experts, ep.top_k, ep.intermediate) == (c["n_routed_experts"] // 8, 8, c["moe_intermediate_size"])
    off = moe_shape(profile("glm46-fp8", "engine.disable_shared_experts_fusion=true"), tmp_path / "config.json")
    assert (off.experts, off.top_k) == (c["n_routed_experts"], c["num_experts_per_tok"])


def test_the_nvfp4_profiles_models_on_triton_have_the_shapes_sglang_names(tmp_path):
    # GLM-5 as an FP8 block-quantized checkpoint: DeepSeek-V3's fused layout, 256 + 1 experts
    fp8 = moe_shape(
        profile("glm5-nvfp4", "engine.moe_runner_backend=triton", quantization=None),
        write_config(tmp_path / "glm5", {**GLM5, "quantization_config": FP8_BLOCK}),
    )
    per_gpu = GLM5["moe_intermediate_size"] // 8
    assert (fp8.experts, fp8.top_k, fp8.hidden) == (
        GLM5["n_routed_experts"] + 1,
        GLM5["num_experts_per_tok"] + 1,
        GLM5["hidden_size"],
    )
    assert (fp8.intermediate, fp8.shard, fp8.dtype, fp8.block_shape) == (per_gpu, per_gpu, "fp8_w8a8", (128, 128))
    # GLM-5.1's card says --disable-shared-experts-fusion: the routed experts alone
    off = moe_shape(
        profile("glm51-nvfp4", "engine.moe_runner_backend=triton", quantization=None), tmp_path / "glm5/config.json"
    )
    assert (off.experts, off.top_k) == (GLM5["n_routed_experts"], GLM5["num_experts_per_tok"])
    # Qwen3-30B-A3B in bf16 on one GPU: no shared expert, no quantization
    bf16 = moe_shape(
        profile("qwen3-30b-a3b-nvfp4-1gpu", "engine.moe_runner_backend=triton", quantization=None),
        write_config(tmp_path / "qwen", QWEN3_30B),
    )
    q = QWEN3_30B
    assert (bf16.experts, bf16.top_k) == (q["num_experts"], q["num_experts_per_tok"])
    assert (bf16.hidden, bf16.shard) == (q["hidden_size"], q["moe_intermediate_size"])
    assert (bf16.dtype, bf16.block_shape, bf16.per_channel_quant) == (None, None, False)


# -- against the releases' own code ------------------------------------------------------------

CONFIG_FILE = {  # moe_runner/triton_utils/ since 0.5.11 (fused_moe_triton/ before)
    "0.5.12.post1": "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py",
    "0.5.23": "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py",
}


def release_function(version: str, relpath: str, name: str, cls: str | None = None, imports=None, **stubs):
    """`name` (a method of `cls`) from a release's file, decorators dropped, run with `stubs`
    as its globals and `imports` ({module: namespace}) as the only modules it may import; a
    global the stubs lack fails the test by name (a new gate to learn)."""

    def importer(module, globals=None, locals=None, fromlist=(), level=0):
        if module not in (imports or {}):
            raise AssertionError(f"sglang {version} {name} imports {module}: stub it")
        return imports[module]

    tree = ast.parse(wheel_bytes(version, relpath))
    scope = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls).body if cls else tree.body
    fn = next(f for f in scope if isinstance(f, ast.FunctionDef) and f.name == name)
    fn.decorator_list = []
    namespace = {**stubs, "__builtins__": {**vars(builtins), "__import__": importer}}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), relpath, "exec"), namespace)
    code = namespace[name].__code__
    nested = [k for k in code.co_consts if hasattr(k, "co_code")]
    loaded = {i.argval for c in (code, *nested) for i in dis.get_instructions(c) if i.opname == "LOAD_GLOBAL"}
    missing = loaded - set(stubs) - set(dir(builtins))
    assert not missing, f"sglang {version} {name} reads {sorted(missing)}: stub them"
    return namespace[name]


def config_file_name(version: str, shape, device: str) -> str:
    """The file name sglang {version} looks the shape up under on `device` (get_moe_configs'
    call of get_config_file_name, run from the release)."""
    name = release_function(version, CONFIG_FILE[version], "get_config_file_name", get_device_name=lambda: device)
    block = list(shape.block_shape) if shape.block_shape else [0, 0]
    return name(shape.experts, shape.shard, shape.dtype, block, shape.per_channel_quant)


def shipped_configs(version: str) -> set[str]:
    with zipfile.ZipFile(wheels.fetch("sglang", version)) as zf:
        return {n.rsplit("/", 1)[-1] for n in zf.namelist() if "/configs/triton_" in n}


@pytest.mark.parametrize("version", ["0.5.12.post1", "0.5.23"])
def test_the_shapes_name_the_files_sglang_tuned_for_these_models(tmp_path, version):
    """sglang's own tuned files for these models carry exactly the E and N computed here."""
    kimi = moe_shape(profile("kimi-k2-int4-triton"), write_config(tmp_path / "kimi", KIMI_K25))
    glm46 = moe_shape(profile("glm46-fp8"), write_config(tmp_path / "glm46", GLM46_FP8))
    glm5_fp8 = moe_shape(
        profile("glm5-nvfp4", "engine.moe_runner_backend=triton", quantization=None),
        write_config(tmp_path / "glm5", {**GLM5, "quantization_config": FP8_BLOCK}),
    )
    qwen = moe_shape(
        profile("qwen3-30b-a3b-nvfp4-1gpu", "engine.moe_runner_backend=triton", quantization=None),
        write_config(tmp_path / "qwen", QWEN3_30B),
    )
    shipped = shipped_configs(version)
    assert config_file_name(version, kimi, "") in shipped  # someone's Kimi K2 INT4 TP8 tune, device name empty
    assert config_file_name(version, glm46, "NVIDIA H200") in shipped  # PR #13815
    assert config_file_name(version, glm46, "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition") in shipped
    assert config_file_name(version, glm5_fp8, "NVIDIA H200") in shipped  # DeepSeek-V3's E=257,N=256 fp8 block
    assert config_file_name(version, qwen, "NVIDIA H200") in shipped
    assert "block_shape" not in config_file_name(version, kimi, "")  # [0, 32]: no block in the name


def release_fused_shared(version: str, arch: str, config: dict, quant: str | None, int4: bool, ep: int) -> int:
    """How many shared experts sglang {version} fuses, by running its own gate
    (DeepseekV2ForCausalLM / Glm4MoeForCausalLM) with a CUDA SM120 GPU stubbed in."""
    glm4 = arch == "Glm4MoeForCausalLM"
    relpath = f"sglang/srt/models/{'glm4_moe' if glm4 else 'deepseek_v2'}.py"
    owner = "Glm4MoeForCausalLM" if glm4 else "DeepseekV2ForCausalLM"
    server_args = SimpleNamespace(disable_shared_experts_fusion=False, enforce_shared_experts_fusion=False)
    never = lambda *a, **k: False  # noqa: E731
    stubs = {
        "get_global_server_args": lambda: server_args,
        "get_server_args": lambda: server_args,
        "get_flags": lambda: server_args,
        "is_sbo_enabled": never,
        "is_tbo_enabled": never,
        "is_deepep_class_backend": never,
        "_is_cuda": True,
        "_is_hip": False,
        "_is_musa": False,
        "torch": SimpleNamespace(cuda=SimpleNamespace(get_device_capability=lambda *a: (12, 0))),
        "get_moe_expert_parallel_world_size": lambda: ep,
        "get_parallel": lambda: SimpleNamespace(moe_ep_size=ep),
        "get_moe_a2a_backend": lambda: SimpleNamespace(is_deepep=never, is_mori=never),
        "get_moe_runner_backend": lambda: SimpleNamespace(is_marlin=never),
        "get_exec": lambda: SimpleNamespace(moe=server_args),
        "is_sm90_supported": never,
        "quant_blocks_shared_experts_fusion": never,
        "is_wint4afp8_or_wint4a16_config": lambda qc: qc is not None and qc.int4,
        "log_info_on_rank0": lambda *a: None,
        "logger": logging.getLogger("sglang-gate"),
    }
    # 0.5.16+ record the override they make (arg_groups.overrides): nothing to record here
    imports = {"sglang.srt.arg_groups.overrides": SimpleNamespace(declare_load_time_override=lambda *a, **k: None)}
    hf_config = SimpleNamespace(**config)
    quant_config = SimpleNamespace(get_name=lambda: quant, int4=int4) if quant else None
    [cls] = [
        c for c in ast.parse(wheel_bytes(version, relpath)).body if isinstance(c, ast.ClassDef) and c.name == owner
    ]
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    if "shared_experts_fusion_disable_reason" in names:  # 0.5.18+: a classmethod asked before the build
        gate = release_function(version, relpath, "shared_experts_fusion_disable_reason", owner, imports, **stubs)
        reason = gate(SimpleNamespace(fused_shared_experts_architecture=arch), hf_config, quant_config)
        return 0 if reason else config["n_shared_experts"]
    gate = release_function(version, relpath, "determine_num_fused_shared_experts", owner, imports, **stubs)
    model = SimpleNamespace(config=hf_config, quant_config=quant_config, num_fused_shared_experts=0)
    gate(model) if glm4 else gate(model, arch)  # GlmMoeDsaForCausalLM passes its own name (glm4_moe.py)
    return model.num_fused_shared_experts


INT4_256 = {"quant_method": "compressed-tensors", "config_groups": KIMI_INT4["config_groups"]}
GATE_CASES = [  # (arch config, quantization_config, sglang's quant name, int4, ep)
    ({**GLM5}, FP8_BLOCK, "fp8", False, 1),
    ({**GLM5}, FP8_BLOCK, "fp8", False, 8),
    ({**GLM5, "architectures": ["DeepseekV3ForCausalLM"]}, INT4_256, "compressed-tensors", True, 1),
    (KIMI_K2_THINKING, KIMI_INT4, "compressed-tensors", True, 1),
    (GLM46_FP8, GLM46_FP8["quantization_config"], "compressed-tensors", False, 1),
    (GLM46_FP8, GLM46_FP8["quantization_config"], "compressed-tensors", False, 4),
]


# 0.5.11: the first release that runs W4A16 experts on Triton; 0.5.15.post1 / 0.5.16: either
# side of the W4A16 rule; 0.5.23: the gate as a classmethod.
@pytest.mark.parametrize("version", ["0.5.11", "0.5.15.post1", "0.5.16", "0.5.23"])
def test_shared_expert_fusion_agrees_with_the_releases_own_gate(tmp_path, version):
    for config, qcfg, quant, int4, ep in GATE_CASES:
        arch = config["architectures"][0]
        path = write_config(tmp_path / arch, {**config, "quantization_config": qcfg})
        # any TP=8 profile: only its tp, ep and runner matter; the quantization is the config's
        p = profile("glm46-fp8", f"parallel.ep={ep}", "engine.moe_runner_backend=triton", quantization=None)
        shape = moe_shape(p, path, sglang_version=version)
        fused = shape.experts - config["n_routed_experts"] // ep
        assert fused == release_fused_shared(version, arch, config, quant, int4, ep), (version, arch, ep)
        assert shape.top_k == config["num_experts_per_tok"] + fused


def test_the_release_rules_start_where_the_releases_change():
    """The two release floors in model_config are the first releases of the window whose own
    code behaves that way: --moe-runner-backend triton reaching W4A16 experts, and DeepSeek's
    gate refusing to fuse a W4A16 checkpoint's shared expert."""

    def triton_switch(version: str) -> bool:
        source = wheel_bytes(
            version, "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
        ).decode()
        method = source[source.index("def get_moe_scheme") :]
        method = method[: method.index("\n    def ", 1)]
        return "CompressedTensorsWNA16TritonMoE" in method and "moe_backend.is_triton()" in method

    switched = [triton_switch(v) for v in WINDOW]
    assert switched == [Version(v) >= Version(WNA16_TRITON_SINCE) for v in WINDOW]
    dsv3_int4 = {**GLM5, "architectures": ["DeepseekV3ForCausalLM"]}
    fused = [release_fused_shared(v, "DeepseekV3ForCausalLM", dsv3_int4, "compressed-tensors", True, 1) for v in WINDOW]
    assert fused == [int(Version(v) < Version(W4A16_UNFUSED_SINCE)) for v in WINDOW]


# -- finding config.json ----------------------------------------------------------------------


def hf_snapshot(hub: Path, repo: str, rev: str, config: dict, age_s: float = 0) -> Path:
    path = write_config(hub / f"models--{repo.replace('/', '--')}" / "snapshots" / rev, config)
    then = time.time() - age_s
    os.utime(path.parent, (then, then))
    return path


def test_the_hugging_face_cache_is_read_without_the_network(tmp_path):
    repo = "moonshotai/Kimi-K2.5"
    hub = tmp_path / "hf-home" / "hub"
    old = hf_snapshot(hub, repo, "a" * 40, KIMI_K25, age_s=3600)
    new = hf_snapshot(hub, repo, "b" * 40, KIMI_K25)
    env = {"HF_HOME": str(tmp_path / "hf-home")}
    assert find_model_config(repo, env=env) == new  # no refs/main: the newest snapshot
    refs = hub / "models--moonshotai--Kimi-K2.5" / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40 + "\n")
    assert find_model_config(repo, env=env) == old  # refs/main names the revision
    assert find_model_config(repo, env={"HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "elsewhere")}) == old
    assert find_model_config(str(old.parent)) == old  # a local directory
    shape = moe_shape(profile("kimi-k2-int4-triton"), env=env)  # the profile's repo id, from the cache
    t = KIMI_TEXT
    assert (shape.experts, shape.shard, shape.model) == (t["n_routed_experts"], t["moe_intermediate_size"] // 16, repo)


def test_a_missing_config_names_what_was_searched_and_the_download(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf")}
    with pytest.raises(UserError) as err:
        moe_shape(profile("kimi-k2-int4-triton"), env=env)
    text = str(err.value)
    assert str(tmp_path / "hf" / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots") in text
    assert "huggingface-cli download moonshotai/Kimi-K2.5 config.json" in text and "[model] path" in text
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(UserError, match=r"no config\.json in the model directory .*ckpt"):
        find_model_config(str(tmp_path / "ckpt"))
    with pytest.raises(UserError, match="does not exist"):
        moe_shape(profile("glm46-fp8"), tmp_path / "nowhere.json")


# -- bad input --------------------------------------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336}


@pytest.mark.parametrize(
    "config, says",
    [
        (LLAMA, "has no MoE"),
        ({**QWEN3_30B, "num_experts": 0}, "dense model"),  # a known MoE class without experts
        ({**LLAMA, "architectures": ["GptOssForCausalLM"], "num_local_experts": 32}, "does not know how to read"),
        ({**QWEN3_30B, "torch_dtype": "float8_e5m2"}, "torch_dtype = 'float8_e5m2'"),
        ({**QWEN3_30B, "quantization_config": {"quant_method": "gguf"}}, "quantization_config: quantization 'gguf'"),
        ({**GLM46_FP8, "quantization_config": {"quant_method": "compressed-tensors"}}, "config_groups is missing"),
        ({**QWEN3_30B, "moe_intermediate_size": "768"}, "moe_intermediate_size = '768' is not a positive integer"),
        ({**KIMI_K25, "text_config": {**KIMI_TEXT, "hidden_size": None}}, "text_config.hidden_size is missing"),
    ],
)
def test_bad_configs_are_user_errors_that_name_the_file_and_key(tmp_path, config, says):
    path = write_config(tmp_path, config)
    with pytest.raises(UserError) as err:
        moe_shape(profile("glm46-fp8", "engine.moe_runner_backend=triton", quantization=None), path)
    assert not isinstance(err.value, NotTritonMoe)
    assert says in str(err.value) and str(path) in str(err.value)


def test_bad_profiles_are_user_errors_that_name_the_key(tmp_path):
    path = write_config(tmp_path, GLM46_FP8)
    with pytest.raises(UserError, match=r"model\.quantization: quantization 'awq'") as err:
        moe_shape(profile("glm46-fp8", quantization="awq"), path)
    assert "glm46-fp8.toml" in str(err.value)
    with pytest.raises(UserError, match=r"parallel\.ep = 3 does not divide parallel\.tp = 8"):
        moe_shape(profile("glm46-fp8", "parallel.ep=3"), path)
    # 1536 / 8 = 192 is not whole 128-wide fp8 blocks: sglang's Fp8MoEMethod refuses it too
    with pytest.raises(UserError, match="not a multiple of the fp8 weight block 128"):
        moe_shape(
            profile("glm46-fp8", quantization="fp8"),
            write_config(tmp_path / "b", {**GLM46_FP8, "quantization_config": FP8_BLOCK}),
        )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        moe_shape(profile("glm46-fp8"), tmp_path / "broken" / "config.json")
