"""A launch profile: what the operator means, not the flags of one sglang release.

Strict pydantic models (no coercion: `tp = "8"` is an error, as is any key the model does
not have). Every field carries a description: it shows in the JSON Schema that editors use
for completion (`loader.profile_schema()`). The renderer turns a Profile into the flags that
the installed sglang accepts.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, TypeVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FLAG_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")
ExtraValue = str | int | float | bool | None

# Every number is finite and bounded: inf, nan or 1e300 seconds broke the stop path
# (OverflowError in the deadline arithmetic). The bounds are generous, not tuning advice.
MAX_SECONDS = 86400.0  # a day: any health budget, interval or delay
MAX_PARALLEL = 1024  # GPUs per node, tp/pp/dp/ep sizes, nodes
MAX_TOKENS = 100_000_000  # a context, a prefill chunk
MAX_REQUESTS = 1_000_000  # running requests, a CUDA graph's batch
MAX_GB = 1_000_000_000  # a GPU's memory, a checkpoint on disk: an exabyte, more than any disk
MAX_COUNT = 1000  # probe failures in a row, restarts in a row
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# Every flag that a profile field renders (render.py), with the spellings sglang also
# accepts for it, and the field that owns it. extra_args may not set one: a second --host
# after the loopback one, an --api-key in argv or a --config of its own would undo a guard.
FLAG_OWNERS: dict[str, str] = {
    **dict.fromkeys(("--model-path", "--model"), "model.path"),
    "--served-model-name": "model.served_name",
    "--quantization": "model.quantization",
    "--trust-remote-code": "model.trust_remote_code",
    "--context-length": "model.context_length",
    **dict.fromkeys(("--tp-size", "--tensor-parallel-size"), "parallel.tp"),
    **dict.fromkeys(("--pp-size", "--pipeline-parallel-size"), "parallel.pp"),
    **dict.fromkeys(("--dp-size", "--data-parallel-size"), "parallel.dp"),
    **dict.fromkeys(("--ep-size", "--expert-parallel-size", "--ep"), "parallel.ep"),
    "--nnodes": "parallel.nnodes",
    "--node-rank": "parallel.node_rank",
    **dict.fromkeys(("--dist-init-addr", "--nccl-init-addr"), "parallel.dist_init_addr"),
    "--moe-runner-backend": "engine.moe_runner_backend",
    "--attention-backend": "engine.attention_backend",
    "--prefill-attention-backend": "engine.prefill_attention_backend",
    "--decode-attention-backend": "engine.decode_attention_backend",
    **dict.fromkeys(("--dsa-prefill-backend", "--nsa-prefill-backend"), "engine.dsa_prefill_backend"),
    **dict.fromkeys(("--dsa-decode-backend", "--nsa-decode-backend"), "engine.dsa_decode_backend"),
    "--kv-cache-dtype": "engine.kv_cache_dtype",
    "--fp4-gemm-backend": "engine.fp4_gemm_backend",
    "--max-running-requests": "engine.max_running_requests",
    "--mem-fraction-static": "engine.mem_fraction_static",
    "--chunked-prefill-size": "engine.chunked_prefill_size",
    **dict.fromkeys(
        ("--disable-cuda-graph", "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"), "engine.cuda_graphs"
    ),
    **dict.fromkeys(("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"), "engine.cuda_graph_max_bs"),
    **dict.fromkeys(("--disable-prefill-cuda-graph", "--disable-piecewise-cuda-graph"), "engine.prefill_cuda_graphs"),
    "--disable-radix-cache": "engine.radix_cache",
    "--disable-shared-experts-fusion": "engine.disable_shared_experts_fusion",
    "--disable-flashinfer-autotune": "engine.flashinfer_autotune",
    **dict.fromkeys(
        ("--enable-flashinfer-allreduce-fusion", "--flashinfer-allreduce-fusion-backend"),
        "engine.flashinfer_allreduce_fusion",
    ),
    "--speculative-algorithm": "speculative.algorithm",
    "--speculative-num-steps": "speculative.num_steps",
    "--speculative-eagle-topk": "speculative.eagle_topk",
    "--speculative-num-draft-tokens": "speculative.num_draft_tokens",
    **dict.fromkeys(("--speculative-draft-model-path", "--speculative-draft-model"), "speculative.draft_model_path"),
    "--host": "server.host",
    "--port": "server.port",
    **dict.fromkeys(
        ("--api-key", "--config"), "server.api_key_env"
    ),  # the key reaches sglang in sm120kit's own --config file
    "--admin-api-key": "",  # a secret with no field: never in argv, where every user can read it
}


def owned_flag_problem(flag: str, owner: str) -> str:
    if not owner:
        return f"{flag} carries a secret, and argv is readable by every user of the machine: sm120kit does not pass it"
    if owner == "server.api_key_env":
        return (
            f"{flag} carries the API key, which sm120kit passes from the variable that server.api_key_env names "
            f"(never in argv): set {owner} instead"
        )
    return f"{flag} is rendered from {owner}: set {owner} instead"


def _not_owned(flag: str) -> str:
    if (owner := FLAG_OWNERS.get(flag)) is not None:
        raise PydanticCustomError("owned_flag", owned_flag_problem(flag, owner), {"owner": owner})
    return flag


FlagKey = Annotated[str, AfterValidator(_not_owned)]


def allowed_range(field: FieldInfo) -> str | None:
    """The bounds of a number field in words: "an integer from 1 to 1024", "a number
    above 0 and at most 86400"; None for a field without bounds."""
    bound = {
        k: getattr(m, k) for m in field.metadata for k in ("gt", "ge", "lt", "le") if getattr(m, k, None) is not None
    }
    if not bound:
        return None
    number = "an integer" if int in (field.annotation, *getattr(field.annotation, "__args__", ())) else "a number"
    if "ge" in bound and "le" in bound:
        return f"{number} from {_plain(bound['ge'])} to {_plain(bound['le'])}"
    low = (
        f"above {_plain(bound['gt'])}" if "gt" in bound else f"at least {_plain(bound['ge'])}" if "ge" in bound else ""
    )
    high = (
        f"below {_plain(bound['lt'])}" if "lt" in bound else f"at most {_plain(bound['le'])}" if "le" in bound else ""
    )
    return f"{number} " + " and ".join(w for w in (low, high) if w)


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


