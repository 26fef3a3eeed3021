"""Profile intent -> the argv and environment that the *installed* sglang accepts.

Every flag goes through the release's own flag schema (read statically, flags.py): the
spelling it wants (`--dsa-*` from 0.5.13, `--nsa-*` before; the non-deprecated form of
"CUDA graphs off"), a value among its choices, and never a flag it does not have.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sm120kit.errors import UserError
from sm120kit.profiles.flags import FlagSchema
from sm120kit.profiles.model import EAGLE_FAMILY, FLAG_OWNERS, Engine, Profile, is_loopback, owned_flag_problem

BARE = object()  # a flag without a value
DSA_BACKENDS = {"nsa", "dsa"}

# What the releases do with speculative decoding beyond their flags, read from their source
# (tests/test_profile_variants.py checks each range against the real wheels):
# - SGLANG_ENABLE_SPEC_V2 (sglang/srt/environ.py) defaults to False up to 0.5.10.post1: without it
#   EAGLE/NEXTN runs the v1 worker with the overlap scheduler off (server_args.py
#   _handle_speculative_decoding); it defaults to True in 0.5.11-0.5.13.post1 and is gone from
#   0.5.14 (0.5.14-0.5.20 warn that it "has been removed", later releases ignore it). Rendered
#   for topk = 1 where it is off by default: the worker the later releases run by default.
SPEC_V2_OPT_IN = SpecifierSet("<0.5.11")
SPEC_V2_REMOVED = SpecifierSet(">=0.5.14")
# - pipeline parallelism with speculative decoding: check_server_args asserts it away up to
#   0.5.20 ("Pipeline parallelism is not compatible with overlap schedule, speculative
#   decoding"); from 0.5.21 arg_groups/validation_hook.py check_pipeline_parallel_compat takes
#   EAGLE (NEXTN resolves to it) outside a PD prefill node only with SGLANG_ENABLE_PP_SPEC=1.
PP_SPEC_ACCEPTED = SpecifierSet(">=0.5.21")
# FlashInfer all-reduce fusion runs only on SM90/SM100 in every release 0.5.9-0.5.23: the layer
# gate apply_flashinfer_allreduce_fusion (layers/communicator.py; from 0.5.21
# layers/layer_boundary/residual/add_norm.py, named flashinfer_ar_fusion_applies from 0.5.22)
# asks for either. Before 0.5.14 the flag is taken and does nothing elsewhere (0.5.11-0.5.13
# only try to build the workspace, and log the failure); from 0.5.14
# flashinfer_comm_fusion._resolve_backend raises "FlashInfer allreduce fusion requires SM90 or
# SM10X NVIDIA GPUs." while the server starts.
# FlashInfer has SM120 kernels for it from 0.6.17 (flashinfer/jit/comm.py gen_trtllm_comm_module,
# PR #3903); sglang PR #32330, which would take them on SM12x, was closed unmerged.
FUSION_CAPABILITIES = ("9", "10")
FUSION_REFUSED_ELSEWHERE = SpecifierSet(">=0.5.14")
TRUE_WORDS = {"1", "true", "yes", "on"}
# The built-in algorithms of 0.5.9-0.5.23 (--speculative-algorithm's choices up to 0.5.11; from
# 0.5.12 the enum in speculative/spec_info.py, which plugins may extend at run time).
SPECULATIVE_BUILTINS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO", "FROZEN_KV_MTP")


@dataclass(frozen=True)
class EnvRef:
    """An argument taken from the environment at launch (a secret never enters argv text)."""

    name: str


EntryPoints = tuple[tuple[str, str], ...]  # (python, module) of each program started as `python -m MODULE`


def python_modules(argvs: Sequence[Sequence[object]]) -> EntryPoints:
    """(python, module) of each argv that runs `python -m MODULE`, each once."""
    heads = [(str(a[0]), str(a[2])) for a in argvs if len(a) > 2 and a[1] == "-m"]
    return tuple(dict.fromkeys(heads))


@dataclass
class Launch:
    argv: list[str | EnvRef]
    env: dict[str, str]  # set on top of the caller's environment
    sglang: str
    warnings: list[str] = field(default_factory=list)
    config_flag: bool = False  # its sglang reads `--config FILE` (the API key goes in a file, not argv)
    what_runs: dict | None = None  # the launch's judgement (sm120kit.resolution.verdict), once judged

    @property
    def entry_points(self) -> EntryPoints:
        """What the imports check reads: the server's interpreter and module."""
        return python_modules([self.argv])

    def shell(self) -> str:
        """The command as a shell would run it; secrets stay "$NAME" references."""
        words = [f'"${a.name}"' if isinstance(a, EnvRef) else shlex.quote(a) for a in self.argv]
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " \\\n  ".join([*env, " ".join(words[:3]), *_pairs(words[3:])])

    def as_json(self) -> dict:
        return {
            "argv": [f"${a.name}" if isinstance(a, EnvRef) else a for a in self.argv],
            "env": self.env,
            "sglang": self.sglang,
            "warnings": self.warnings,
            **({"what_runs": self.what_runs} if self.what_runs is not None else {}),
        }


