"""The flashinfer-python SM120 patches on the real code of every flashinfer release that
sglang 0.5.9-0.5.23 pins, and of those past the pins (0.7.2.post1, 0.7.4: `pip install -U
flashinfer-python`): before/after source, no-op cases, unknown shapes, and the patched code
executed (arch suffix, nvcc flags) with a faked GPU and toolkit."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import types
import zipfile

import libcst as cst
import pytest
from packaging.version import Version
from support import patch_cases
from support.sites import WINDOW, flashinfer_pin, wheel_bytes

from sm120kit import wheels
from sm120kit.patching.spec import Outcome

# sglang release -> the flashinfer-python it pins (Requires-Dist in the wheel's METADATA).
PINS = {v: flashinfer_pin(v) for v in WINDOW}
# Every flashinfer release the patches are proven on: the pins, then the releases past them.
FLASHINFER_PAST_PINS = wheels.FLASHINFER_PAST_PINS
FLASHINFER = patch_cases.window("flashinfer-python")

PATCHES = {p.id: p for p in patch_cases.shipped_patches("flashinfer-python")}
ARCH = PATCHES["flashinfer-sm120-arch-suffix"]
GEMM = PATCHES["flashinfer-sm120-gemm-gdc"]
MOE = PATCHES["flashinfer-sm120-fused-moe-gdc"]
GDC = "-DCUTLASS_ENABLE_GDC_FOR_SM100=1"
GDC_SM90 = "-DCUTLASS_ENABLE_GDC_FOR_SM90=1"
# The SM120-only functions each GDC patch may change; every other function keeps its AST.
SM120_FUNCTIONS = {
    GEMM.id: {"gen_gemm_sm120_module_cutlass_fp4", "gen_gemm_sm120_module"},
    MOE.id: {"gen_cutlass_fused_moe_sm120_module"},
}


# Each patch's releases below its fix (it applies there) and from its fix on (upstream's
# code has it), selected once here: reading the window may read the sglang wheels' pins.
BUGGY = {p.id: patch_cases.releases(p, fixed=False) for p in PATCHES.values()}
FIXED = {p.id: patch_cases.releases(p, fixed=True) for p in PATCHES.values()}


def buggy(patch) -> list[str]:
    return BUGGY[patch.id]


def fixed(patch) -> list[str]:
    return FIXED[patch.id]


def each_patch(select) -> list:
    """(patch, release) params: each flashinfer patch on each release `select` picks for it."""
    return [
        pytest.param(p, *c.values, id=f"{p.id}-{c.id}") for p in PATCHES.values() for c in patch_cases.cases(select(p))
    ]


def without_markers(source: bytes) -> bytes:
    return b"".join(line for line in source.splitlines(keepends=True) if b"# sm120kit: " not in line)


def functions(source: bytes) -> dict[str, str]:
    """Every top-level function, by name, as an AST dump (formatting-blind)."""
    return {n.name: ast.dump(n) for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}


# -- the pin table and the window ------------------------------------------------------


def test_pins_are_what_the_sglang_wheels_require():
    assert tuple(PINS) == WINDOW
    for sglang, pinned in PINS.items():
        with zipfile.ZipFile(wheels.fetch("sglang", sglang)) as zf:
            metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        [required] = re.findall(r"^Requires-Dist: flashinfer[-_]python(?:\[[^\]]*\])?==(\S+)", metadata, re.M)
        assert required == pinned, sglang


def test_every_pinned_release_is_covered_and_settled():
    """Each patch is proven on every pinned flashinfer and those past the pins: it applies
    below its fix release and finds the fix in the code from it on."""
    for patch in PATCHES.values():
        assert patch.package == "flashinfer-python" and patch.fixed_in
        assert buggy(patch) and fixed(patch), patch.id
        for version in FLASHINFER:
            assert len(patch.rewrites_for(version)) == 1, (patch.id, version)
        assert patch.last_proven == FLASHINFER[-1], patch.id


@pytest.mark.parametrize("version", FLASHINFER_PAST_PINS)
def test_releases_past_the_pins_are_newer_than_every_pin(version):
    """A post-release sorts after its release (PEP 440): `<=0.7.2` left 0.7.2.post1 out."""
    assert Version(version) > max(map(Version, PINS.values()))
    assert wheels.fetch("flashinfer-python", version).name.startswith(f"flashinfer_python-{version}-")


# -- before / after on every release that needs the patch --------------------------------


@pytest.mark.parametrize("patch, version", each_patch(buggy))
def test_rewrites_the_release(patch, version):
    before, after = patch_cases.applied(patch, version)
    compile(after, "patched.py", "exec")
    old, new = before.decode().splitlines(), after.decode().splitlines()
    added = [line for line in new if line not in old]
    removed = [line for line in old if line not in new]
    markers = [line for line in added if f"# sm120kit: {patch.id} r{patch.revision}" in line]
    if patch is ARCH:
        assert not removed and len(markers) == 1
        assert 'if major == 12 and minor == "0a":' in [line.strip() for line in added]
        assert 'minor = "0f"' in [line.strip() for line in added]
    else:
        # Each SM120 function gains a marker and the flag, nothing else; the SM90 define
        # (which breaks SM120 builds) is never added.
        assert len(markers) == len(SM120_FUNCTIONS[patch.id])
        assert all(GDC in line for line in added if line not in markers) and GDC_SM90 not in after.decode()
        assert len(removed) <= 1  # gemm_sm120's `extra_cuda_cflags=nvcc_flags,` is rewritten in place
        changed = {k for k, v in functions(after).items() if functions(before).get(k) != v}
        assert changed == SM120_FUNCTIONS[patch.id]


@pytest.mark.parametrize("patch, version", each_patch(buggy))
def test_second_pass_is_a_no_op(patch, version):
    _, after = patch_cases.applied(patch, version)
    patch_cases.assert_second_pass_is_a_no_op(patch, version, after)


# -- fixed upstream ----------------------------------------------------------------------


@pytest.mark.parametrize("patch, version", each_patch(fixed))
def test_fixed_upstream_is_detected_from_the_code(patch, version):
    finding = patch_cases.assert_fixed_upstream(patch, version)
    assert f"fixed upstream in {patch.fixed_in}" in finding.detail


@pytest.mark.parametrize("patch", [GEMM, MOE], ids=lambda p: p.id)
def test_gdc_fixed_upstream_comes_from_the_code_not_the_version(patch):
    """Upstream's fix has exactly the patched shape; without our marker it is upstream's."""
    version = buggy(patch)[0]
    edited = without_markers(patch_cases.applied(patch, version)[1])
    patch_cases.assert_fixed_upstream(patch, version, edited)


def test_gemm_gdc_completes_a_half_fixed_file():
    """gemm_sm120 already has the flag (no marker): only fp4_gemm_cutlass_sm120 changes."""
    anchor = b"        extra_cuda_cflags=nvcc_flags,\n    )\n\n\ndef gen_trtllm_gen_gemm_module()"
    before = patch_cases.release_file(GEMM, "0.6.3")
    assert before.count(anchor) == 1
    edited = before.replace(anchor, anchor.replace(b"nvcc_flags,", b'nvcc_flags + ["' + GDC.encode() + b'"],'))
    _, after, finding = patch_cases.transform(GEMM, "0.6.3", edited)
    assert finding.outcome is Outcome.WOULD_APPLY
    assert after.decode().count(f"# sm120kit: {GEMM.id}") == 1
    assert after.count(GDC.encode()) == before.count(GDC.encode()) + 2  # the tgv module had it already
    assert {k for k, v in functions(after).items() if functions(edited)[k] != v} == {
        "gen_gemm_sm120_module_cutlass_fp4"
    }
    patch_cases.assert_second_pass_is_a_no_op(GEMM, "0.6.3", after)


# -- unknown shapes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "patch, version, old, new",
    [
        pytest.param(ARCH, "0.6.3", b"if major >= 9:", b"if major >= 8:", id="arch-rule-changed"),
        pytest.param(ARCH, "0.6.3", b"class CompilationContext:", b"class BuildContext:", id="arch-class-renamed"),
        pytest.param(
            ARCH, "0.6.7.post2", b'return (major, "0f")', b'return (major, "0a")', id="arch-normalizer-without-120f"
        ),
        pytest.param(
            GEMM, "0.6.3", b"def gen_gemm_sm120_module()", b"def gen_gemm_sm12x_module()", id="gemm-generator-renamed"
        ),
        pytest.param(
            GEMM, "0.6.3", b'"fp4_gemm_cutlass_sm120",', b'"fp4_gemm_cutlass_sm12x",', id="gemm-module-renamed"
        ),
        pytest.param(
            GEMM,
            "0.6.3",
            b'supported_major_versions=[12]\n    )\n    return gen_jit_spec(\n        "fp4',
            b'supported_major_versions=[10, 12]\n    )\n    return gen_jit_spec(\n        "fp4',
            id="gemm-not-sm12x-only",
        ),
        pytest.param(
            MOE,
            "0.6.3",
            b"def gen_cutlass_fused_moe_sm120_module(",
            b"def gen_cutlass_fused_moe_sm12x_module(",
            id="moe-generator-renamed",
        ),
        pytest.param(
            MOE,
            "0.6.7.post3",
            b"supported_major_versions=[12]",
            b"supported_major_versions=[10, 12]",
            id="moe-not-sm12x-only",
        ),
        pytest.param(
            MOE,
            "0.6.3",
            b'    nvcc_flags = [\n        "-DCOMPILE_BLACKWELL_TMA_GEMMS",\n        "-DCOMPILE_BLACKWELL_SM120',
            b'    flags = [\n        "-DCOMPILE_BLACKWELL_TMA_GEMMS",\n        "-DCOMPILE_BLACKWELL_SM120',
            id="moe-flags-renamed",
        ),
    ],
)
def test_unknown_shape_is_anchor_missing(patch, version, old, new):
    before = patch_cases.release_file(patch, version)
    assert before.count(old) == 1
    edited = before.replace(old, new)
    patch_cases.assert_anchor_missing(patch, version, edited)


# -- the patched code, executed ----------------------------------------------------------


def load_context(source: bytes, monkeypatch, capabilities, cuda):
    """Run compilation_context.py against a fake torch (these GPUs) and a fake toolkit
    (`cuda`: a version string, or an exception that the version query raises)."""

    def at_least(version: str) -> bool:
        if isinstance(cuda, Exception):
            raise cuda
        return Version(cuda) >= Version(version)

    torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            device_count=lambda: len(capabilities), get_device_capability=lambda i: capabilities[i]
        )
    )
    cpp_ext = types.ModuleType("flashinfer.jit.cpp_ext")
    cpp_ext.is_cuda_version_at_least = at_least
    for name, module in (
        ("torch", torch),
        ("flashinfer", types.ModuleType("flashinfer")),
        ("flashinfer.jit", types.ModuleType("flashinfer.jit")),
        ("flashinfer.jit.cpp_ext", cpp_ext),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    scope: dict = {"__name__": "compilation_context"}
    exec(compile(source, "compilation_context.py", "exec"), scope)
    return scope["CompilationContext"]


CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


@pytest.mark.parametrize("cuda", ["12.8", "12.9", "13.0"])
def test_arch_suffix_matches_upstream(cuda, monkeypatch):
    """Patched 0.6.3 targets what the newest proven release targets on every GPU (where
    that one does not refuse the toolkit); unpatched 0.6.3 gives SM 12.0 compute_120a."""
    before, after = patch_cases.applied(ARCH, "0.6.3")
    upstream = load_context(patch_cases.release_file(ARCH, FLASHINFER[-1]), monkeypatch, [], cuda)
    for major, minor in CAPABILITIES:
        old = load_context(before, monkeypatch, [(major, minor)], cuda)().TARGET_CUDA_ARCHS
        new = load_context(after, monkeypatch, [(major, minor)], cuda)().TARGET_CUDA_ARCHS
        try:
            want = upstream._normalize_cuda_arch(major, minor)
        except RuntimeError:  # 0.7.x refuses SM 12.1 below CUDA 12.9; 0.6.3 keeps 121a
            want = (major, f"{minor}a")
        assert new == {want}, (major, minor, cuda)
        if (major, minor) != (12, 0) or cuda == "12.8":
            assert new == old, (major, minor, cuda)  # every other GPU keeps 0.6.3's answer
        else:
            assert old == {(12, "0a")} and new == {(12, "0f")}


def test_arch_suffix_reaches_nvcc_and_survives_an_unknown_toolkit(monkeypatch):
    _, after = patch_cases.applied(ARCH, "0.6.3")
    context = load_context(after, monkeypatch, [(12, 0), (12, 0)], "13.0")()
    flags = context.get_nvcc_flags_list(supported_major_versions=[12])
    assert flags[0] == "-gencode=arch=compute_120f,code=sm_120f" and len(flags) == 3
    with pytest.raises(RuntimeError):  # an SM12x-only module still refuses a non-SM12x GPU
        load_context(after, monkeypatch, [(9, 0)], "13.0")().get_nvcc_flags_list(supported_major_versions=[12])
    # No answer from nvcc or torch: keep upstream's compute_120a, keep the other GPUs.
    context = load_context(after, monkeypatch, [(12, 0), (9, 0)], RuntimeError("nvcc not found"))()
    assert {(12, "0a"), (9, "0a")} == context.TARGET_CUDA_ARCHS


@pytest.mark.parametrize(
    "patch_it, toolkit, workspace", [(True, "13.0", "120f"), (True, "12.8", "120a"), (False, "13.0", "120a")]
)
def test_jit_workspace_of_the_real_modules(patch_it, toolkit, workspace, tmp_path, monkeypatch):
    """Import 0.6.3's real jit/env.py (with its import cycle through cpp_ext, as the patched
    __init__ now has) on a faked SM 12.0 GPU and nvcc: the JIT workspace follows the arch."""
    site = tmp_path / "site"
    files = ["flashinfer/version.py", "flashinfer/_build_meta.py", "flashinfer/jit/env.py", "flashinfer/jit/cpp_ext.py"]
    for relpath in [*files, ARCH.rewrites[0].path]:
        (site / relpath).parent.mkdir(parents=True, exist_ok=True)
        (site / relpath).write_bytes(wheel_bytes("0.6.3", relpath, "flashinfer-python"))
    if patch_it:
        (site / ARCH.rewrites[0].path).write_bytes(patch_cases.applied(ARCH, "0.6.3")[1])
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {toolkit}, V{toolkit}.0'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "home"))
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(device_count=lambda: 1, get_device_capability=lambda i: (12, 0))
    torch.version = types.SimpleNamespace(cuda=toolkit)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "tvm_ffi", types.ModuleType("tvm_ffi"))
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, path in (("flashinfer", site / "flashinfer"), ("flashinfer.jit", site / "flashinfer" / "jit")):
        package = types.ModuleType(name)  # the real packages' __init__ would import all of flashinfer
        package.__path__ = [str(path)]
        monkeypatch.setitem(sys.modules, name, package)
    try:
        import flashinfer.jit.env as env

        assert tmp_path / "home" / ".cache" / "flashinfer" / "0.6.3" / workspace == env.FLASHINFER_WORKSPACE_DIR
        assert env.FLASHINFER_JIT_DIR == env.FLASHINFER_WORKSPACE_DIR / "cached_ops"
    finally:
        for name in [n for n in sys.modules if n.startswith("flashinfer.")]:
            del sys.modules[name]


def extract(source: bytes, name: str) -> str:
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return textwrap.dedent(ast.get_source_segment(source.decode(), node))


GENCODE = "-gencode=arch=compute_120f,code=sm_120f"


def moe_flags(source: bytes) -> list[str]:
    def nvcc_flags(supported_major_versions):
        assert supported_major_versions == [12]
        return [GENCODE]

    scope = {
        "JitSpec": object,
        "current_compilation_context": types.SimpleNamespace(get_nvcc_flags_list=nvcc_flags),
        "gen_cutlass_fused_moe_module": lambda flags, arch, fast: (flags, arch),
    }
    exec(extract(source, "gen_cutlass_fused_moe_sm120_module"), scope)
    flags, arch = scope["gen_cutlass_fused_moe_sm120_module"]()
    assert arch == "120"
    return flags


@pytest.mark.parametrize("version", patch_cases.cases(buggy(MOE)))
def test_fused_moe_module_gets_the_flag(version):
    before, after = patch_cases.applied(MOE, version)
    old, new = moe_flags(before), moe_flags(after)
    assert GDC not in old
    assert new == [*old[:-1], GDC, GENCODE]  # appended to the static flags, before the arch flags
    # The same flag set upstream ships in the first fixed release.
    assert set(new) == set(moe_flags(patch_cases.release_file(MOE, fixed(MOE)[0])))


def jit_cuda_flags(source: bytes, function: str) -> list[str]:
    """The extra_cuda_cflags that `function` hands to gen_jit_spec, with nvcc_flags faked."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function)
    [call] = [n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "gen_jit_spec"]
    [value] = [k.value for k in call.keywords if k.arg == "extra_cuda_cflags"]
    return eval(compile(ast.Expression(value), "flags", "eval"), {"nvcc_flags": [GENCODE]})