_MaybeHost = TypeVar("_MaybeHost", str, str | None)


def _host(value: _MaybeHost) -> _MaybeHost:
    """A host the URLs built from it hold as it is (the router's, its workers'): a name or an
    IP address (sm120kit.urls)."""
    from sm120kit.urls import host_problem

    if value is not None and (problem := host_problem(value)):
        raise ValueError(problem)
    return value


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything: public


class Node(BaseModel):
    model_config = STRICT

    gpus: int = Field(1, ge=1, le=MAX_PARALLEL, description="GPUs on each node that the server uses.")
    compute_capability: str | None = Field(
        None, pattern=r"^\d+\.\d+$", description='Compute capability the profile is meant for, e.g. "12.0" (SM120).'
    )
    gpu_memory_gb: int | None = Field(
        None, ge=1, le=MAX_GB, description="Memory of each GPU in GB that the profile is sized for, e.g. 96."
    )


class Model(BaseModel):
    model_config = STRICT

    path: str | None = Field(None, description="Model directory or Hugging Face repo id (--model-path).")
    served_name: str | None = Field(None, description="Name clients use in requests (--served-model-name).")
    quantization: str | None = Field(None, description='Quantization method, e.g. "modelopt_fp4" (--quantization).')
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own Python code (--trust-remote-code)."
    )
    context_length: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Maximum context length in tokens (--context-length)."
    )
    size_gb: int | None = Field(
        None, ge=1, le=MAX_GB, description="The checkpoint's size on disk in GB (doctor checks the free space for it)."
    )


class Parallel(BaseModel):
    model_config = STRICT

    tp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Tensor parallel size (--tp-size).")
    pp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Pipeline parallel size (--pp-size).")
    dp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Data parallel size (--dp-size).")
    ep: int | None = Field(
        None, ge=1, le=MAX_PARALLEL, description="Expert parallel size (--ep-size); unset: sglang's default."
    )
    nnodes: int = Field(1, ge=1, le=MAX_PARALLEL, description="Number of nodes the server spans (--nnodes).")
    node_rank: int = Field(0, ge=0, le=MAX_PARALLEL - 1, description="Rank of this node, 0 .. nnodes-1 (--node-rank).")
    dist_init_addr: str | None = Field(
        None, description='host:port of rank 0 for a multi-node server, e.g. "10.0.0.1:5000" (--dist-init-addr).'
    )

    @model_validator(mode="after")
    def _rank_in_range(self) -> Parallel:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"parallel.node_rank = {self.node_rank} must be less than parallel.nnodes = {self.nnodes}")
        return self


