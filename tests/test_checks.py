"""The node's one check framework (sm120kit.node): the registry and the subsets serve,
doctor and bench run, a check's bug, the patch check's two judgements, and what doctor,
`serve --check` and bench print fitted to 100 columns (--wide: one line each)."""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from support.standin import free_port, make_env_python

from sm120kit.bench import render as bench_render
from sm120kit.bench.analysis import Level, compare_rows, verdict
from sm120kit.bench.command import Comparison, SweepResult, compare
from sm120kit.errors import UserError
from sm120kit.node import registry
from sm120kit.node.check import Check, Status
from sm120kit.node.inputs import Processes
from sm120kit.node.snapshot import Snapshot
from sm120kit.profiles.loader import load_profile
from sm120kit.serve import procs
from sm120kit.target import resolve_target

WIDTH = 100
FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
SM120 = json.loads((FIXTURES / "rtx-pro-6000-x8.json").read_text())


def wider_than(text: str, width: int = WIDTH) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width]


def test_every_subset_names_registered_checks():
    for subset in (registry.DOCTOR, registry.PREFLIGHT, registry.ANYWHERE, registry.THIS_NODE, registry.BENCH):
        assert set(subset) <= set(registry.CHECKS) and len(set(subset)) == len(subset)
    assert set(registry.PREFLIGHT) <= set(registry.DOCTOR)  # one judgement: doctor runs every check serve does
    assert set(registry.ANYWHERE) | set(registry.THIS_NODE) == set(registry.PREFLIGHT)
    assert set(registry.BENCH) <= set(registry.DOCTOR)


def test_a_check_that_breaks_fails_without_hiding_the_others(monkeypatch):
    def broken(inputs):
        raise RuntimeError("a bug")

    monkeypatch.setitem(registry.CHECKS, "pcie", broken)
    node = Snapshot(Path("/nonexistent"), {}, lambda: SM120)
    found = {c.id: c for c in registry.run(("pcie", "persistence"), registry.CheckInputs(node))}
    assert found["pcie"].status is Status.FAIL and "RuntimeError: a bug" in found["pcie"].detail
    assert found["persistence"].status is Status.OK  # the next one still ran
    with pytest.raises(RuntimeError, match="a bug"):  # --debug: the traceback, as the fix says
        registry.run(("pcie", "persistence"), registry.CheckInputs(node, debug=True))


def test_the_node_never_imports_serve():
    """serve runs the node's checks; the node gets serve's process scan and run records
    through CheckInputs, so the dependency goes one way."""
    import ast

    import sm120kit.node

    root = Path(sm120kit.node.__file__).parent
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            names += [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) else []
            assert not [m for m in names if m.startswith("sm120kit.serve")], path


def test_serve_procs_is_what_the_process_checks_read():
    """The ports and stale-process checks read the node's processes through a Protocol
    (Processes), not serve's module: the module serve and doctor pass has every member, and
    each takes a call spelled as the Protocol spells it (mypy holds the types, in CI)."""
    assert isinstance(procs, Processes)
    members = [name for name, value in vars(Processes).items() if callable(value) and not name.startswith("_")]
    assert members
    for name in members:
        wanted = list(inspect.signature(getattr(Processes, name)).parameters.values())[1:]  # all but self
        positional = [None for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD]
        keywords = {p.name: None for p in wanted if p.kind is p.KEYWORD_ONLY}
        inspect.signature(getattr(procs, name)).bind(*positional, **keywords)  # a TypeError where they differ


@dataclass(frozen=True)
class Seen:
    """A process as the stale check reads it (a stand-in for serve's procs.Proc)."""

    pid: int
    marker: str | None = None
    orphan: bool = False
    supervisor: int | None = None

    def line(self) -> str:
        return f"pid {self.pid}"


@dataclass
class Stopped:
    left: tuple[Seen, ...] = ()


class NodeStandIn:
    """A node's processes as the checks read them (a stand-in for serve's procs): port 30000
    held by pid 77, and pid 4242, a scheduler of a run that ended here, still there."""

    def __init__(self) -> None:
        self.stopped: set[int] = set()

    def port_in_use(self, host: str, port: int) -> bool:
        return port == 30000

    def port_holder(self, port: int) -> str:
        return "pid 77 'python -m http.server'"

    def scan(self, marker: str | None = None, sglang: bool = False) -> list[Seen]:
        return [Seen(4242, marker="glm5-nvfp4:ended")]

    def ancestors(self, pid: int) -> set[int]:
        return {1}

    def stop(self, pgid: None, tree: None, timeout: float, *, pids) -> Stopped:
        self.stopped |= set(pids)
        return Stopped()