@pytest.mark.parametrize("version", patch_cases.cases(buggy(GEMM)))
@pytest.mark.parametrize("function", sorted(SM120_FUNCTIONS[GEMM.id]))
def test_sm120_gemm_modules_get_the_flag(version, function):
    before, after = patch_cases.applied(GEMM, version)
    old, new = jit_cuda_flags(before, function), jit_cuda_flags(after, function)
    assert GDC not in old and new == [*old, GDC]
    assert new == jit_cuda_flags(patch_cases.release_file(GEMM, fixed(GEMM)[0]), function)


# -- what a release found fixed upstream builds (the fixed-upstream outcome's ground truth) --


@pytest.mark.parametrize("version", patch_cases.cases(fixed(ARCH)))
@pytest.mark.parametrize(
    "capability, target",
    [pytest.param((12, 0), (12, "0f"), id="sm120"), pytest.param((10, 0), (10, "0a"), id="sm100")],
)
def test_fixed_releases_target_compute_120f_on_sm120(version, capability, target, monkeypatch):
    """The release's own CompilationContext on a faked GPU and CUDA 13.0: SM 12.0 gets the
    family target the patch gives 0.6.3, SM 10.0 keeps its "a" target."""
    context = load_context(patch_cases.release_file(ARCH, version), monkeypatch, [capability], "13.0")()
    assert {target} == context.TARGET_CUDA_ARCHS


