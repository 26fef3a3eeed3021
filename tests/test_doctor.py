"""`sm120kit doctor` over fixture nodes: /proc and /sys trees written in the kernel's own
formats, and NVML documents — `h200-recorded.json` recorded on a real H200 by
scripts/doctor_gpu_proof.py, `rtx-pro-6000-x8.json` written from the RTX PRO 6000
Blackwell Server Edition's specifications (8 cards, CC 12.0, 97887 MiB, PCIe Gen5 x16, two
sockets). The seeds' broken states are each one change to the healthy node. Every run
judges the node with a serving environment (`serving`): doctor fails a node that has no
sglang to serve with, as serve refuses it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from support.node import BUS
from support.node import DOCTOR_FIXTURES as FIXTURES
from support.node import SM120_NVML as SM120
from support.node import node_tree as node
from support.sites import install

from sm120kit.cli import main


@pytest.fixture(autouse=True)
def quiet_env(monkeypatch, tmp_path):
    """No CUDA/NCCL variables from the shell, and a Hugging Face cache that holds GLM-5."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_P2P_LEVEL", "NCCL_IB_DISABLE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "hf" / "hub" / "models--lukealonso--GLM-5-NVFP4" / "snapshots").mkdir(parents=True)


SERVING: dict[str, Path] = {}  # "site": the serving environment each run judges (set by `serving`)


@pytest.fixture(scope="module", autouse=True)
def serving(tmp_path_factory, session_cache) -> Path:
    """sglang 0.5.23 and the flashinfer it pins, their patches applied, as --site: the node's
    checks are the subject here, the environment only has to be one that serves. Made before
    each test's own caches are set: the run's shared cache, never the user's."""
    site = tmp_path_factory.mktemp("serving") / "site-packages"
    site.mkdir()
    install(site, "0.5.23")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SM120KIT_CACHE_DIR", str(session_cache))
        env.setenv("SM120KIT_NO_OUTCOME_SEED", "1")
        env.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path_factory.mktemp("flashinfer-home")))
        assert main(["patch", "--site", str(site)]) == 0
    SERVING["site"] = site
    return site


def run(cli, tmp_path, doc: dict, tree: Path, *extra) -> tuple[int, dict]:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(doc))
    return cli.json("doctor", "--nvml", path, "--root", tree, "--site", SERVING["site"], *extra)