def test_the_process_checks_read_a_stand_in_as_they_read_serve():
    node = NodeStandIn()
    inputs = registry.CheckInputs(
        Snapshot(Path("/"), {}, lambda: SM120),
        load_profile("glm5-nvfp4"),
        processes=node,
        runs=lambda: [{"running": False, "marker": "glm5-nvfp4:ended"}],
    )
    ports, stale = registry.run(("ports", "stale processes"), inputs)
    assert ports.status is Status.FAIL and "30000 (server.port) is held by pid 77" in ports.detail
    assert (stale.status, stale.detail) == (Status.FAIL, "1 found: pid 4242") and node.stopped == set()
    [stale] = registry.run(("stale processes",), replace(inputs, kill_stale=True))
    assert (stale.status, stale.detail, node.stopped) == (Status.OK, "stopped 1: pid 4242", {4242})


def test_a_process_check_without_the_processes_says_whose_bug_that_is():
    """Before: "the check itself failed: AttributeError: 'NoneType' object has no attribute
    'port_in_use'"; now the check says what its command did not give it."""
    inputs = registry.CheckInputs(Snapshot(Path("/"), {}, lambda: SM120), load_profile("glm5-nvfp4"))
    for check in registry.run(("ports", "stale processes"), inputs):
        assert check.status is Status.FAIL, check
        assert "CheckInputs.processes was not given: the command that runs this check must pass it" in check.detail
    with pytest.raises(TypeError, match=r"CheckInputs\.runs was not given"):
        registry.CHECKS["stale processes"](replace(inputs, processes=NodeStandIn()))


def test_bad_input_in_a_check_is_an_error_not_a_finding(monkeypatch):
    def refuses(inputs):
        raise UserError("--allow-missing: unknown patch id 'x'")

    monkeypatch.setitem(registry.CHECKS, "patches", refuses)
    with pytest.raises(UserError):
        registry.run(("patches",), registry.CheckInputs(Snapshot(Path("/"), {}, lambda: SM120)))


def test_skipped_checks_say_by_which_option_and_nvml_is_not_read_for_them():
    def no_nvml():
        raise AssertionError("NVML read for a skipped check")

    node = Snapshot(Path("/"), {}, no_nvml)
    [check] = registry.run(("gpus",), registry.CheckInputs(node), {"gpus": "--no-gpu-check"})
    assert check == Check("gpus", Status.SKIP, "not checked (--no-gpu-check)")


def test_without_nvml_the_driver_check_says_so_once():
    """In doctor's subset the driver check reports a missing NVML and the GPU check defers to
    it; on its own (serve's preflight) the GPU check fails for it."""
    node = Snapshot(Path("/"), {}, lambda: {"error": "no NVIDIA driver: NVML cannot start"})
    profile = load_profile("glm5-nvfp4")
    both = {c.id: c.status for c in registry.run(("driver", "gpus"), registry.CheckInputs(node, profile))}
    assert both == {"driver": Status.FAIL, "gpus": Status.INFO}
    [alone] = registry.run(("gpus",), registry.CheckInputs(node, profile))
    assert alone.status is Status.FAIL and alone.detail.startswith("cannot tell whether the 8 GPUs")