def _pairs(words: list[str]) -> list[str]:
    """One flag per line, with its value."""
    lines: list[str] = []
    for word in words:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += " " + word
    return lines


class _Argv:
    """Collects flags, checking each against the schema; errors are gathered, not raised."""

    def __init__(self, schema: FlagSchema, version: str) -> None:
        self.schema, self.version = schema, version
        self.argv: list[str | EnvRef] = []
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def has(self, spelling: str) -> bool:
        flag = self.schema.get(spelling)
        return flag is not None and not flag.deprecated

    def add(self, key: str, spellings: tuple[str, ...] | str, value: object = BARE) -> None:
        spellings = (spellings,) if isinstance(spellings, str) else spellings
        found = [self.schema.get(s) for s in spellings]
        current = [(s, f) for s, f in zip(spellings, found) if f and not f.deprecated]
        usable = current or [(s, f) for s, f in zip(spellings, found) if f]
        if not usable:
            near = self.schema.nearest(spellings[0])
            self.errors.append(
                f"{key}: sglang {self.version} has no {spellings[0]}" + (f" (nearest: {near})" if near else "")
            )
            return
        spelling, flag = usable[0]
        if not current:
            self.warnings.append(
                f"{key}: {spelling} is deprecated in sglang {self.version}"
                + (f"; use {flag.replacement}" if flag.replacement else "")
            )
        if value is BARE:
            if flag.takes_value:
                self.errors.append(f"{key}: {spelling} takes a value in sglang {self.version}")
                return
            self.argv.append(spelling)
            return
        if isinstance(value, EnvRef):
            self.argv += [spelling, value]
            return
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if flag.choices is not None and text not in flag.choices:
            self.errors.append(
                f"{key} = {text!r}: sglang {self.version} accepts {', '.join(flag.choices)} for {spelling}"
            )
            return
        self.argv += [spelling, text]


def check_version(profile: Profile, version: str) -> list[str]:
    """An error below the proven range ("needs sglang >= X"), a warning above it."""
    if not profile.sglang or SpecifierSet(profile.sglang).contains(Version(version), prereleases=True):
        return []
    floors = [s.version for s in SpecifierSet(profile.sglang) if s.operator in (">=", ">", "==", "~=")]
    if any(Version(version) < Version(f) for f in floors):
        raise UserError(
            f"profile {profile.name} needs sglang {profile.sglang}; installed: {version}",
            f"pip install -U 'sglang{profile.sglang}', then `sm120kit patch --verify`",
        )
    return [f"profile {profile.name} is proven on sglang {profile.sglang}; installed {version} is not in that range"]


def gpus_used(profile: Profile) -> tuple[int, str]:
    """(GPUs the server uses over all its nodes, how that is counted): tp x pp, times dp
    unless dp-attention runs the dp ranks inside the tp group (sglang's own rule)."""
    p = profile.parallel
    if profile.extra_args.get("--enable-dp-attention"):
        return p.tp * p.pp, "parallel.tp × pp"
    return p.tp * p.pp * p.dp, "parallel.tp × pp × dp"


def unservable(profile: Profile) -> list[str]:
    """Why this profile cannot start a server as it stands: a node profile such as
    sm120-base names no model (sglang's parser rejects a command without --model-path),
    and the parallel sizes must use the GPUs that the node section promises."""
    problems = []
    if not profile.model.path:
        problems.append("model.path is not set: the profile names no model (a node profile is meant to be extended)")
    total, counted = gpus_used(profile)
    nodes, gpus = profile.parallel.nnodes, profile.node.gpus
    if profile.fleet is not None:  # node.gpus is the node's; the parallel sizes are one replica's (fleet.plan)
        return problems
    if nodes == 1 and total != gpus:
        problems.append(f"{counted} = {total} GPU{'s' * (total != 1)}, but node.gpus = {gpus}")
    elif nodes > 1 and total != gpus * nodes:
        problems.append(
            f"{counted} = {total} GPUs over parallel.nnodes = {nodes} is {total / nodes:g} per node, "
            f"but node.gpus = {gpus}"
        )
    return problems


