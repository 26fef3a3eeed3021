"""Shipped profiles rendered for the flag schema of every sglang release 0.5.9-0.5.23,
read from the real wheels: golden argv for glm5-nvfp4, every flag accepted by the release
it is rendered for, and the guard rails."""

from __future__ import annotations

import functools
import json
import zipfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from support.paths import ROOT
from support.sites import WINDOW, install

from sm120kit import wheels
from sm120kit.errors import UserError
from sm120kit.profiles.flags import schema_from_sources
from sm120kit.profiles.loader import list_profiles, load_profile
from sm120kit.profiles.render import EnvRef, render

# The servable ones: a node profile such as sm120-base names no model and is only extended.
SHIPPED = [name for name, _, _ in list_profiles([]) if load_profile(name, []).model.path]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"


@functools.cache
def schema(version: str):
    with zipfile.ZipFile(wheels.fetch("sglang", version)) as zf:
        names = set(zf.namelist())
        return schema_from_sources(version, lambda relpath: zf.read(relpath) if relpath in names else None)


def argv_pairs(argv) -> dict[str, str | None]:
    """--flag value pairs of an argv (after `python -m sglang.launch_server`)."""
    pairs: dict[str, str | None] = {}
    words = [a for a in argv[3:]]
    for i, word in enumerate(words):
        if isinstance(word, str) and word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            pairs[word] = None if (nxt is None or (isinstance(nxt, str) and nxt.startswith("--"))) else nxt
    return pairs


@pytest.mark.parametrize("version", WINDOW)
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_renders_for_every_release(name, version):
    profile = load_profile(name, [])
    if any(s.operator == ">=" and Version(version) < Version(s.version) for s in SpecifierSet(profile.sglang or "")):
        with pytest.raises(UserError, match="needs sglang"):  # below the profile's floor: refused, not rendered
            render(profile, schema(version))
        return
    launch = render(profile, schema(version))
    flags = schema(version)
    for flag, value in argv_pairs(launch.argv).items():
        spec = flags.get(flag)
        assert spec is not None and not spec.deprecated, (flag, version)
        if spec.choices is not None and isinstance(value, str):
            assert value in spec.choices, (flag, value, version)


@pytest.mark.parametrize("version", ["0.5.9", "0.5.13", "0.5.23"])
def test_glm5_golden_argv(version):
    launch = render(load_profile("glm5-nvfp4", []), schema(version), python="python3")
    golden = GOLDEN / f"glm5-nvfp4-sglang-{version}.json"
    assert launch.as_json() == json.loads(golden.read_text()), f"regenerate {golden.name} only for a deliberate change"


def test_spellings_follow_the_release():
    base = load_profile("glm5-nvfp4", [], ["engine.dsa_prefill_backend=flashmla_sparse", "engine.cuda_graph_max_bs=32"])
    old, mid, new = (argv_pairs(render(base, schema(v)).argv) for v in ("0.5.9", "0.5.13", "0.5.23"))
    assert "--nsa-prefill-backend" in old and "--dsa-prefill-backend" not in old
    assert "--dsa-prefill-backend" in mid and "--dsa-prefill-backend" in new
    assert "--disable-cuda-graph" in old
    assert "--disable-cuda-graph" not in new and new.get("--cuda-graph-backend-decode") == "disabled"
    assert old.get("--cuda-graph-max-bs") == "32" and new.get("--cuda-graph-max-bs-decode") == "32"
    assert "--cuda-graph-max-bs" not in new


def test_glm5_fp8_kv_on_flashinfer_is_rendered_bf16_unless_insisted():
    profile = load_profile("glm5-nvfp4", [], ["engine.kv_cache_dtype=fp8_e4m3"])
    launch = render(profile, schema("0.5.23"))
    assert argv_pairs(launch.argv)["--kv-cache-dtype"] == "bf16"
    assert any("garbled" in w for w in launch.warnings)
    insisted = load_profile("glm5-nvfp4", [], ["engine.kv_cache_dtype=fp8_e4m3", "engine.insist_kv_cache_dtype=true"])
    assert argv_pairs(render(insisted, schema("0.5.23")).argv)["--kv-cache-dtype"] == "fp8_e4m3"


def test_api_key_comes_from_the_environment_never_the_argv_text():
    profile = load_profile("glm5-nvfp4", [], ["server.host=0.0.0.0", "server.api_key_env=SGLANG_API_KEY"])
    launch = render(profile, schema("0.5.23"))
    assert EnvRef("SGLANG_API_KEY") in launch.argv
    assert '--api-key "$SGLANG_API_KEY"' in launch.shell()


