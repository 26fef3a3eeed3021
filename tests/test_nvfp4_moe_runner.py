"""sglang-nvfp4-moe-runner-sm120 on the real code of every release 0.5.9-0.5.23: before/after
source, no-op cases, and the release's own ModelOptNvFp4FusedMoEMethod (__init__,
create_moe_runner, the enable_flashinfer_cutlass_moe switch, apply) compiled from the
(patched) file and run with the GPU capability presented as SM120 (12, 0) and SM100 (10, 0),
in the order FusedMoE runs them: construct, create_moe_runner, then the first forward."""

from __future__ import annotations
import __future__

import ast
import builtins
import enum
import textwrap
import types

import libcst as cst
import pytest
from packaging.version import Version
from support import patch_cases
from support.sites import wheel_bytes

from sm120kit.patching.spec import Outcome

PATCH = patch_cases.shipped_patch("sglang-nvfp4-moe-runner-sm120")
PATH = "sglang/srt/layers/quantization/modelopt_quant.py"
IN_RANGE = patch_cases.releases(PATCH)
BELOW = patch_cases.uncovered(PATCH)
SM120, SM100, SM90 = (12, 0), (10, 0), (9, 0)
MARKER = "# sm120kit: sglang-nvfp4-moe-runner-sm120 r1"


# -- stand-ins for what the method reads from the rest of sglang ---------------------------


class MoeRunnerBackend(enum.Enum):
    """sglang's enum as far as this code uses it: members and is_<value>() predicates."""

    AUTO = "auto"
    TRITON = "triton"
    MARLIN = "marlin"
    CUTLASS = "cutlass"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    FLASHINFER_TRTLLM_ROUTED = "flashinfer_trtllm_routed"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"
    FLASHINFER_CUTEDSL = "flashinfer_cutedsl"
    FLASHINFER_MEGAMOE = "flashinfer_megamoe"

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda: self.value == name[3:]
        raise AttributeError(name)


class Reached(Exception):
    """The first forward got to a kernel: the FlashInfer CUTLASS MoE or sgl-kernel's."""