class Engine(BaseModel):
    model_config = STRICT

    moe_runner_backend: str | None = Field(
        None, description='MoE runner backend, e.g. "flashinfer_cutlass" (--moe-runner-backend).'
    )
    attention_backend: str | None = Field(
        None, description='Attention backend, e.g. "flashinfer" (--attention-backend).'
    )
    prefill_attention_backend: str | None = Field(
        None, description="Attention backend for prefill only (--prefill-attention-backend)."
    )
    decode_attention_backend: str | None = Field(
        None, description="Attention backend for decode only (--decode-attention-backend)."
    )
    dsa_prefill_backend: str | None = Field(
        None,
        description="DeepSeek Sparse Attention prefill backend (--dsa-prefill-backend; --nsa-* before sglang 0.5.13).",
    )
    dsa_decode_backend: str | None = Field(
        None,
        description="DeepSeek Sparse Attention decode backend (--dsa-decode-backend; --nsa-* before sglang 0.5.13).",
    )
    kv_cache_dtype: str | None = Field(
        None, description='KV cache data type, e.g. "auto", "fp8_e4m3", "bf16" (--kv-cache-dtype).'
    )
    fp4_gemm_backend: str | None = Field(None, description="FP4 GEMM backend (--fp4-gemm-backend).")
    cuda_graphs: bool = Field(
        True, description="Capture CUDA graphs; false disables them in the spelling the installed sglang wants."
    )
    cuda_graph_max_bs: int | None = Field(
        None, ge=1, le=MAX_REQUESTS, description="Largest batch size captured in a CUDA graph (--cuda-graph-max-bs)."
    )
    prefill_cuda_graphs: bool = Field(
        True,
        description="With cuda_graphs on: false keeps CUDA graphs for decode only "
        "(--cuda-graph-backend-prefill disabled from sglang 0.5.14, --disable-piecewise-cuda-graph before; "
        "0.5.9 captures no prefill graphs unless asked).",
    )
    radix_cache: bool = Field(True, description="Prefix (radix) cache; false passes --disable-radix-cache.")
    max_running_requests: int | None = Field(
        None, ge=1, le=MAX_REQUESTS, description="Maximum concurrent requests (--max-running-requests)."
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Fraction of GPU memory for weights and KV cache, 0 < x < 1 (--mem-fraction-static).",
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=-1,
        le=MAX_TOKENS,
        description="Tokens per prefill chunk; -1 disables chunked prefill (--chunked-prefill-size).",
    )
    disable_shared_experts_fusion: bool = Field(False, description="Pass --disable-shared-experts-fusion.")
    flashinfer_autotune: bool = Field(
        True, description="FlashInfer autotuning at startup; false passes --disable-flashinfer-autotune."
    )
    flashinfer_allreduce_fusion: bool = Field(
        False,
        description="Fuse the tensor-parallel all-reduce with residual + RMSNorm in FlashInfer "
        "(--enable-flashinfer-allreduce-fusion; --flashinfer-allreduce-fusion-backend auto from sglang 0.5.14).",
    )
    insist_kv_cache_dtype: bool = Field(
        False,
        description="Keep kv_cache_dtype even where sm120kit would warn and change it "
        "(a combination known to give wrong output).",
    )

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk(cls, value: int | None) -> int | None:
        if value == 0:  # the bounds say -1 .. MAX_TOKENS; 0 is neither a size nor "off"
            raise ValueError("must be a positive number of tokens, or -1 to disable chunked prefill")
        return value


# The EAGLE family: a draft proposes num_steps tokens, topk wide; NEXTN is sglang's name for a
# model's own MTP layers (it runs them as EAGLE).
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
MAX_DRAFT = 64  # draft steps, tree width, draft tokens: generous (the field runs 3-6)