def checks(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"]}


def test_a_healthy_sm120_node_can_serve_glm5(cli, tmp_path):
    code, out = run(cli, tmp_path, SM120, node(tmp_path / "root"), "--profile", "glm5-nvfp4")
    c = checks(out)
    assert code == 0, [x for x in out["checks"] if x["status"] == "fail"]
    assert c["gpus"]["status"] == "ok" and c["gpus"]["detail"] == (
        "8 GPU(s): 0-7: NVIDIA RTX PRO 6000 Blackwell Server Edition (CC 12.0, 95 GiB) — meets profile glm5-nvfp4"
    )
    assert c["driver"]["detail"] == "driver 580.95.05, CUDA 13.0"
    assert c["p2p"]["status"] == "ok" and c["iommu"]["status"] == "ok" and c["nvidia_uvm hmm"]["status"] == "ok"
    assert (
        c["topology"]["status"] == "ok" and "NUMA 0: GPU 0-3; 1: GPU 4-7" in c["topology"]["detail"]
    )  # the profile sets NCCL_P2P_LEVEL=SYS
    assert c["/dev/shm"]["status"] == "ok" and c["limits"]["status"] == "ok" and c["pcie"]["status"] == "ok"
    assert c["virtualisation"]["detail"] == "bare metal, no container"


def test_two_sockets_without_the_nccl_setting_warn(cli, tmp_path):
    code, out = run(cli, tmp_path, SM120, node(tmp_path / "root"))
    t = checks(out)["topology"]
    assert (
        code == 0
        and t["status"] == "warn"
        and "NCCL_P2P_LEVEL is unset" in t["detail"]
        and "NCCL_P2P_LEVEL=SYS" in t["fix"]
    )


def broken(name: str, tree: dict, doc=None):
    return pytest.param(tree, doc, id=name)


def x8(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["gpus"][3]["pcie"]["width"] = 8
    return doc


def p2p_blocked(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["p2p"] = [
        [None if i == j else {"read": "chipset not supported", "write": "chipset not supported"} for j in range(8)]
        for i in range(8)
    ]
    doc["topology"] = [[None if i == j else "host-bridge" for j in range(8)] for i in range(8)]
    return doc


@pytest.mark.parametrize(
    "tree, doc, check, status, words, fix",
    [
        ({"hmm": "N"}, None, "nvidia_uvm hmm", "warn", "HMM is on", "uvm_disable_hmm=1"),
        (
            {"vendor": "QEMU", "product": "Standard PC (Q35 + ICH9, 2009)", "hypervisor": True},
            p2p_blocked,
            "p2p",
            "fail",
            "28 GPU pair(s) without P2P (chipset not supported)",
            "LXC container",
        ),
        (
            {"cmdline": "BOOT_IMAGE=/vmlinuz-6.8.0-49-generic ro amd_iommu=on"},
            None,
            "iommu",
            "fail",
            "without iommu=pt",
            "GRUB_CMDLINE_LINUX",
        ),
        (
            {"shm": "shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size=65536k 0 0", "docker": True},
            None,
            "/dev/shm",
            "fail",
            "64 MiB",
            "--shm-size",
        ),
        ({}, x8, "pcie", "warn", "GPU 3 at x8 of x16", "full-width slot"),
        ({"nofile": "1024", "memlock": "8388608"}, None, "limits", "warn", "open files 1024", "LimitMEMLOCK=infinity"),
    ],
)
def test_the_broken_states_of_the_field_report(cli, tmp_path, tree, doc, check, status, words, fix):
    code, out = run(
        cli, tmp_path, doc(SM120) if doc else SM120, node(tmp_path / "root", **tree), "--profile", "glm5-nvfp4"
    )
    c = checks(out)[check]
    assert (c["status"], words in c["detail"], fix in c["fix"]) == (status, True, True), c
    assert code == (1 if status == "fail" else 0)
    others = [x["check"] for x in out["checks"] if x["status"] == "fail" and x["check"] != check]
    assert others == []  # one broken thing is reported once, not as a cascade


def test_virtualisation_and_containers_are_named(cli, tmp_path):
    _, out = run(cli, tmp_path, SM120, node(tmp_path / "root", vendor="QEMU", hypervisor=True, docker=True))
    assert checks(out)["virtualisation"]["detail"] == "virtual machine (QEMU), in a docker container"


def test_no_driver_is_a_clear_answer(cli, tmp_path):
    doc = {"error": "no NVIDIA driver: NVML cannot start (NVML Shared Library Not Found)"}
    code, out = run(cli, tmp_path, doc, node(tmp_path / "root"), "--profile", "glm5-nvfp4")
    c = checks(out)
    assert code == 1 and c["driver"]["status"] == "fail" and c["driver"]["detail"].startswith("no NVIDIA driver")
    assert "install the NVIDIA driver" in c["driver"]["fix"] and c["gpus"]["status"] == "info"


def test_a_check_that_crashes_fails_and_shows_its_traceback_with_debug(cli, tmp_path, monkeypatch):
    from sm120kit.node import registry

    def broken(inputs):
        raise RuntimeError("a bug")

    monkeypatch.setitem(registry.CHECKS, "pcie", broken)
    code, out = run(cli, tmp_path, SM120, node(tmp_path / "root"))
    pcie = checks(out)["pcie"]
    assert code == 1 and pcie["status"] == "fail" and "RuntimeError: a bug" in pcie["detail"]
    assert "--debug" in pcie["fix"]
    with pytest.raises(RuntimeError, match="a bug"):  # the CLI lets --debug's traceback through
        run(cli, tmp_path, SM120, node(tmp_path / "root"), "--debug")


def test_the_recorded_h200_is_not_an_sm120_node(cli, tmp_path):
    doc = json.loads((FIXTURES / "h200-recorded.json").read_text())
    code, out = run(cli, tmp_path, doc, node(tmp_path / "root"), "--profile", "glm5-nvfp4")
    g = checks(out)["gpus"]
    assert code == 1 and g["status"] == "fail"
    assert g["detail"] == (
        "1 GPU(s): 0: NVIDIA H200 (CC 9.0, 140 GiB) — profile glm5-nvfp4 needs 8 GPUs, 1 found; "
        "profile glm5-nvfp4 is for compute capability 12.0 (SM120); GPU 0 is not"
    )
    code, out = run(cli, tmp_path, doc, node(tmp_path / "root2"))  # without a profile: a warning, not a failure
    g = checks(out)["gpus"]
    assert code == 0 and g["status"] == "warn" and "GPU 0 is not SM120 (compute capability 12.x)" in g["detail"]
    assert "sm120kit's patches and profiles target SM120" in g["detail"] and "SM120 node" in g["fix"]


def test_an_sm120_node_without_a_profile_is_ok(cli, tmp_path):
    code, out = run(cli, tmp_path, SM120, node(tmp_path / "root"))
    assert code == 0 and checks(out)["gpus"]["status"] == "ok"


def test_numa_nodes_unknown_here_are_said_so_never_grouped(cli, tmp_path):
    """--nvml of another node without --root of its /sys: no numa_node for the GPUs here,
    so no "groups" and no socket warning, though NVML's matrix says SYS; the matrix's NUMA
    column shows "?"."""
    tree = node(tmp_path / "root")
    for b in BUS:
        (tree / f"sys/bus/pci/devices/0000:{b}:00.0/numa_node").unlink()
    code, out = run(cli, tmp_path, SM120, tree)
    t = checks(out)["topology"]
    assert code == 0 and t["status"] == "info", t
    assert t["detail"].startswith("the NUMA node of each GPU is unknown here (no /sys/bus/pci/devices/")
    assert "--root" in t["detail"] and "groups" not in t["detail"] and "socket" not in t["detail"]
    path = tmp_path / "nvml.json"
    code, text, _ = cli("doctor", "--nvml", path, "--root", tree, "--site", SERVING["site"], "--wide")
    header = next(line for line in text.splitlines() if line.lstrip().startswith("GPU0"))
    assert header.split()[-1] == "NUMA" and all(
        line.split()[-1] == "?" for line in text.splitlines() if line.startswith("GPU") and "X" in line.split()
    )


def test_one_known_numa_node_does_not_warn_about_sockets(cli, tmp_path):
    tree = node(tmp_path / "root")
    for b in BUS:
        (tree / f"sys/bus/pci/devices/0000:{b}:00.0/numa_node").write_text("0\n")
    _, out = run(cli, tmp_path, SM120, tree)
    t = checks(out)["topology"]
    assert t["status"] == "ok" and t["detail"] == "NUMA 0: GPU 0-7"
    tree2 = node(tmp_path / "root2")  # the first four known, the rest not: no groups claimed either
    for b in BUS[4:]:
        (tree2 / f"sys/bus/pci/devices/0000:{b}:00.0/numa_node").unlink()
    t = checks(run(cli, tmp_path, SM120, tree2)[1])["topology"]
    assert t["status"] == "ok" and t["detail"] == "NUMA 0: GPU 0-3; unknown: GPU 4-7"


def test_gpu_processes_and_visible_devices(cli, tmp_path, monkeypatch):
    doc = copy.deepcopy(SM120)
    doc["gpus"][2]["processes"] = {"4242": 90112}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,9")
    code, out = run(cli, tmp_path, doc, node(tmp_path / "root"))
    c = checks(out)
    assert c["gpu processes"]["detail"] == "memory already held: pid 4242 on GPU 2 (90112 MiB)"
    assert (
        code == 1
        and c["environment"]["status"] == "fail"
        and "CUDA_VISIBLE_DEVICES=0,1,9 names a GPU NVML does not have" in c["environment"]["detail"]
    )


def test_one_screen(cli, tmp_path):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(p2p_blocked(SM120)))
    tree = node(tmp_path / "root", hmm="N")
    code, out, err = cli("doctor", "--nvml", path, "--root", tree, "--site", SERVING["site"], "--profile", "glm5-nvfp4")
    assert code == 1 and not err
    lines = out.splitlines()
    assert lines[0] == "sm120kit doctor --profile glm5-nvfp4"
    assert any(line.startswith("FAIL  p2p") for line in lines) and any(
        line.startswith("WARN  nvidia_uvm hmm") for line in lines
    )
    assert "to fix:" in out and "  p2p: GPU peer-to-peer does not pass" not in out  # bare metal here: the BIOS fix
    assert "  p2p: disable ACS in the BIOS" in out
    assert "GPU0  X     PHB!" in out and "! no P2P" in out
    warnings = sum(line.startswith("WARN") for line in lines)
    assert lines[-1] == f"1 failed, {warnings} warning(s)"


def flat(cli, *args) -> tuple[int, str, str]:
    """The command's exit code, output and error, with the error's wrapping undone."""
    code, out, err = cli(*args)
    return code, out, " ".join(err.split())


def test_bad_input(cli, tmp_path):
    code, _, err = flat(cli, "doctor", "--profile", "glm5-nvfpx")
    assert code == 2 and "glm5-nvfp4" in err
    code, _, err = flat(cli, "doctor", "--nvml", tmp_path / "missing.json")
    assert code == 2 and "cannot read an NVML document" in err and "Traceback" not in err
    (tmp_path / "other.json").write_text('{"checks": []}')
    code, _, err = flat(cli, "doctor", "--nvml", tmp_path / "other.json")
    assert code == 2 and "not an NVML document" in err
    code, _, err = flat(cli, "doctor", "--root", tmp_path / "nope")
    assert code == 2 and "no such directory" in err
    (tmp_path / "empty").mkdir()
    code, out, err = flat(cli, "doctor", "--root", tmp_path / "empty")  # it once read as "bare metal"
    assert code == 2 and "holds neither proc/ nor sys/, so it is no copy of a node" in err and not out


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: d.update(gpus="x"), "gpus: Input should be a valid list"),
        (
            lambda d: d["gpus"][0].update(memory_total_mib="97887"),
            "gpus.0.memory_total_mib: Input should be a valid integer",
        ),
        (
            lambda d: d["gpus"][0].update(compute_capability=12.0),
            "gpus.0.compute_capability: Input should be a valid string",
        ),
        (lambda d: d["gpus"][1].update(processes=[123]), "gpus.1.processes: Input should be a valid dictionary"),
        (lambda d: d.update(p2p=[[None, {"read": "ok"}]]), "p2p.0.1.write: Field required"),
    ],
)
def test_an_nvml_document_with_wrong_types_is_refused(cli, tmp_path, damage, says):
    """It once failed half the checks inside and still said "this node can serve"."""
    doc = json.loads(json.dumps(SM120))
    damage(doc)
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    code, out, err = flat(cli, "doctor", "--nvml", tmp_path / "bad.json", "--root", node(tmp_path / "root"))
    assert code == 2 and "not an NVML document as `doctor --json` writes it" in err and says in err and not out


