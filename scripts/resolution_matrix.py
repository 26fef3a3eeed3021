#!/usr/bin/env python3
"""The SM12x resolution matrix: what each sglang release's OWN argument resolution picks on
12.0 and 12.1, for each model family and quantization, each attention backend the release
accepts (and none), and each KV cache dtype; and the verdict of the kernel table on it.

Recording needs each release importable beside torch (no GPU): build the environments with
scripts/resolution_envs.py, then

    python scripts/resolution_matrix.py record --python TORCH_PY --overlays DIR [RELEASE ...]
    python scripts/resolution_matrix.py render          # docs/resolution.md from the recording

`record` runs sm120kit's resolution probe (sm120kit/resolution/probe.py) once per release and
capability, every cell of that release in the one child; then judges each shipped profile
and each refusal trial (TRIALS) on that release as `profile check` does, way-out search
included, keeping every resolution that judgement made. It merges what it found into
docs/resolution-matrix.json.xz (other releases' entries are kept). `render` needs neither
torch nor sglang: it judges every recorded cell against the shipped kernel table
(patches/kernels.toml) and writes the page. The tests judge the same recording, and replay
its launches in place of the probe (tests/test_resolution_matrix.py).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
import time
import typing
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm120kit.resolution import judge, run, slots  # noqa: E402

RECORDING = ROOT / "docs" / "resolution-matrix.json.xz"
PAGE = ROOT / "docs" / "resolution.md"
MODELS = ROOT / "scripts" / "resolution_models"
CAPABILITIES = ("12.0", "12.1")
KV_DTYPES = ("auto", "bf16", "fp8_e4m3")
# The attention backends of a CUDA node; a release's choices outside this set are other
# vendors' (aiter, ascend, intel_*) or model-specific ones.
CUDA_ATTENTION = (
    "triton",
    "torch_native",
    "flashinfer",
    "fa3",
    "fa4",
    "flashmla",
    "cutlass_mla",
    "trtllm_mla",
    "trtllm_mha",
    "cutedsl_mla",
    "nsa",
    "dsa",
)
# What the recording keeps of a resolved record: every field a slot reads, and the switches.
# The shipped profiles, each on the model family whose config.json stands for its checkpoint.
PROFILE_MODELS = {
    "glm5-nvfp4": "glm5-nvfp4",
    "glm51-nvfp4": "glm5-nvfp4",
    "glm46-fp8": "glm46-fp8",
    "kimi-k2-int4": "kimi-k2-int4",
    "kimi-k2-int4-triton": "kimi-k2-int4",
    "qwen3-30b-a3b-nvfp4-1gpu": "qwen3-30b-a3b-nvfp4",
    "qwen3-30b-a3b-nvfp4-x8": "qwen3-30b-a3b-nvfp4",
}
# The refusal classes: (name, profile, model family, --set assignments, releases). Each is
# judged as `profile check` judges it and its way out resolved; the tests replay them.
TRIALS = [
    (
        "dsa-fp8-before-sm12-branch",
        "glm5-nvfp4",
        "glm5-nvfp4",
        ["engine.attention_backend=nsa", "engine.kv_cache_dtype=fp8_e4m3"],
        ("0.5.12.post1", "0.5.16"),
    ),
    (
        "dsa-native-fp8",
        "glm5-nvfp4",
        "glm5-nvfp4",
        ["engine.attention_backend=dsa", "engine.kv_cache_dtype=fp8_e4m3"],
        ("0.5.17", "0.5.23"),
    ),
    (
        "dsa-bf16-trtllm-decode",
        "glm5-nvfp4",
        "glm5-nvfp4",
        ["engine.attention_backend=dsa", "engine.kv_cache_dtype=bf16"],
        ("0.5.23",),
    ),
    (
        "glm5next-default",
        "glm5-nvfp4",
        "glm5next",
        ["engine.attention_backend=dsa", "engine.kv_cache_dtype=auto"],
        ("0.5.23",),
    ),
    # A profile that does not say --quantization modelopt_fp4 (0.5.13+ then keep auto away from
    # trtllm on SM12x themselves): the checkpoint's NVFP4 and `auto` reach the TRT-LLM MoE.
    ("nvfp4-auto-runner", "glm46-fp8", "glm46-nvfp4", ["engine.moe_runner_backend=auto"], ("0.5.16", "0.5.23")),
    ("fa3-prefill", "glm46-fp8", "glm46-fp8", ["engine.prefill_attention_backend=fa3"], ("0.5.23",)),
    ("trtllm-mla-prefill", "kimi-k2-int4", "kimi-k2-int4", ["engine.attention_backend=trtllm_mla"], ("0.5.23",)),
]


def release_site(overlays: Path, release: str) -> list[str]:
    return [str(overlays / release), str(overlays / "common")]


def choices(overlay: Path, flag: str) -> tuple[str, ...]:
    """The release's argparse choices for `flag`, read from its source (nothing imported)."""
    from sm120kit.profiles.flags import read_schema
    from sm120kit.target import Target

    dist = Target(f"overlay {overlay}", [overlay]).find("sglang")
    found = read_schema(dist).get(flag) if dist else None
    return found.choices or () if found else ()


