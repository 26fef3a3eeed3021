"""`status` on an SM120 node: the fused-MoE config tables sglang would load on this GPU whose
tiles do not fit sm_120's shared memory (a table copied from a card with larger SMs, named
for this one). Each is compiled with the installed release's own kernel, as tune-moe does.

A file name gives E, N, the dtype and the block shape, not the hidden size or the top-k:
those only reach the compile as runtime integers (their divisibility by 16), so a
representative value of the same divisibility stands in for them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.target import Target
from sm120kit.tune.shape import MoeShape

NAME = re.compile(
    r"E=(?P<e>\d+),N=(?P<n>\d+),device_name=[^,]*?(,dtype=(?P<dtype>\w+))?"
    r"(,block_shape=\[(?P<bn>\d+), ?(?P<bk>\d+)\])?(?P<pc>,per_channel_quant=True)?(?P<down>_down)?\.json"
)
HIDDEN = 7168  # a multiple of every block size: the same specialization as any real model's
TOP_K = 8
INT4_GROUP = 128  # not in the file name; the group size only scales the per-group scale loads


@dataclass(frozen=True)
class UnfitTable:
    path: Path
    over: list[dict]  # {"batch_size", "config", "shared"} of the entries over the limit

    def as_json(self) -> dict:
        return {"path": str(self.path), "over": self.over}


def shape_from_name(name: str) -> MoeShape | None:
    """The shape a config file is named for (None: not a fused-MoE table name)."""
    m = NAME.fullmatch(name)
    if not m:
        return None
    n, dtype = int(m["n"]), m["dtype"]
    packed = dtype == "int4_w4a16"  # w2 holds two int4 per byte: N is half the intermediate size
    block = (int(m["bn"]), int(m["bk"])) if m["bn"] else ((0, INT4_GROUP) if packed else None)
    return MoeShape(
        experts=int(m["e"]),
        hidden=HIDDEN,
        intermediate=2 * n if packed else n,
        shard=n,
        top_k=TOP_K,
        dtype=dtype,
        block_shape=block,
        per_channel_quant=bool(m["pc"]),
        model=name,
    )


def unfit_tables(
    target: Target, device_name: str, env: Mapping[str, str] | None = None, jobs: int | None = None
) -> list[UnfitTable]:
    """Every table the installed sglang loads on `device_name` (with the target's Triton and
    `env`'s $SGLANG_MOE_CONFIG_DIR) whose configs do not all fit sm_120."""
    from sm120kit.tune import fit, kernels, lookup

    sglang = target.find("sglang")
    triton = lookup.installed_triton_version(target)
    if sglang is None or triton is None:
        return []
    _, module = lookup.config_module(sglang)
    roots = [Path(env[lookup.CONFIG_DIR_ENV])] if env and env.get(lookup.CONFIG_DIR_ENV) else [module.parent]
    names = sorted({p.name for root in roots for p in (root / "configs").glob("triton_*/E=*.json")})
    loaded: dict[Path, tuple[MoeShape, dict]] = {}
    for name in names:
        shape = shape_from_name(name)
        if shape is None or not lookup.table_for_device(name, device_name):
            continue
        table = lookup.what_sglang_loads(sglang, shape, device_name, triton, env, down=name.endswith("_down.json"))
        if table is not None and table.path.name == name:
            loaded[table.path] = (shape, table.table)
    if not loaded:
        return []
    source = kernels.find_kernel_file(sglang.site).read_bytes()
    found = []
    for path, (shape, configs) in sorted(loaded.items()):
        gemms = ("w2",) if path.name.endswith("_down.json") else ("w13", "w2")  # a _down table tiles the down GEMM
        try:
            results = fit.fit_configs(source, shape, list(configs.values()), gemms=gemms, jobs=jobs)
        except UserError:  # a config sm120kit cannot model (a TMA launch): not judged
            continue
        over = [
            {"batch_size": m, "config": r.config, "shared": r.shared or r.at_least}
            for m, r in zip(configs, results)
            if not r.fits
        ]
        if over:
            found.append(UnfitTable(path, over))
    return found


def on_this_gpu(target: Target, gpus: Sequence, env: Mapping[str, str]) -> list[UnfitTable]:
    """unfit_tables for GPU 0 of `gpus` (this machine's, sm120kit.node.nvml.gpus_here) when it
    is an SM120 card (none otherwise, or when Triton, which compiles the kernel, is not
    importable here). The caller reads the GPUs: tune sits below the node package."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return []
    if not gpus or not gpus[0].compute_capability.startswith("12."):
        return []
    return unfit_tables(target, gpus[0].name, env)


def warning(table: UnfitTable) -> str:
    from sm120kit.tune.render import tile

    first = table.over[0]
    return (
        f"sglang loads {table.path} on this GPU, and {len(table.over)} of its configs do not fit sm_120's "
        f"101376 B of shared memory (batch size {first['batch_size']}: {tile(first['config'])} needs "
        f"{first['shared']} B): those batch sizes fail with OutOfResources; remove the file or re-tune it "
        "with `sm120kit tune-moe PROFILE`"
    )