def test_a_doctor_json_document_replays(cli, tmp_path):
    """`doctor --json` on one node, `--nvml` of that file on another: the same GPU answers."""
    _, first = run(cli, tmp_path, SM120, node(tmp_path / "root"))
    (tmp_path / "sent.json").write_text(json.dumps(first))
    _code, again = cli.json(
        "doctor", "--nvml", tmp_path / "sent.json", "--root", tmp_path / "root", "--site", SERVING["site"]
    )
    assert again["nvml"] == SM120 and checks(again)["gpus"] == checks(first)["gpus"]


def test_the_model_on_disk_or_the_space_for_it(cli, tmp_path):
    tree = node(tmp_path / "root")
    _, out = run(cli, tmp_path, SM120, tree, "--profile", "glm5-nvfp4")
    assert (
        checks(out)["disk"]["status"] == "ok"
        and "model lukealonso/GLM-5-NVFP4 present" in checks(out)["disk"]["detail"]
    )
    code, out = run(
        cli,
        tmp_path,
        SM120,
        tree,
        "--profile",
        "glm5-nvfp4",
        "--set",
        "model.path=org/not-here",
        "--set",
        "model.size_gb=999999999",
    )
    d = checks(out)["disk"]
    assert (
        code == 1
        and d["status"] == "fail"
        and "the model needs 999999999 GB" in d["detail"]
        and "huggingface-cli download org/not-here" in d["fix"]
    )
    code, out = run(
        cli,
        tmp_path,
        SM120,
        tree,
        "--profile",
        "glm5-nvfp4",
        "--set",
        "model.path=org/not-here",
        "--set",
        "model.size_gb=1",
    )
    assert code == 0 and checks(out)["disk"]["status"] == "info"