def cells_for(overlay: Path) -> list[dict]:
    accepted = choices(overlay, "--attention-backend")
    kvs = [kv for kv in KV_DTYPES if kv in (choices(overlay, "--kv-cache-dtype") or KV_DTYPES)]
    attentions = [None, *[a for a in CUDA_ATTENTION if a in accepted]]
    cells = []
    for model in sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file()):
        for attention in attentions:
            for kv in kvs:
                cells.append({"model": model, "attention": attention, "kv": kv})
    return cells


def argv_of(cell: dict) -> list[str]:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", str(MODELS / cell["model"]), "--tp", "8"]
    argv += ["--trust-remote-code", "--kv-cache-dtype", cell["kv"]]
    if cell["attention"]:
        argv += ["--attention-backend", cell["attention"]]
    return argv


def record(args) -> int:
    import tempfile

    os.environ["SM120KIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="resolution-matrix-")  # fresh answers only
    doc = read_recording()
    for release in args.releases:
        overlay = args.overlays / release
        if not (overlay / "sglang").is_dir():
            print(f"{release}: no environment at {overlay} (scripts/resolution_envs.py builds it)", file=sys.stderr)
            return 2
        cells = cells_for(overlay)
        env = {"PYTHONPATH": os.pathsep.join(release_site(args.overlays, release))}
        doc["cells"] = [c for c in doc["cells"] if c["release"] != release]
        started = time.monotonic()
        for capability in CAPABILITIES:
            node = run.Node(capability)
            answers = run.resolve(
                args.python, [argv_of(c) for c in cells], env, node, release, timeout=args.timeout, use_cache=False
            )
            for cell, answer in zip(cells, answers):
                kept = dump(answer)["resolved"]
                doc["cells"].append(
                    {
                        **cell,
                        "release": release,
                        "capability": capability,
                        "ok": answer.ok,
                        **({"record": kept} if answer.ok else {"stage": answer.stage, "error": answer.error[:400]}),
                    }
                )
            seconds = next((a.seconds for a in answers if a.ok), {})
            print(f"{release} on {capability}: {len(cells)} cells, {sum(a.ok for a in answers)} resolved, {seconds}")
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the judged launches run in this environment
        judge_profiles(args, release, doc)
        doc["releases"][release] = {
            "pins": pins(release),
            "cells": len(cells),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        write_recording(doc)
    return 0


def pins(release: str) -> dict[str, str]:
    """The releases sglang==release pins of the packages the kernel table names."""
    import re
    import zipfile

    from sm120kit.catalogue.kernels import Package
    from sm120kit.wheels import fetch

    with zipfile.ZipFile(fetch("sglang", release)) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    found = {"sglang": release}
    for package in typing.get_args(Package):
        spelled = package.replace("-", "[-_]")
        if hit := re.search(rf"^Requires-Dist: {spelled}(?:\[[^\]]*\])?==([^\s;,]+)", metadata, re.M | re.I):
            found[package] = hit.group(1)
    return found


def normalized(flags: list[str]) -> list[str]:
    """The flags as the recording keys them: the model directory relative to this checkout,
    and where the server listens left out (a fleet's replica listens on its own port, and
    no selection reads it)."""
    out = [f.replace(str(MODELS), "{models}") for f in flags]
    return [w if i == 0 or out[i - 1] not in ("--port", "--host") else "{listen}" for i, w in enumerate(out)]


def judge_profiles(args, release: str, doc: dict) -> None:
    """Each shipped profile whose range names `release`, and each trial on it, judged as
    `profile check` judges them on both capabilities; every resolution made is recorded."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from sm120kit.errors import UserError
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render
    from sm120kit.resolution import verdict
    from sm120kit.resolution.selection import fingerprint as server_args_fingerprint
    from sm120kit.target import Target, resolve_target

    sites = [args.overlays / release, args.overlays / "common", *resolve_target(args.python).site_dirs]
    target = Target(f"sglang {release} beside torch", sites)
    schema = read_schema(target.find("sglang"))
    fingerprint = server_args_fingerprint(target.find("sglang"))  # as the judging keys its cache
    real = run.resolve
    made: list[dict] = []

    def recording(python, argvs, env, node, sglang, *rest, **options):
        answers = real(python, argvs, env, node, sglang, *rest, **options)
        for argv, answer in zip(argvs, answers):
            made.append(
                {"capability": node.capability, "flags": normalized(run.flags_of(argv)), "answer": dump(answer)}
            )
        return answers

    jobs = []
    for name, model in PROFILE_MODELS.items():
        jobs.append((name, "profile", [f"model.path={MODELS / model}"]))
    for trial, name, model, sets, releases in TRIALS:
        if release in releases:
            jobs.append((name, trial, [f"model.path={MODELS / model}", *sets]))
    launches = []
    for name, what, base in jobs:
        profile = load_profile(name, None, base)
        if not profile.sglang or Version(release) in SpecifierSet(profile.sglang):
            launches.append((name, what, base, profile, render(profile, schema, args.python)))
    by_env = defaultdict(list)  # every first resolution, one child per environment (the judging reads the cache)
    for *_, launch in launches:
        by_env[tuple(sorted(launch.env.items()))].append(launch.argv)
    for capability in CAPABILITIES:
        for env, argvs in by_env.items():
            real(args.python, argvs, dict(env), run.Node(capability), release, fingerprint)
    run.resolve = recording
    doc["judged"] = [j for j in doc.get("judged", []) if j["release"] != release]
    try:
        for name, what, base, profile, launch in launches:
            for capability in CAPABILITIES:

                def render_with(more, name=name, base=base):
                    return render(load_profile(name, None, [*base, *more]), schema, args.python).argv

                node = run.Node(capability, source="--capability")
                try:
                    found = verdict.judge(profile, launch, target, node, render_with=render_with)
                    refusal = found.refusal(f"profile {name}", release)
                    said = refusal.message if refusal else "clean"
                    way_out = found.selection.way_out if found.selection else []
                except UserError as exc:
                    said, way_out = exc.message, []
                doc["judged"].append(
                    {
                        "release": release,
                        "capability": capability,
                        "what": what,
                        "profile": name,
                        "sets": normalized(base),
                        "said": normalized([said])[0],
                        "way_out": way_out,
                    }
                )
    finally:
        run.resolve = real
    unrun = {e["answer"]["error"] for e in made if e["answer"]["stage"] in ("probe", "timeout", "import")}
    for error in sorted(unrun):  # the recording environment's fault, not sglang's answer: say so
        print(f"{release}: a judged launch could not be resolved: {error}", file=sys.stderr)
    doc["launches"] = [x for x in doc.get("launches", []) if x.get("release") != release]
    seen = set()
    for entry in made:
        key = (entry["capability"], tuple(entry["flags"]))
        if key not in seen:
            seen.add(key)
            doc["launches"].append({"release": release, **entry})


def dump(answer) -> dict:
    """A resolution as the recording keeps it (what a replay needs)."""
    kept = {k: v for k, v in answer.resolved.items() if v is not None}
    return {
        "ok": answer.ok,
        "sglang": answer.sglang,
        "resolved": kept,
        "stage": answer.stage,
        "error": answer.error[:400],
        "how": answer.how,
    }


def read_recording() -> dict:
    if not RECORDING.is_file():
        return {"releases": {}, "cells": []}
    return json.loads(lzma.decompress(RECORDING.read_bytes()))


def write_recording(doc: dict) -> None:
    doc["cells"].sort(key=lambda c: (c["release"], c["model"], c["capability"], c["attention"] or "", c["kv"]))
    RECORDING.write_bytes(lzma.compress(json.dumps(doc, sort_keys=True).encode(), preset=9))


def model_config(model: str) -> dict | None:
    from sm120kit.shallow_json import loads

    config = loads((MODELS / model / "config.json").read_text())
    quant = MODELS / model / "hf_quant_config.json"
    if quant.is_file():
        config = {**config, "hf_quant_config": loads(quant.read_text())}
    return config


def verdict(cell: dict, versions: dict, table) -> str:
    """clean | no-build: KERNEL,... | rejected: sglang's message | not run: why."""
    if not cell["ok"]:
        if cell["stage"] == "argv" or cell["error"].split(":")[0] in run.SGLANG_REFUSALS:
            return "rejected: " + cell["error"]
        return "not run: " + cell["error"]
    record_ = cell["record"]
    filled = slots.fill(record_, model_config(cell["model"]))
    found = judge.judge(table, filled, record_, versions, cell["capability"])
    bad = [j.kernel.id for j in found if j.verdict is judge.KernelVerdict.NO_BUILD]
    return "no-build: " + ", ".join(bad) if bad else "clean"


def render(args) -> int:
    PAGE.write_text(render_page())
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


def render_page() -> str:
    """docs/resolution.md: every recorded cell judged against the shipped kernel table."""
    from sm120kit.catalogue.kernels import read_table

    doc, table = read_recording(), read_table()
    lines = [
        "# What sglang resolves on SM12x",
        "",
        "Generated by `python scripts/resolution_matrix.py render` from the recording",
        "(`docs/resolution-matrix.json.xz`, made by running each release's own argument resolution",
        "with sm120kit's probe, the node presented as 12.0 or 12.1). Each cell is judged against",
        "the kernel table (`patches/kernels.toml`): **clean**, **no-build** (a kernel with no SM12x",
        "build is dispatched: `profile check` and `serve` refuse it before the load), **rejected**",
        "(sglang's own argument checks refuse it), **not run**.",
        "",
        "## The default launch (no attention backend given, KV cache dtype auto)",
        "",
        "| model | release | 12.0 | 12.1 |",
        "|---|---|---|---|",
    ]
    by_key = defaultdict(dict)
    tally: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for cell in doc["cells"]:
        release = cell["release"]
        versions = {"sglang": release}
        versions.update(doc["releases"].get(release, {}).get("pins", {}))
        said = verdict(cell, versions, table)
        tally[(cell["model"], release)][said.split(":")[0]] += 1
        if cell["attention"] is None and cell["kv"] == "auto":
            by_key[(cell["model"], release)][cell["capability"]] = (cell, said)
    for (model, release), per in sorted(by_key.items(), key=lambda kv: (kv[0][0], _v(kv[0][1]))):
        row = [model, release]
        for capability in CAPABILITIES:
            cell, said = per.get(capability, (None, ""))
            picked = ""
            if cell and cell["ok"]:
                filled = slots.fill(cell["record"], None)
                picked = " / ".join(
                    f"{s}={filled[s]}" for s in ("attention.decode", "dsa.decode", "moe.runner") if s in filled
                )
            row.append(f"{said.replace('|', '/')}" + (f" ({picked})" if picked else ""))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Every attention backend and KV dtype: how many cells are what", ""]
    lines += ["| model | release | clean | no-build | rejected | not run |", "|---|---|---|---|---|---|"]
    for (model, release), counts in sorted(tally.items(), key=lambda kv: (kv[0][0], _v(kv[0][1]))):
        lines.append(
            f"| {model} | {release} | {counts['clean']} | {counts['no-build']} | {counts['rejected']} "
            f"| {counts['not run']} |"
        )
    lines += ["", "## Recorded", ""]
    for release, info in sorted(doc["releases"].items(), key=lambda kv: _v(kv[0])):
        lines.append(
            f"- sglang {release} (pins {', '.join(f'{k} {v}' for k, v in info['pins'].items() if k != 'sglang')}): "
            f"{info['cells']} cells "
            f"per capability, {info['wall_seconds']} s"
        )
    return "\n".join(lines) + "\n"


def _v(release: str):
    from packaging.version import Version

    return Version(release)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record", help="run each release's own resolution and record it")
    rec.add_argument("--python", required=True, help="an interpreter with torch (the PyPI wheel runs on a CPU)")
    rec.add_argument("--overlays", type=Path, required=True, help="the directory scripts/resolution_envs.py built")
    rec.add_argument("--timeout", type=float, default=3600.0, help="seconds for one release and capability")
    rec.add_argument("releases", nargs="+", help="sglang releases, e.g. 0.5.16 0.5.23")
    verbs.add_parser("render", help="judge the recording and write docs/resolution.md")
    args = parser.parse_args()
    return record(args) if args.verb == "record" else render(args)


if __name__ == "__main__":
    sys.exit(main())