class Speculative(BaseModel):
    model_config = STRICT

    algorithm: str | None = Field(
        None,
        description='Speculative decoding algorithm, e.g. "NEXTN" (the model\'s own MTP layers), "EAGLE", "EAGLE3" '
        "(--speculative-algorithm); unset: off. Checked against the installed sglang's choices where it lists them.",
    )
    num_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT,
        description="Draft steps per round (--speculative-num-steps); unset with eagle_topk and num_draft_tokens: "
        "sglang chooses all three.",
    )
    eagle_topk: int | None = Field(
        None, ge=1, le=MAX_DRAFT, description="Tokens the draft keeps per step (--speculative-eagle-topk)."
    )
    num_draft_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT * MAX_DRAFT,
        description="Draft tokens verified per round (--speculative-num-draft-tokens); with eagle_topk = 1 "
        "sglang uses num_steps + 1, which is rendered when this is unset.",
    )
    draft_model_path: str | None = Field(
        None,
        min_length=1,
        description="Draft model directory or repo id (--speculative-draft-model-path); unset for NEXTN: "
        "sglang drafts with the MTP layers of model.path.",
    )

    @field_validator("algorithm")
    @classmethod
    def _capitals(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Z][A-Z0-9_]*", value):
            raise ValueError(
                f"{value!r}: sglang names its algorithms in capitals, e.g. "
                f"{', '.join(repr(a) for a in EAGLE_FAMILY)}"
                + (f" (did you mean {value.upper()!r}?)" if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", value) else "")
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        # sglang's own rules, the same in every release 0.5.9-0.5.23 (server_args.py
        # _handle_speculative_decoding; from 0.5.13 arg_groups/speculative_hook.py)
        given = [k for k in ("num_steps", "eagle_topk", "num_draft_tokens", "draft_model_path") if getattr(self, k)]
        if self.algorithm is None:
            if given:
                raise ValueError(
                    f"speculative.{given[0]} is set but speculative.algorithm is not: set the algorithm "
                    '(e.g. "NEXTN" for the model\'s own MTP layers), or remove the [speculative] table'
                )
            return self
        if self.algorithm not in EAGLE_FAMILY:
            return self
        if self.num_steps is None and (self.eagle_topk is not None or self.num_draft_tokens is not None):
            raise ValueError(
                "speculative.num_steps is not set: sglang chooses num_steps, eagle_topk and num_draft_tokens "
                "together (all three, or none of them)"
            )
        if self.num_steps is not None and self.eagle_topk is None:
            raise ValueError(
                "speculative.eagle_topk is not set: with num_steps set, sglang needs eagle_topk too "
                "(1 for a single draft chain)"
            )
        # (num_steps is set here: eagle_topk without it was refused above)
        if (
            self.eagle_topk == 1
            and self.num_steps is not None
            and self.num_draft_tokens not in (None, self.num_steps + 1)
        ):
            raise ValueError(
                f"speculative.num_draft_tokens = {self.num_draft_tokens}: with eagle_topk = 1 sglang replaces it "
                f"with num_steps + 1 = {self.num_steps + 1}; write that, or leave num_draft_tokens out"
            )
        if self.eagle_topk is not None and self.eagle_topk > 1 and self.num_draft_tokens is None:
            raise ValueError(
                f"speculative.num_draft_tokens is not set: with eagle_topk = {self.eagle_topk} "
                "sglang needs the number of draft tokens to verify"
            )
        return self


class Server(BaseModel):
    model_config = STRICT

    host: str = Field(
        "127.0.0.1", min_length=1, description="Address to bind (--host). Anything but loopback needs api_key_env."
    )
    port: int = Field(30000, ge=1, le=65535, description="Port to bind (--port).")
    api_key_env: str | None = Field(
        None,
        json_schema_extra={"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        description="NAME of the environment variable that holds the API key (never the key itself); "
        "passed as --api-key at launch.",
    )
    allow_public_without_key: bool = Field(
        False,
        description="Allow a non-loopback host without api_key_env (anyone who reaches the port can use the server).",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve the supervisor's own state in the Prometheus text format on this port (at server.host), "
        "as `serve --metrics-port` does.",
    )

    @field_validator("host")
    @classmethod
    def _is_host(cls, value: str) -> str:
        return _host(value)

    @field_validator("api_key_env")
    @classmethod
    def _key_is_a_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.fullmatch(value):
            raise ValueError(
                "must be the NAME of an environment variable that holds the key (e.g. SGLANG_API_KEY), "
                "not the key itself"
            )
        return value

    @model_validator(mode="after")
    def _public_needs_key(self) -> Server:
        if not is_loopback(self.host) and not self.api_key_env and not self.allow_public_without_key:
            raise ValueError(
                f"server.host = {self.host!r} is a public bind without an API key: set server.api_key_env to the name "
                "of the environment variable that holds the key, or set server.allow_public_without_key = true"
            )
        return self


RouterValue = str | int | float | bool | list[str]


class Replica(BaseModel):
    model_config = STRICT

    gpus: str | None = Field(
        None,
        json_schema_extra={"pattern": "^[0-9]+(,[0-9]+)*$"},
        description='GPU indices of this node for the replica, e.g. "0,1,2,3" (its CUDA_VISIBLE_DEVICES); '
        "default: the next fleet.gpus_per_replica GPUs.",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="The replica's --port; default: the router's port + 1 + its index."
    )
    node: str | None = Field(
        None,
        min_length=1,
        description="Address of the node that serves this replica, when it is not this one: the router reaches "
        "it at http://NODE:PORT; `serve --replicas-only` on that node starts it.",
    )
    url: str | None = Field(
        None,
        min_length=1,
        description="A worker served by other means (another supervisor, a multi-node server): routed to, "
        "never started here.",
    )

    @field_validator("gpus")
    @classmethod
    def _gpu_list(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9]+(,[0-9]+)*", value.replace(" ", "")):
            raise ValueError(f'{value!r} is not a list of GPU indices, e.g. "0,1,2,3"')
        return value

    @field_validator("url")
    @classmethod
    def _is_url(cls, value: str | None) -> str | None:
        if value is not None:
            from sm120kit.urls import BadUrl, parse_http_url

            try:
                parse_http_url(value)  # the one parser of a server's URL (smoke and bench --url too)
            except BadUrl as exc:
                raise ValueError(f"{value!r} is not a worker URL ({exc}): write it as http://HOST:PORT") from None
        return value

    @field_validator("node")
    @classmethod
    def _is_host(cls, value: str | None) -> str | None:
        return _host(value)

    @model_validator(mode="after")
    def _served_here_or_not(self) -> Replica:
        if self.url is not None and (self.gpus, self.port, self.node) != (None, None, None):
            raise ValueError("a replica with url is served elsewhere: give url alone, or gpus/port/node without it")
        return self


class Fleet(BaseModel):
    model_config = STRICT

    replicas: int | None = Field(
        None, ge=1, le=MAX_PARALLEL, description="How many replicas on this node (or list them as [[fleet.replica]])."
    )
    replica: list[Replica] = Field(
        default_factory=list, description="The replicas one by one: their GPUs, port, node or URL."
    )
    gpus_per_replica: int | None = Field(
        None, ge=1, le=MAX_PARALLEL, description="GPUs each replica uses; default: parallel.tp × pp."
    )
    replica_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the replicas bind: loopback when the router runs on the same node; a routable one "
        "for a router on another node (then server.api_key_env is needed).",
    )
    router: dict[str, RouterValue] = Field(
        default_factory=dict,
        description="Options of sglang's router, as the installed sglang-router names them (policy, port, host, "
        "health_check_interval_secs, ...); port and host default to server.port and server.host.",
    )

    @field_validator("replica_host")
    @classmethod
    def _is_host(cls, value: str) -> str:
        return _host(value)

    @model_validator(mode="after")
    def _one_form(self) -> Fleet:
        if self.replicas is None and not self.replica:
            raise ValueError("a fleet needs replicas = N or a [[fleet.replica]] list")
        if self.replicas is not None and self.replica and self.replicas != len(self.replica):
            raise ValueError(
                f"fleet.replicas = {self.replicas} but {len(self.replica)} [[fleet.replica]] entries: "
                "give one of them, or make them agree"
            )
        return self


class Health(BaseModel):
    model_config = STRICT

    startup_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds to wait until the server generates (a 440 GB load takes a while).",
    )
    probe_interval_s: float = Field(10.0, gt=0, le=MAX_SECONDS, description="Seconds between liveness probes.")
    probe_timeout_s: float = Field(20.0, gt=0, le=MAX_SECONDS, description="Seconds one probe may take.")
    failures_before_restart: int = Field(
        3, ge=1, le=MAX_COUNT, description="Consecutive failed probes before the server is restarted."
    )
    max_restarts: int = Field(5, ge=0, le=MAX_COUNT, description="Restarts before giving up (crash-loop limit).")
    backoff_initial_s: float = Field(
        5.0, gt=0, le=MAX_SECONDS, description="First delay before a restart; doubles each time."
    )
    backoff_max_s: float = Field(300.0, gt=0, le=MAX_SECONDS, description="Longest delay between restarts.")
    stable_after_s: float = Field(
        600.0,
        gt=0,
        le=MAX_SECONDS,
        description="A run that stayed ready this long resets the crash-loop count and the backoff.",
    )
    stop_timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds between SIGTERM to the server's processes and SIGKILL "
        "(sglang's own drain has no deadline).",
    )
    smoke: bool = Field(
        False,
        description="Run `sm120kit smoke` once each start, when the server first generates: it is called ready "
        "only if the smoke passes; a failed smoke stops it (no restart: wrong answers are not a crash) and serve "
        "exits 1.",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> Health:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"health.backoff_max_s = {self.backoff_max_s} is less than "
                f"health.backoff_initial_s = {self.backoff_initial_s}"
            )
        return self