def require_servable(profile: Profile) -> None:
    """A UserError naming what is missing when the profile cannot serve (serve, bench, profile check)."""
    problems = unservable(profile)
    if not problems:
        return
    if not profile.model.path:
        hint = (
            f'write a profile that extends it (extends = "{profile.name}", '
            'then [model] path = "...", [parallel] tp = N) '
            "and serve that, e.g. `sm120kit profile show glm5-nvfp4`; or add --set model.path=DIR --set parallel.tp=N"
        )
    else:
        hint = (
            "make the parallel sizes use node.gpus GPUs per node, "
            "or set node.gpus to what the server uses (--set works too)"
        )
    raise UserError(f"profile {profile.name} ({profile.source}) cannot serve:\n  " + "\n  ".join(problems), hint)


def render(profile: Profile, schema: FlagSchema, python: str = "python3") -> Launch:
    require_servable(profile)
    warnings = check_version(profile, schema.version)
    out = _Argv(schema, schema.version)
    m, p, e, s = profile.model, profile.parallel, profile.engine, profile.server

    if m.path:
        out.add("model.path", "--model-path", m.path)
    if m.served_name:
        out.add("model.served_name", "--served-model-name", m.served_name)
    if m.quantization:
        out.add("model.quantization", "--quantization", m.quantization)
    if m.trust_remote_code:
        out.add("model.trust_remote_code", "--trust-remote-code")
    if m.context_length:
        out.add("model.context_length", "--context-length", m.context_length)

    out.add("parallel.tp", ("--tp-size", "--tensor-parallel-size"), p.tp)
    for key, flag, size in (("pp", "--pp-size", p.pp), ("dp", "--dp-size", p.dp)):
        if size > 1:
            out.add(f"parallel.{key}", flag, size)
    if p.ep:
        out.add("parallel.ep", ("--ep-size", "--expert-parallel-size"), p.ep)
    if p.nnodes > 1:
        out.add("parallel.nnodes", "--nnodes", p.nnodes)
        out.add("parallel.node_rank", "--node-rank", p.node_rank)
        if p.dist_init_addr:
            out.add("parallel.dist_init_addr", "--dist-init-addr", p.dist_init_addr)

    kv_cache_dtype = _kv_cache_dtype(profile, warnings)
    for key, spellings, value in (
        ("engine.moe_runner_backend", "--moe-runner-backend", e.moe_runner_backend),
        ("engine.attention_backend", "--attention-backend", e.attention_backend),
        ("engine.prefill_attention_backend", "--prefill-attention-backend", e.prefill_attention_backend),
        ("engine.decode_attention_backend", "--decode-attention-backend", e.decode_attention_backend),
        ("engine.dsa_prefill_backend", ("--dsa-prefill-backend", "--nsa-prefill-backend"), e.dsa_prefill_backend),
        ("engine.dsa_decode_backend", ("--dsa-decode-backend", "--nsa-decode-backend"), e.dsa_decode_backend),
        ("engine.kv_cache_dtype", "--kv-cache-dtype", kv_cache_dtype),
        ("engine.fp4_gemm_backend", "--fp4-gemm-backend", e.fp4_gemm_backend),
        ("engine.max_running_requests", "--max-running-requests", e.max_running_requests),
        ("engine.mem_fraction_static", "--mem-fraction-static", e.mem_fraction_static),
        ("engine.chunked_prefill_size", "--chunked-prefill-size", e.chunked_prefill_size),
    ):
        if value is not None:
            out.add(key, spellings, value)
    _cuda_graphs(out, e)
    if e.flashinfer_allreduce_fusion:
        _fusion_capability(out, profile, warnings)
        # 0.5.14 deprecated the switch for a backend choice; "auto" is what the switch now means
        if out.has("--flashinfer-allreduce-fusion-backend"):
            out.add("engine.flashinfer_allreduce_fusion", "--flashinfer-allreduce-fusion-backend", "auto")
        else:
            out.add("engine.flashinfer_allreduce_fusion", "--enable-flashinfer-allreduce-fusion")
    env = dict(profile.env)
    _speculative(out, profile, env, warnings)
    if not e.radix_cache:
        out.add("engine.radix_cache", "--disable-radix-cache")
    if e.disable_shared_experts_fusion:
        out.add("engine.disable_shared_experts_fusion", "--disable-shared-experts-fusion")
    if not e.flashinfer_autotune:
        out.add("engine.flashinfer_autotune", "--disable-flashinfer-autotune")

    out.add("server.host", "--host", s.host)
    out.add("server.port", "--port", s.port)
    if s.api_key_env:
        out.add("server.api_key_env", "--api-key", EnvRef(s.api_key_env))
    elif not is_loopback(s.host):
        warnings.append(f"server.host = {s.host}: a public bind WITHOUT an API key (allow_public_without_key is set)")

    owned = _owned_flags(schema)
    for flag, value in profile.extra_args.items():
        spec = schema.get(flag)
        if spec is not None and spec.name in owned:  # another spelling of a flag that a field sets
            owner = owned[spec.name]
            out.errors.append(
                f"extra_args.{flag!r}: sglang {schema.version} reads it as {spec.name}: "
                f"{owned_flag_problem(spec.name, owner)}"
            )
            continue
        if value is None or value is False:
            continue
        out.add(f"extra_args.{flag!r}", flag, BARE if value is True else value)

    if out.errors:
        raise UserError(
            f"profile {profile.name} ({profile.source}) does not fit sglang {schema.version}:\n  "
            + "\n  ".join(out.errors),
            "fix the profile or override with --set; "
            f"`sm120kit profile show {profile.name}` prints what it resolved to",
        )
    argv = [python, "-m", "sglang.launch_server", *out.argv]
    return Launch(argv, env, schema.version, warnings + out.warnings, schema.get("--config") is not None)