class _Any:
    """Whatever apply() reads on its way to a kernel (tensors, scales, helpers)."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self


ANY = _Any()
# What apply() imports when it enters a kernel path, and which path that is.
KERNEL_IMPORTS = {"FlashInferCutlassMoeQuantInfo": "flashinfer-cutlass", "cutlass_moe_fp4": "sgl-kernel-cutlass"}


class FusedMoE:
    """The layer after process_weights_after_loading: every weight is there except
    `g1_scale_c`, which only the TRT-LLM weight alignment creates (it never ran: the
    weight switches read the global backend, `auto`). The AttributeError is torch's
    Module.__getattr__ message."""

    _mega_moe_nvfp4 = False
    moe_ep_rank, num_experts, num_local_experts = 0, 8, 8

    def __init__(self, ep_size: int):
        self.moe_ep_size = ep_size

    def __getattr__(self, name):
        if name == "g1_scale_c":
            raise AttributeError(f"'FusedMoE' object has no attribute '{name}'")
        return ANY


class MoeRunner:
    def __init__(self, runner_backend, config):
        self.runner_backend = runner_backend


class _A2A:
    """--moe-a2a-backend none."""

    def __getattr__(self, name):
        return lambda: name == "is_none"


class Release:
    """One release's ModelOptNvFp4FusedMoEMethod, compiled from its (patched) file, on a GPU
    of `capability` with `--moe-runner-backend backend`."""

    MEMBERS = (
        "__init__",
        "create_moe_runner",
        "enable_flashinfer_cutlass_moe",
        "enable_flashinfer_cutedsl_moe",
        "apply",
    )

    def __init__(self, source: bytes, capability: tuple[int, int], backend: str = "auto"):
        self.imports: list[str] = []
        global_backend = MoeRunnerBackend(backend)

        def get_moe_runner_backend():
            return global_backend

        def importer(name, globals=None, locals=None, fromlist=(), level=0):
            if not name.startswith("sglang"):
                return builtins.__import__(name, globals, locals, fromlist, level)
            self.imports.append(name)
            for item in fromlist or ():
                if item in KERNEL_IMPORTS:
                    raise Reached(KERNEL_IMPORTS[item])
            module = dict.fromkeys(fromlist or (), ANY)
            module["get_moe_runner_backend"] = get_moe_runner_backend
            return types.SimpleNamespace(**module)

        def fused_moe(**kwargs):
            raise Reached("flashinfer-cutlass")

        scope = {
            "__builtins__": {**vars(builtins), "__import__": importer},
            # The capability seam: sglang.srt.utils.common, as modelopt_quant imports it.
            "is_cuda": lambda: True,
            "get_device_capability": lambda: capability,
            "is_blackwell_supported": lambda: capability[0] >= 10,
            "get_platform": lambda: types.SimpleNamespace(is_blackwell=capability[0] >= 10),
            "MoeRunnerBackend": MoeRunnerBackend,
            "get_moe_runner_backend": get_moe_runner_backend,
            "get_moe_a2a_backend": _A2A,
            "MoeRunner": MoeRunner,
            "_SUPPORTED_ACT_STRS": ("silu", "relu2", "gelu"),
            "flashinfer_cutlass_fused_moe": fused_moe,
            **dict.fromkeys(("torch", "envs", "ActivationType", "next_power_of_2"), ANY),
        }
        text = source.decode()
        [cls] = [
            n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "ModelOptNvFp4FusedMoEMethod"
        ]
        members = {}
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name in self.MEMBERS:
                code = textwrap.dedent(ast.get_source_segment(text, node, padded=True))
                # The module has `from __future__ import annotations`: its annotations are never evaluated.
                exec(compile(code, PATH, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), scope)
                function = scope.pop(node.name)
                is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
                members[node.name] = property(function) if is_property else function
        self.cls = type("ModelOptNvFp4FusedMoEMethod", (), members)

    def build(self, ep_size: int = 1):
        """What FusedMoE.__init__ does with the method: construct it, create_moe_runner."""
        method = self.cls(types.SimpleNamespace(use_per_token_activation=False))
        layer = FusedMoE(ep_size)
        config = types.SimpleNamespace(activation="silu", apply_router_weight_on_input=False, is_gated=True)
        method.create_moe_runner(layer, config)
        return method, layer

    def first_forward(self, ep_size: int = 1):
        """apply() on the built layer: the kernel path it reaches, or what it raises."""
        method, layer = self.build(ep_size)
        try:
            method.apply(layer, ANY)
        except Reached as reached:
            return str(reached)
        raise AssertionError("apply returned without reaching a kernel")


def chosen(source: bytes, capability, backend: str = "auto", ep_size: int = 1):
    """(the backend create_moe_runner resolved, the runner's backend, the cutlass switch)."""
    method, _ = Release(source, capability, backend).build(ep_size)
    runner = getattr(method, "runner", None)
    return method._moe_runner_backend, runner and runner.runner_backend, method.enable_flashinfer_cutlass_moe


# -- the rewrite ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_rewrites_the_resolution_and_the_switch(version):
    before, after = patch_cases.applied(PATCH, version)
    old, new = before.decode().splitlines(), after.decode().splitlines()
    added = [line.strip() for line in new if line not in old]
    removed = [line.strip() for line in old if line not in new]
    assert removed == ["return get_moe_runner_backend().is_flashinfer_cutlass()"]
    assert added == [
        f"{MARKER}: follow the backend create_moe_runner resolved",
        'return getattr(self, "_moe_runner_backend", get_moe_runner_backend()).is_flashinfer_cutlass()',
        f"{MARKER}: trtllm-gen NVFP4 MoE is SM100-only; SM12x runs the CUTLASS one",
        'if is_cuda() and get_device_capability()[0] == 12 and getattr(layer, "moe_ep_size", None) == 1:',
        "moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS",
    ]
    compile(after, PATH, "exec")


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_second_pass_is_a_no_op(version):
    _, after = patch_cases.applied(PATCH, version)
    patch_cases.assert_second_pass_is_a_no_op(PATCH, version, after)


# -- behaviour: the release's own code, SM120 and SM100 ------------------------------------

T, C, M = MoeRunnerBackend.FLASHINFER_TRTLLM, MoeRunnerBackend.FLASHINFER_CUTLASS, MoeRunnerBackend.MARLIN


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_auto_resolves_to_flashinfer_cutlass_on_sm120_only(version):
    before, after = patch_cases.applied(PATCH, version)
    # Upstream: SM120 gets the SM100-only TRT-LLM runner, and the switch stays off.
    assert chosen(before, SM120)[::2] == (T, False)
    resolved, runner, switch = chosen(after, SM120)
    assert (resolved, switch) == (C, True)
    # 0.5.13-0.5.14 build no MoeRunner for flashinfer_cutlass (apply calls FlashInfer itself).
    assert runner is (None if Version(version) < Version("0.5.15") else C)
    # SM100 keeps TRT-LLM and SM80-SM90 keep Marlin, exactly as upstream chose them.
    for capability, expected in ((SM100, T), ((10, 3), T), (SM90, M), ((8, 9), M)):
        assert chosen(after, capability) == chosen(before, capability)
        assert chosen(after, capability)[::2] == (expected, False)


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_sm120_registers_the_cutlass_fused_func(version):
    """MoeRunner(FLASHINFER_CUTLASS) finds its fused func only once create_moe_runner has
    imported the module that registers it (0.5.15+)."""
    _, after = patch_cases.applied(PATCH, version)
    release = Release(after, SM120)
    release.build()
    imported = "sglang.srt.layers.moe.moe_runner.flashinfer_cutlass" in release.imports
    assert imported is (Version(version) >= Version("0.5.15"))


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_several_ep_ranks_keep_upstreams_choice(version):
    """The token dispatcher reads the global `auto` and remaps expert ids to the local
    rank; the CUTLASS kernel wants global ids, so with EP > 1 the patch stays out."""
    before, after = patch_cases.applied(PATCH, version)
    assert chosen(after, SM120, ep_size=8) == chosen(before, SM120, ep_size=8)
    assert chosen(after, SM120, ep_size=8)[::2] == (T, False)


@pytest.mark.parametrize("version", [IN_RANGE[0], "0.5.20", IN_RANGE[-1]])
@pytest.mark.parametrize(
    "backend", ["flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl", "marlin"]
)
def test_an_explicit_backend_is_left_alone(version, backend):
    before, after = patch_cases.applied(PATCH, version)
    for capability in (SM120, SM100):
        assert chosen(after, capability, backend) == chosen(before, capability, backend)
        assert chosen(after, capability, backend)[0] is MoeRunnerBackend(backend)
        assert chosen(after, capability, backend)[2] is (backend == "flashinfer_cutlass")


def _upstream_first_forward(version: str) -> str:
    if Version(version) < Version("0.5.16"):
        return "sgl-kernel-cutlass"  # falls through to sgl-kernel's cutlass_moe_fp4
    if Version(version) < Version("0.5.21"):
        return (
            "NotImplementedError: Unsupported moe_runner_backend for NVFP4 MoE: MoeRunnerBackend.FLASHINFER_TRTLLM."
            " Use --moe-runner-backend flashinfer_cutlass instead."
        )
    return "AttributeError: 'FusedMoE' object has no attribute 'g1_scale_c'"


def first_forward(source: bytes, capability) -> str:
    """The kernel path the first forward reaches, or the error it dies with."""
    try:
        return Release(source, capability).first_forward()
    except (NotImplementedError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("version", patch_cases.cases(IN_RANGE))
def test_first_forward_on_sm120(version):
    """The symptom, as the release's own apply() produces it, and the fix: the first forward
    on SM120 reaches FlashInfer's CUTLASS MoE. SM100 goes where it went before."""
    before, after = patch_cases.applied(PATCH, version)
    assert first_forward(before, SM120) == _upstream_first_forward(version)
    assert first_forward(after, SM120) == "flashinfer-cutlass"
    assert first_forward(after, SM100) == first_forward(before, SM100)


# -- no-op cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", patch_cases.cases(BELOW))
def test_releases_below_the_range_keep_no_resolved_backend(version):
    """Before 0.5.13 create_moe_runner keeps no resolution for the switch to follow, and the
    NVFP4 apply() dispatches on the global flags alone (auto falls through to sgl-kernel)."""
    assert not PATCH.rewrites_for(version)
    source = wheel_bytes(version, PATH)
    assert b"self._moe_runner_backend" not in source
    assert b"return get_moe_runner_backend().is_flashinfer_cutlass()" in source


def _upstream_fix(source: bytes) -> bytes:
    """0.5.23 as upstream would fix it: a capability-12 branch in the auto resolution, and a
    switch that reads the resolved backend."""
    trtllm = b"                moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM\n"
    edited = source.replace(
        b"            else:\n                # TRTLLM is currently",
        b"            elif is_cuda() and get_device_capability()[0] == 12:\n"
        b"                moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS\n"
        b"            else:\n                # TRTLLM is currently",
    )
    edited = edited.replace(
        b"return get_moe_runner_backend().is_flashinfer_cutlass()",
        b"return self._moe_runner_backend.is_flashinfer_cutlass()",
    )
    assert edited.count(trtllm) == 1 and edited.count(b"FLASHINFER_CUTLASS\n") > source.count(b"FLASHINFER_CUTLASS\n")
    return edited


def test_fixed_upstream_is_detected_from_the_code():
    edited = _upstream_fix(patch_cases.release_file(PATCH, "0.5.23"))
    finding = patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)
    assert "FLASHINFER_CUTLASS" in finding.detail


def test_a_fix_that_moves_the_choice_into_a_helper_is_fixed_upstream():
    source = patch_cases.release_file(PATCH, "0.5.23")
    helper = (
        b"def _resolve_nvfp4_backend(backend):\n"
        b"    if backend.is_auto():\n"
        b"        return MoeRunnerBackend.FLASHINFER_CUTLASS\n"
        b"    return backend\n\n\n"
    )
    start = source.index(b"        if moe_runner_backend.is_auto():\n            if is_cuda() and (8, 0)")
    end = source.index(b"        self._moe_runner_backend = moe_runner_backend\n", start)
    edited = (
        source[:start] + b"        moe_runner_backend = _resolve_nvfp4_backend(moe_runner_backend)\n\n" + source[end:]
    )
    edited = edited.replace(
        b"\nclass ModelOptNvFp4FusedMoEMethod(", b"\n" + helper + b"class ModelOptNvFp4FusedMoEMethod("
    )
    edited = edited.replace(
        b"return get_moe_runner_backend().is_flashinfer_cutlass()",
        b"return self._moe_runner_backend.is_flashinfer_cutlass()",
    )
    patch_cases.assert_fixed_upstream(PATCH, "0.5.23", edited)


def test_a_half_fix_gets_the_other_half():
    """Upstream resolving auto to CUTLASS on SM120 with the switch still global: only the
    switch is rewritten, and SM120 then runs the CUTLASS path."""
    source = patch_cases.release_file(PATCH, "0.5.23")
    resolved_only = _upstream_fix(source).replace(
        b"return self._moe_runner_backend.is_flashinfer_cutlass()",
        b"return get_moe_runner_backend().is_flashinfer_cutlass()",
    )
    assert chosen(resolved_only, SM120)[::2] == (C, False)
    _, after, finding = patch_cases.transform(PATCH, "0.5.23", resolved_only)
    assert finding.outcome is Outcome.WOULD_APPLY
    assert after.count(MARKER.encode()) == 1 and b"follow the backend" in after
    assert chosen(after, SM120)[::2] == (C, True)
    assert Release(after, SM120).first_forward() == "flashinfer-cutlass"


@pytest.mark.parametrize(
    "mutation, reason",
    [
        pytest.param(
            b"                moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM\n",
            b"                moe_runner_backend = _default_fp4_backend()\n",
            id="default renamed",
        ),
        pytest.param(
            b"return get_moe_runner_backend().is_flashinfer_cutlass()",
            b"return get_moe_runner_backend() is MoeRunnerBackend.FLASHINFER_CUTLASS",
            id="switch reshaped",
        ),
        pytest.param(b"def enable_flashinfer_cutlass_moe(", b"def use_flashinfer_cutlass_moe(", id="switch renamed"),
        pytest.param(
            b"        if moe_runner_backend.is_auto():\n            if is_cuda() and (8, 0)",
            b"        if moe_runner_backend is None:\n            if is_cuda() and (8, 0)",
            id="no auto branch",
        ),
    ],
)
def test_unknown_shape_is_anchor_missing(mutation, reason):
    source = patch_cases.release_file(PATCH, "0.5.23")
    assert source.count(mutation) == 1
    edited = source.replace(mutation, reason)
    patch_cases.assert_anchor_missing(PATCH, "0.5.23", edited)


def test_patched_file_parses():
    _, after = patch_cases.applied(PATCH, IN_RANGE[-1])
    cst.parse_module(after)