@pytest.mark.parametrize(
    "variable, hub",
    [("HUGGINGFACE_HUB_CACHE", "old-spelling"), ("XDG_CACHE_HOME", "xdg/huggingface/hub")],
)
def test_the_model_is_looked_for_where_huggingface_hub_keeps_it(cli, tmp_path, monkeypatch, variable, hub):
    """The hub cache as huggingface_hub resolves it: its older variable, and XDG_CACHE_HOME
    when no HF_HOME is set (a model there is present, not "not downloaded yet")."""
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv(variable, str(tmp_path / hub.split("/")[0]))
    (tmp_path / hub / "models--lukealonso--GLM-5-NVFP4" / "snapshots").mkdir(parents=True)
    _, out = run(cli, tmp_path, SM120, node(tmp_path / "root"), "--profile", "glm5-nvfp4")
    d = checks(out)["disk"]
    assert d["status"] == "ok" and f"present at {tmp_path / hub / 'models--lukealonso--GLM-5-NVFP4'}" in d["detail"], d


def test_a_kernel_that_defaults_to_passthrough_needs_no_flag(cli, tmp_path):
    tree = node(tmp_path / "root", cmdline="BOOT_IMAGE=/vmlinuz-6.8.0-49-generic ro", iommu_type="identity")
    _, out = run(cli, tmp_path, SM120, tree)
    assert checks(out)["iommu"] == {
        "check": "iommu",
        "status": "ok",
        "detail": "IOMMU on, every group in passthrough (identity) domains",
        "fix": "",
    }