@pytest.mark.parametrize(
    "sets, says",
    [
        (["engine.moe_runner_backend=flashinfer_cutlas"], "accepts"),
        (["extra_args.--no-such-flag=1"], "has no --no-such-flag"),
        (["sglang=>=0.6"], "needs sglang >=0.6"),
    ],
)
def test_what_the_release_does_not_accept_is_an_error(sets, says):
    with pytest.raises(UserError) as err:
        render(load_profile("glm5-nvfp4", [], sets), schema("0.5.23"))
    assert says in str(err.value)


def test_serve_dry_run_prints_the_command_and_starts_nothing(cli, site):
    install(site, "0.5.23", flashinfer=False)
    assert cli("patch", "--site", site)[0] == 0  # a dry run judges the patches as the start does
    code, out, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site)
    assert code == 0, err
    assert "NCCL_P2P_LEVEL=SYS" in out and "python3 -m sglang.launch_server" in out
    assert "--moe-runner-backend flashinfer_cutlass" in out and "--tp-size 8" in out
    code, out, err = cli("serve", "glm5-nvfp4", "--site", site)
    assert code == 2 and "--dry-run" in err


def test_multi_node_renders_sglangs_own_flags_and_node_rank_overrides(cli, site):
    install(site, "0.5.23", flashinfer=False)
    sets = [
        "--set",
        "parallel.nnodes=2",
        "--set",
        "parallel.tp=16",
        "--set",
        "parallel.dist_init_addr=node0:5000",
    ]  # 2 x 8 GPUs
    # the flags rendered, whatever the patches (a dry run on an unpatched site says so: exit 1)
    code, doc = cli.json(
        "serve", "glm5-nvfp4", "--dry-run", "--no-patch-check", "--site", site, *sets, "--node-rank", "1"
    )
    pairs = argv_pairs(doc["argv"])
    assert code == 0 and pairs["--nnodes"] == "2" and pairs["--node-rank"] == "1"
    assert pairs["--dist-init-addr"] == "node0:5000"
    code, _, err = cli("serve", "glm5-nvfp4", "--dry-run", "--site", site, *sets, "--node-rank", "2")
    assert code == 2 and "node_rank" in err


# -- extra_args may not undo what a field guards (issue 12, item 11) ----------------------

EVERY_FIELD = [
    "model.served_name=x",
    "model.quantization=modelopt_fp4",
    "model.trust_remote_code=true",
    "model.context_length=4096",
    "parallel.ep=8",
    "parallel.pp=1",
    "parallel.nnodes=2",
    "parallel.tp=16",
    "parallel.dist_init_addr=node0:5000",
    "engine.prefill_attention_backend=flashinfer",
    "engine.decode_attention_backend=flashinfer",
    "engine.dsa_prefill_backend=flashmla_sparse",
    "engine.dsa_decode_backend=flashmla_sparse",
    "engine.fp4_gemm_backend=auto",
    "engine.cuda_graphs=false",
    "engine.cuda_graph_max_bs=32",
    "engine.radix_cache=false",
    "engine.mem_fraction_static=0.8",
    "engine.chunked_prefill_size=4096",
    "engine.disable_shared_experts_fusion=true",
    "engine.flashinfer_autotune=false",
    "server.host=0.0.0.0",
    "server.api_key_env=SGLANG_API_KEY",
]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.13", "0.5.14", "0.5.23"])
def test_every_flag_a_field_renders_is_refused_in_extra_args(version):
    """The set of owned flags is complete: whatever a field renders, extra_args may not."""
    from sm120kit.profiles.model import FLAG_OWNERS

    profile = load_profile("glm5-nvfp4", [], EVERY_FIELD)
    profile = profile.model_copy(update={"extra_args": {}})  # what the fields render, nothing else
    rendered = {a for a in render(profile, schema(version)).argv[3:] if isinstance(a, str) and a.startswith("--")}
    assert rendered - set(FLAG_OWNERS) == set(), version


def test_an_alias_of_an_owned_flag_in_the_installed_release_is_refused():
    """A release may spell an owned flag another way: found through its own flag schema."""
    import dataclasses

    from sm120kit.profiles.flags import FlagSchema

    real = schema("0.5.23")
    flags = tuple(
        dataclasses.replace(f, aliases=(*f.aliases, "--bind-host")) if f.name == "--host" else f for f in real.flags
    )
    profile = load_profile("glm5-nvfp4", [], ["extra_args.--bind-host=0.0.0.0"])
    with pytest.raises(UserError) as err:
        render(profile, FlagSchema(real.version, flags))
    assert (
        "extra_args.'--bind-host': sglang 0.5.23 reads it as --host: "
        "--host is rendered from server.host: set server.host instead" in str(err.value)
    )