def _owned_flags(schema: FlagSchema) -> dict[str, str]:
    """The installed release's canonical name of every flag a field owns -> that field: an
    alias the release added (not in FLAG_OWNERS) still selects the owned flag."""
    return {spec.name: owner for spelling, owner in FLAG_OWNERS.items() if (spec := schema.get(spelling))}


def _cuda_graphs(out: _Argv, e: Engine) -> None:
    """Off: --disable-cuda-graph while it is current; the per-phase backends once it is
    deprecated (0.5.14+). The max batch size was split per phase in 0.5.20."""
    if not e.cuda_graphs:
        new = ("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill")
        if out.has("--disable-cuda-graph") or not all(out.has(f) for f in new):
            out.add("engine.cuda_graphs", "--disable-cuda-graph")
        else:
            for flag in new:
                out.add("engine.cuda_graphs", flag, "disabled")
    elif not e.prefill_cuda_graphs:
        # prefill graphs are their own backend from 0.5.14, "piecewise" graphs 0.5.10-0.5.13
        # (on by default there), and opt-in (--enable-piecewise-cuda-graph) in 0.5.9
        if out.has("--cuda-graph-backend-prefill"):
            out.add("engine.prefill_cuda_graphs", "--cuda-graph-backend-prefill", "disabled")
        elif out.has("--disable-piecewise-cuda-graph"):
            out.add("engine.prefill_cuda_graphs", "--disable-piecewise-cuda-graph")
    if e.cuda_graph_max_bs is not None:
        out.add("engine.cuda_graph_max_bs", ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"), e.cuda_graph_max_bs)


def _fusion_capability(out: _Argv, profile: Profile, warnings: list[str]) -> None:
    """All-reduce fusion on a GPU other than SM90/SM100 before 0.5.14: no effect. From 0.5.14
    the release refuses it at startup: on SM12x that is the known failure
    allreduce-fusion-sm90-sm100-only of patches/known-failures.toml, refused by its launch rule."""
    capability = profile.node.compute_capability
    major = capability.split(".")[0] if capability else None
    if major is None or major in FUSION_CAPABILITIES:
        return
    if not FUSION_REFUSED_ELSEWHERE.contains(Version(out.version), prereleases=True):
        warnings.append(
            f"engine.flashinfer_allreduce_fusion on node.compute_capability = {capability}: sglang {out.version} "
            "fuses the all-reduce only on SM90/SM100: the flag has no effect here"
        )


def _speculative(out: _Argv, profile: Profile, env: dict[str, str], warnings: list[str]) -> None:
    """--speculative-* from [speculative], the environment the release needs with them, and
    the release's own refusal of speculative decoding under pipeline parallelism."""
    sp, version = profile.speculative, Version(out.version)
    if sp.algorithm is None:
        return
    out.add("speculative.algorithm", "--speculative-algorithm", sp.algorithm)
    listed = out.schema.get("--speculative-algorithm")
    if listed is not None and listed.choices is None and sp.algorithm not in SPECULATIVE_BUILTINS:
        near = difflib.get_close_matches(sp.algorithm, SPECULATIVE_BUILTINS, n=1)
        warnings.append(
            f"speculative.algorithm = {sp.algorithm}: not one of sglang's built-in algorithms"
            + (f" (did you mean {near[0]}?)" if near else f" ({', '.join(SPECULATIVE_BUILTINS)})")
            + "; it starts only if a plugin registers it"
        )
    if sp.num_steps is not None:
        out.add("speculative.num_steps", "--speculative-num-steps", sp.num_steps)
    if sp.eagle_topk is not None:
        out.add("speculative.eagle_topk", "--speculative-eagle-topk", sp.eagle_topk)
    draft = sp.num_draft_tokens
    if draft is None and sp.eagle_topk == 1 and sp.num_steps is not None:
        draft = sp.num_steps + 1  # what sglang would use: written out, so the argv says it
    if draft is not None:
        out.add("speculative.num_draft_tokens", "--speculative-num-draft-tokens", draft)
    if sp.draft_model_path:
        out.add(
            "speculative.draft_model_path",
            ("--speculative-draft-model-path", "--speculative-draft-model"),
            sp.draft_model_path,
        )

    eagle = sp.algorithm in EAGLE_FAMILY
    if "SGLANG_ENABLE_SPEC_V2" in profile.env:
        if SPEC_V2_REMOVED.contains(version, prereleases=True):
            warnings.append(
                f"env.SGLANG_ENABLE_SPEC_V2: sglang {out.version} has removed it (speculative decoding always "
                "runs the v2 worker; --disable-overlap-schedule selects the synchronous path)"
            )
    elif eagle and sp.eagle_topk == 1 and SPEC_V2_OPT_IN.contains(version, prereleases=True):
        # spec v2 takes topk = 1 only (a larger topk raises with it on)
        env["SGLANG_ENABLE_SPEC_V2"] = "1"

    pp = profile.parallel.pp
    if pp == 1:
        return
    prefix = f"speculative.algorithm = {sp.algorithm} with parallel.pp = {pp}: sglang {out.version}"
    if not PP_SPEC_ACCEPTED.contains(version, prereleases=True):
        out.errors.append(
            f"{prefix} refuses speculative decoding under pipeline parallelism (check_server_args: "
            '"Pipeline parallelism is not compatible with overlap schedule, speculative decoding")'
        )
    elif sp.algorithm not in ("EAGLE", "NEXTN"):
        out.errors.append(f"{prefix} takes only EAGLE (or NEXTN) speculative decoding under pipeline parallelism")
    elif env.get("SGLANG_ENABLE_PP_SPEC", "").strip().lower() not in TRUE_WORDS:
        out.errors.append(
            f"{prefix} takes speculative decoding under pipeline parallelism only with env.SGLANG_ENABLE_PP_SPEC = "
            '"1" (experimental) or on a PD prefill node (check_pipeline_parallel_compat)'
        )


def _kv_cache_dtype(profile: Profile, warnings: list[str]) -> str | None:
    """GLM-5 on a non-DSA attention backend with an fp8 KV cache gives garbled output (and
    took the page_table path): render bf16 unless the profile insists."""
    e = profile.engine
    model = (profile.model.path or "").lower()
    glm5 = "glm-5" in model or "glm5" in model
    non_dsa = e.attention_backend is not None and e.attention_backend not in DSA_BACKENDS
    fp8 = e.kv_cache_dtype in (None, "auto") or (e.kv_cache_dtype or "").startswith("fp8")
    if not (glm5 and non_dsa and fp8) or e.insist_kv_cache_dtype:
        return e.kv_cache_dtype
    warnings.append(
        f"engine.kv_cache_dtype = {e.kv_cache_dtype or 'auto'}: GLM-5 on attention backend {e.attention_backend} "
        "with an fp8 KV cache gives garbled output; rendering bf16 (set engine.insist_kv_cache_dtype = true to keep it)"
    )
    return "bf16"