@pytest.mark.parametrize("version", patch_cases.cases(fixed(MOE)))
def test_fixed_releases_build_the_fused_moe_module_with_the_flag(version):
    flags = moe_flags(patch_cases.release_file(MOE, version))
    assert GDC in flags and GDC_SM90 not in flags and flags[-1] == GENCODE


@pytest.mark.parametrize("version", patch_cases.cases(fixed(GEMM)))
@pytest.mark.parametrize("function", sorted(SM120_FUNCTIONS[GEMM.id]))
def test_fixed_releases_build_the_sm120_gemm_modules_with_the_flag(version, function):
    flags = jit_cuda_flags(patch_cases.release_file(GEMM, version), function)
    assert GDC in flags and GDC_SM90 not in flags


# -- through the engine and the CLI ------------------------------------------------------


def test_patch_and_unpatch_an_installed_release(cli, site, tmp_path, monkeypatch):
    """All three through the CLI on an installed 0.6.3; the JIT cache built from the old
    sources (~/.cache/flashinfer/0.6.3/<archs>/, here under a fake home) goes each time."""
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "home"))
    jit = tmp_path / "home" / ".cache" / "flashinfer" / "0.6.3" / "120a" / "cached_ops" / "fused_moe_120"
    other = tmp_path / "home" / ".cache" / "flashinfer" / "0.6.12" / "120f" / "cached_ops" / "fused_moe_120"
    paths = sorted({p.rewrites[0].path for p in PATCHES.values()})
    wheels.install(site, "flashinfer-python", "0.6.3", paths)
    only = [arg for pid in PATCHES for arg in ("--only", pid)]
    code, doc = cli.json("status", "--site", site, *only)
    assert code == 1 and {r["outcome"] for r in doc["results"]} == {"would-apply"}
    for d in (jit, other):
        d.mkdir(parents=True)
        (d / "build.ninja").write_text("stale")
    assert cli("patch", "--site", site, *only)[0] == 0
    assert not jit.parent.parent.exists() and other.exists()
    for path in paths:
        assert (site / path).read_bytes() != wheel_bytes("0.6.3", path, "flashinfer-python")
        compile((site / path).read_bytes(), path, "exec")
    code, doc = cli.json("status", "--site", site, *only)
    assert code == 0 and {r["outcome"] for r in doc["results"]} == {"already-applied"}
    jit.mkdir(parents=True)
    assert cli("unpatch", "--site", site, *only)[0] == 0
    assert not jit.parent.parent.exists() and other.exists()
    for path in paths:
        assert (site / path).read_bytes() == wheel_bytes("0.6.3", path, "flashinfer-python")


def test_patched_files_parse():
    for patch in PATCHES.values():
        for version in buggy(patch):
            cst.parse_module(patch_cases.applied(patch, version)[1])