def test_the_gpus_check_counts_what_cuda_visible_devices_leaves():
    node = Snapshot(Path("/"), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, lambda: SM120)
    [check] = registry.run(("gpus",), registry.CheckInputs(node, load_profile("glm5-nvfp4")))
    assert check.status is Status.FAIL
    assert check.detail.startswith("4 GPU(s): 4-7: NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert "of 8 (CUDA_VISIBLE_DEVICES=4,5,6,7) — profile glm5-nvfp4 needs 8 GPUs, 4 visible" in check.detail


def test_the_patch_check_fails_what_a_profile_needs_and_warns_in_a_survey(site):
    from support.sites import install

    install(site, "0.5.23", flashinfer=False)
    node = Snapshot(Path("/"), {}, lambda: SM120, resolve_target(site=str(site)))
    needed = registry.CheckInputs(node, patch_ids=("sglang-dsa-page-table-guard",))
    [check] = registry.run(("patches",), needed)
    assert check.status is Status.FAIL and check.detail == "not in place: sglang-dsa-page-table-guard: would-apply"
    assert check.fix == "run `sm120kit patch --verify`; or `sm120kit serve --no-patch-check` to start anyway"
    [survey] = registry.run(("patches",), registry.CheckInputs(node))
    assert survey.status is Status.WARN and "--no-patch-check" not in survey.fix
    assert {f["patch"] for f in survey.data["findings"]} >= {"sglang-dsa-page-table-guard"}  # bench records these
    [none] = registry.run(("patches",), registry.CheckInputs(node, patch_ids=()))
    assert none == Check("patches", Status.OK, "the profile needs none")


def nvml_file(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(doc))
    return path


def a_troubled_node() -> dict:
    """Every GPU held, one link narrow, no peer-to-peer: the longest details doctor writes."""
    doc = copy.deepcopy(SM120)
    for g in doc["gpus"]:
        g["memory_used_mib"] = 90000
        g["processes"] = {str(4000 + g["index"]): 90000}
    doc["gpus"][3]["pcie"]["width"] = 8
    doc["p2p"] = [
        [None if i == j else {"read": "chipset not supported", "write": "ok"} for j in range(8)] for i in range(8)
    ]
    return doc


@pytest.mark.parametrize("profile", [(), ("--profile", "glm5-nvfp4")])
def test_doctor_fits_100_columns_and_wide_keeps_each_check_on_a_line(cli, tmp_path, monkeypatch, profile):
    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal: 100 columns
    path = nvml_file(tmp_path, a_troubled_node())
    code, out, _ = cli("doctor", "--nvml", path, *profile)
    assert code == 1 and wider_than(out) == [], wider_than(out)
    _, wide, _ = cli("doctor", "--nvml", path, *profile, "--wide")
    [gpu_processes] = [line for line in wide.splitlines() if line.startswith("WARN  gpu processes")]
    assert gpu_processes.endswith("pid 4007 on GPU 7 (90000 MiB)")


def test_serve_check_fits_100_columns(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", "0.5.23")
    argv = [
        "serve",
        "glm5-nvfp4",
        "--python",
        python,
        "--check",
        "--no-gpu-check",
        "--set",
        f"server.port={free_port()}",
    ]
    code, out, _ = cli(*argv)
    assert code == 1 and wider_than(out) == [], wider_than(out)
    assert "  FAIL patches: not in place: sglang-dsa-page-table-guard: would-apply;" in out.splitlines()
    code, wide, _ = cli(*argv, "--wide")
    assert max(len(line) for line in wide.splitlines()) > WIDTH  # nothing wrapped
    code, doc = cli.json(*argv)
    checks = {c["check"]: c["status"] for c in doc["checks"]}
    assert code == 1 and doc["exit_code"] == 1 and checks["patches"] == "fail" and checks["gpus"] == "skip"


def levels(totals: dict[int, float], failed: int = 0) -> list[Level]:
    figures = {
        "total_throughput": 1234567.8,
        "input_throughput": 823456.7,
        "output_throughput": 411234.5,
        "max_output_tokens_per_s": 512345.0,
        "request_throughput": 1234.56,
        "median_ttft_ms": 123456.0,
        "p99_ttft_ms": 234567.0,
        "median_tpot_ms": 1234.5,
        "p99_tpot_ms": 2345.6,
        "median_itl_ms": 1234.5,
        "p99_itl_ms": 2345.6,
    }
    return [Level(c, 3 * c, {**figures, "total_throughput": t, "completed": 3 * c - failed}) for c, t in totals.items()]


def test_bench_tables_fit_100_columns_as_column_groups(tmp_path):
    done = levels({256: 1846.0, 512: 2800.0, 1024: 3740.0, 1000000: 3790.0}, failed=7)
    result = SweepResult(tmp_path, {}, done, verdict(done, max_running=1024))
    text = bench_render.sweep_text(result, WIDTH)
    assert wider_than(text) == [], wider_than(text)
    assert text.count("concurrency  ") == 2  # throughput, then latency
    assert bench_render.sweep_text(result, None).count("concurrency  ") == 1  # --wide: one table
    headers, rows = compare_rows(done, levels({256: 900.0, 512: 950.0}))
    comparison = Comparison((str(tmp_path / "a"), "glm5-nvfp4, before"), (str(tmp_path / "b"), "after"), headers, rows)
    text = bench_render.comparison_text(comparison, WIDTH)
    assert wider_than(text) == [] and text.count("concurrency  ") == 2, text


def test_bench_compare_names_a_folder_that_does_not_exist(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path / 'nope'} does not exist"):
        compare(str(tmp_path / "nope"), str(tmp_path))


def test_a_title_padded_with_spaces_is_trimmed():
    """setproctitle pads argv's memory: with NULs here, with spaces on some systems."""
    assert procs._title(["sglang::scheduler_TP0" + " " * 100, "", ""], "python") == "sglang::scheduler_TP0"