class Profile(BaseModel):
    model_config = ConfigDict(**STRICT, title="sm120kit launch profile")

    description: str = Field("", description="One line shown in the profile listing.")
    extends: str | list[str] | None = Field(
        None,
        description="Profile(s) to start from, applied in order, then this file on top (tables merge, lists replace).",
    )
    sglang: str | None = Field(
        None, description='PEP 440 range of sglang releases the profile was proven on, e.g. ">=0.5.9,<0.5.24".'
    )
    patches: list[str] = Field(
        default_factory=list, description="Ids of the sm120kit patches the profile needs (see `sm120kit patches`)."
    )
    node: Node = Field(default_factory=Node, description="The hardware the profile is meant for.")
    model: Model = Field(default_factory=Model, description="The model to serve.")
    parallel: Parallel = Field(
        default_factory=Parallel, description="Tensor/pipeline/data/expert parallelism and nodes."
    )
    engine: Engine = Field(default_factory=Engine, description="Kernels, caches and memory of the sglang engine.")
    speculative: Speculative = Field(
        default_factory=Speculative,
        description="Speculative decoding, e.g. with the model's own MTP layers (NEXTN); off unless algorithm is set.",
    )
    server: Server = Field(default_factory=Server, description="Where the HTTP server listens, and its API key.")
    env: dict[str, str] = Field(
        default_factory=dict, description='Environment for the server process, e.g. NCCL_P2P_LEVEL = "SYS".'
    )
    health: Health = Field(default_factory=Health, description="Startup budget, liveness probes and restart policy.")
    fleet: Fleet | None = Field(
        None,
        description="Serve several replicas of this server behind sglang's router (server.port and server.host "
        "are the router's); the rest of the profile describes one replica.",
    )
    extra_args: dict[FlagKey, ExtraValue] = Field(
        default_factory=dict,
        description="Other sglang flags, checked against the installed release: "
        '"--flag" = value (true: bare flag; false: omitted).',
    )
    name: SkipJsonSchema[str] = Field("", description="Set by the loader: the profile's name.")
    source: SkipJsonSchema[str] = Field("", description="Set by the loader: the file it was read from.")

    @field_validator("sglang")
    @classmethod
    def _specifier(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ValueError(f'{value!r} is not a PEP 440 version range (e.g. ">=0.5.9,<0.5.24")') from None
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [k for k in value if not ENV_NAME.fullmatch(k)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _fleet_address(self) -> Profile:
        """A fleet's address is its router's: fleet.router's host and port become
        server.host and server.port, where bench, smoke and ps look for the server."""
        f = self.fleet
        if f is None:
            return self
        moved = {k: f.router.pop(k) for k in ("host", "port") if k in f.router}
        if "port" in moved and (type(moved["port"]) is not int or not 1 <= moved["port"] <= 65535):
            raise ValueError(f"fleet.router.port = {moved['port']!r} is not a port (1-65535)")
        if "host" in moved and (not isinstance(moved["host"], str) or not moved["host"]):
            raise ValueError(f"fleet.router.host = {moved['host']!r} is not an address")
        for key, value in moved.items():  # both given (a --set of server.port, say): they must agree
            if key in self.server.model_fields_set and getattr(self.server, key) != value:
                raise ValueError(
                    f"fleet.router.{key} = {value!r} and server.{key} = {getattr(self.server, key)!r}: a fleet's "
                    f"address is its router's; give one of them"
                )
        if moved:
            self.server = Server.model_validate({**self.server.model_dump(), **moved})
        s = self.server
        if not is_loopback(f.replica_host) and not s.api_key_env and not s.allow_public_without_key:
            raise ValueError(
                f"fleet.replica_host = {f.replica_host!r} is a public bind without an API key: set "
                "server.api_key_env (the replicas and the router take the same key), or set "
                "server.allow_public_without_key = true"
            )
        return self

    @field_validator("extra_args")
    @classmethod
    def _flag_names(cls, value: dict[FlagKey, ExtraValue]) -> dict[FlagKey, ExtraValue]:
        bad = [k for k in value if not FLAG_NAME.fullmatch(k)]
        if bad:
            raise ValueError(
                f'{", ".join(map(repr, bad))}: keys must be flags that start with "--", e.g. "--enable-metrics"'
            )
        return value
