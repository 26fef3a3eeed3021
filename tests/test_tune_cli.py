"""`sm120kit tune-moe` from end to end on a real release (sglang 0.5.23's MoE layers and
kernel unpacked from the wheel, with a Triton dist-info beside them): --plan compiles the
release's own kernel for sm_120 and says where the table goes and whether what sglang loads
now fits; the timing runs through the worker protocol (the stand-in fixture of
tests/fixtures/moe_worker_standin.py: CI has no GPU) and installs the winners, which
`status` lists and `unpatch` removes; bad input is exit 2 with nothing written.

The candidate space is cut to a slice here (sm120kit.tune.space is the tuner's full space,
proven in test_tune_fit.py): every compile is real, and a full space takes minutes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401 -- the test extra's: a missing Triton fails the run rather than skip it
from support.tree import tree_snapshot
from support.tune import KIMI_K2_CONFIG as KIMI
from support.tune import MOE_MEMBERS, SERVER
from support.tune import TUNED_RELEASE as VERSION

from sm120kit import wheels
from sm120kit.errors import UserError
from sm120kit.target import resolve_target
from sm120kit.tune import space, timing
from sm120kit.tune.command import tune_moe
from sm120kit.tune.lookup import CONFIG_DIR_ENV
from sm120kit.tune.options import TuneOptions

STANDIN = Path(__file__).parent / "fixtures" / "moe_worker_standin.py"
# 3 tiles that fit and one that needs 147456 B on sm_120 (the H100 fp8 default's tile)
SLICE = [
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 3},
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 8, "num_stages": 3},
    {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 8, "num_stages": 4},
]


@pytest.fixture(scope="module")
def fit_cache(tmp_path_factory):
    """One sm_120 fit cache and Triton cache for the module: each tile is compiled once."""
    root = tmp_path_factory.mktemp("fit")
    return {"SM120KIT_CACHE_DIR": str(root / "sm120kit"), "TRITON_CACHE_DIR": str(root / "triton")}


@pytest.fixture
def node(tmp_path, monkeypatch, fit_cache):
    """A site with sglang 0.5.23's MoE code and Triton 3.6.0, the Kimi config.json, the
    candidate slice, and no GPU of this machine in the way."""
    for key, value in fit_cache.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    monkeypatch.setattr(space, "search_space", lambda shape: [dict(c) for c in SLICE])
    monkeypatch.setattr("sm120kit.node.nvml.gpu_name_here", lambda: None)
    site = tmp_path / "site"
    wheels.install(site, "sglang", VERSION, MOE_MEMBERS)
    info = site / "triton-3.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.6.0\n")
    config = tmp_path / "kimi" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(KIMI))
    return site, config


def plan_args(site: Path, config: Path, *more: str) -> list[str]:
    return ["tune-moe", "kimi-k2-int4-triton", "--plan", "--site", site, "--model-config", config, *more]


def test_plan_prunes_the_space_on_the_real_kernel_and_names_the_destination(node, cli):
    site, config = node
    before = tree_snapshot(site)
    code, doc = cli.json(*plan_args(site, config, "--device-name", SERVER))
    assert code == 0, doc
    assert doc["shape"] | {"model": ""} == {
        "experts": 384,
        "hidden": 7168,
        "intermediate": 256,
        "shard": 128,
        "top_k": 8,
        "dtype": "int4_w4a16",
        "block_shape": [0, 32],
        "per_channel_quant": False,
        "model": "",
    }
    assert (doc["space"], doc["fit"]) == (4, 3)
    assert doc["rejected"][0]["config"] == SLICE[3] and doc["rejected"][0]["shared"] > 101376
    assert 0 < doc["largest_fit_bytes"] <= 101376
    destination = Path(doc["destination"])
    assert destination.relative_to(site.resolve()).as_posix() == (
        "sglang/srt/layers/moe/moe_runner/triton_utils/configs/triton_3_6_0/"
        "E=384,N=128,device_name=NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition,dtype=int4_w4a16.json"
    )
    assert doc["loads_now"] is None  # no release ships this shape for a named GPU
    assert tree_snapshot(site) == before  # a plan writes nothing


def test_plan_flags_a_table_for_this_gpu_that_does_not_fit(node, cli):
    """A table copied from another card (tiles sized for 228 KB SMs) is what sglang would
    load on this GPU: --plan says which of its configs do not fit, exit 1."""
    site, config = node
    _, doc = cli.json(*plan_args(site, config, "--device-name", SERVER))
    copied = Path(doc["destination"])
    copied.write_text(json.dumps({"1": SLICE[0], "256": SLICE[3]}, indent=4))
    code, doc = cli.json(*plan_args(site, config, "--device-name", SERVER))
    assert code == 1
    assert doc["loads_now"] == str(copied)
    assert [(x["batch_size"], x["config"]) for x in doc["loads_now_over"]] == [(256, SLICE[3])]
    code, out, _ = cli(*plan_args(site, config, "--device-name", SERVER))
    assert "1 of its configs do not fit sm_120" in out


def test_tune_installs_the_winners_status_lists_them_unpatch_removes_them(node, cli, tmp_path, monkeypatch):
    site, config = node
    before = tree_snapshot(site)
    # candidate 2 (of the 3 that fit) is the fastest; the stand-in runs as the target's python
    monkeypatch.setenv("SM120KIT_STANDIN", json.dumps({"us": {"0": 300, "1": 200, "2": 50}, "devices": [SERVER]}))
    monkeypatch.setattr(timing, "time_candidates", functools.partial(timing.time_candidates, worker=STANDIN))
    profile = _profile("kimi-k2-int4-triton")
    target = resolve_target(site=str(site))
    options = TuneOptions(
        batch_sizes=(1, 64), gpus=(0,), model_config=config, python=sys.executable, show_progress=False
    )
    report = tune_moe(options, profile, target)
    assert report.installed and report.exit_code == 0, report.notes
    table = json.loads(report.destination.read_text())
    assert table == {"1": SLICE[2], "64": SLICE[2]}
    code, doc = cli.json("status", "--site", site)
    [listed] = doc["tuned"]
    assert listed["path"].endswith(report.destination.name)
    assert SERVER in json.dumps(listed) and VERSION in json.dumps(listed)
    code, _, err = cli("unpatch", "--site", site)
    assert code == 0, err
    after = {path: data for path, data in tree_snapshot(site).items() if not path.startswith(".sm120kit/")}
    assert after == before  # sm120kit's own ledger stays, empty


def _profile(name: str, *sets: str):
    from sm120kit.profiles.loader import load_profile

    return load_profile(name, None, list(sets))


def _dense_profile(tmp_path: Path, model_config: dict) -> tuple[Path, Path]:
    model = tmp_path / "dense-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "mine.toml").write_text(f'extends = "sm120-base"\n[model]\npath = "{model.as_posix()}"\n')
    return profiles, model


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096}


@pytest.mark.parametrize(
    "case",
    ["dense model", "unknown quantization", "no config.json", "not a Triton MoE"],
)
def test_bad_input_is_exit_2_and_writes_nothing(node, cli, tmp_path, case):
    site, config = node
    before = tree_snapshot(site)
    if case == "dense model":
        profiles, _ = _dense_profile(tmp_path, LLAMA)
        argv = ["tune-moe", "mine", "--plan", "--site", site, "--profile-dir", profiles]
        expect = "config.json"
    elif case == "unknown quantization":
        weird = {**KIMI, "quantization_config": {"quant_method": "weird-q"}}
        config.write_text(json.dumps(weird))
        argv, expect = plan_args(site, config), "weird-q"
    elif case == "no config.json":
        argv, expect = plan_args(site, tmp_path / "nowhere" / "config.json"), "config.json"
    else:
        argv, expect = ["tune-moe", "kimi-k2-int4", "--plan", "--site", site, "--model-config", config], "Marlin"
    code, out, err = cli(*argv)
    assert code == 2, (out, err)
    assert expect in err and "next:" in err, err
    assert "Traceback" not in err
    assert tree_snapshot(site) == before


def test_no_gpu_to_time_on_is_a_user_error_and_writes_nothing(node, tmp_path, monkeypatch):
    """The target's interpreter (this one) has no torch: the real worker's probe says so
    before anything is timed or written."""
    site, config = node
    before = tree_snapshot(site)
    options = TuneOptions(batch_sizes=(1,), model_config=config, python=sys.executable, show_progress=False)
    with pytest.raises(UserError, match="no torch") as caught:
        tune_moe(options, _profile("kimi-k2-int4-triton"), resolve_target(site=str(site)))
    assert caught.value.hint
    assert tree_snapshot(site) == before and not (tmp_path / "user-cache").exists()


def test_not_a_triton_moe_points_at_the_profile_that_is(node, cli):
    site, config = node
    code, _, err = cli("tune-moe", "kimi-k2-int4", "--plan", "--site", site, "--model-config", config)
    assert code == 2 and "sm120kit tune-moe kimi-k2-int4-triton" in err


def test_help_loads_no_torch_triton_or_library_module():
    code = (
        "import sys; from sm120kit.cli import main\n"
        "try: main(['tune-moe', '--help'])\n"
        "except SystemExit: pass\n"
        "print('loaded:', *(m for m in ('torch', 'triton', 'sm120kit.tune.command', 'pydantic') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: sm120kit tune-moe" in done.stdout
    assert done.stdout.splitlines()[-1] == "loaded:"


def test_status_flags_a_table_sglang_loads_on_this_sm120_gpu_that_does_not_fit(node, cli, monkeypatch):
    """A table copied from a card with 228 KB SMs under this GPU's name: `status` on an SM120
    node compiles what sglang would load and warns about the entries over 101376 B."""
    from sm120kit.node import nvml
    from sm120kit.node.nvml_schema import Gpu

    site, config = node
    gpu = Gpu(index=0, name=SERVER, compute_capability="12.0", memory_total_mib=97887, memory_used_mib=0)
    monkeypatch.setattr(nvml, "read_gpus", lambda: [gpu])
    _, doc = cli.json(*plan_args(site, config, "--device-name", SERVER))
    copied = Path(doc["destination"])
    verdict, doc = cli.json("status", "--site", site)
    assert doc["tuned_unfit"] == []  # 0.5.23's own tables for this GPU (E=256,N=512) all fit
    copied.write_text(json.dumps({"1": SLICE[0], "512": SLICE[3]}, indent=4))
    code, doc = cli.json("status", "--site", site)
    assert code == verdict  # a warning: the patches' verdict is status's exit code
    [unfit] = doc["tuned_unfit"]
    assert unfit["path"] == str(copied)
    assert [(x["batch_size"], x["config"]) for x in unfit["over"]] == [(512, SLICE[3])]
    _, _, err = cli("status", "--site", site)
    assert "do not fit sm_120" in err and copied.name in err.replace("\n", "")
    monkeypatch.setattr(nvml, "read_gpus", lambda: [gpu.model_copy(update={"compute_capability": "9.0"})])
    assert cli.json("status", "--site", site)[1]["tuned_unfit"] == []  # not an SM120 GPU: not judged
