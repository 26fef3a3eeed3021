"""doctor's report as text: the checks' table, the fix for each that is not ok, the GPU
peer-to-peer / topology matrix and the verdict, fitted to a width (None: --wide)."""

from __future__ import annotations

from sm120kit import report
from sm120kit.doctor.command import DoctorReport
from sm120kit.node import registry, render
from sm120kit.node.check import Status
from sm120kit.node.nvml_schema import NvmlDocument

SHORT = {
    "internal": "X",
    "single-switch": "PIX",
    "multiple-switches": "PXB",
    "host-bridge": "PHB",
    "numa-node": "NODE",
    "across-sockets": "SYS",
    "unknown": "?",
}
LEGEND = "PIX one PCIe switch, PXB several, PHB host bridge, NODE same NUMA node, SYS across sockets; ! no P2P"
NUMA_LEGEND = "NUMA: each GPU's NUMA node from /sys (? unknown here, - none given)"


def text(doctor_report: DoctorReport, width: int | None) -> str:
    r = doctor_report
    lines = ["sm120kit doctor" + (f" --profile {r.profile}" if r.profile else ""), render.table(r.checks, width)]
    if fixes := render.fixes(r.checks, width):
        lines += ["", "to fix:", *fixes]
    numa = next((c.data.get("numa") for c in r.checks if c.id == "topology" and c.data), None)
    if grid := matrix(r.node.nvml, numa):
        lines += ["", grid, report.wrap(LEGEND, width), *([report.wrap(NUMA_LEGEND, width)] if numa else [])]
    verdict = f"{r.count(Status.FAIL)} failed, {r.count(Status.WARN)} warning(s)"
    if r.can_serve:
        verdict += ": this node can serve" + (f" {r.profile}" if r.profile else "")
        unchecked = [c.id for c in r.checks if c.status is Status.SKIP and c.id in registry.PREFLIGHT]
        if unchecked:  # said, so that "can serve" claims no more than was looked at
            verdict += f" (serve's {', '.join(unchecked)} not checked here)"
    return "\n".join([*lines, "", report.wrap(verdict, width)])


def matrix(nvml: NvmlDocument, numa: dict[int, int | None] | None = None) -> str:
    """nvidia-smi topo style: the common ancestor of each pair; "!" where P2P is not ok; a
    NUMA column with each GPU's NUMA node from /sys ("?" where it is unknown, "-" where the
    kernel gives none) when the topology check read them."""
    gpus, topo, p2p = nvml.gpus, nvml.topology, nvml.p2p
    if len(gpus) < 2 or not topo:
        return ""
    rows = []
    for i, g in enumerate(gpus):
        cells = []
        for j in range(len(gpus)):
            if i == j:
                cells.append("X")
                continue
            pair = p2p[i][j] if i < len(p2p) and j < len(p2p[i]) else None
            cells.append(SHORT.get(topo[i][j] or "unknown", "?") + ("!" if pair and not pair.ok else ""))
        if numa is not None:
            n = numa.get(g.index)
            cells.append("?" if n is None else "-" if n < 0 else str(n))
        rows.append([f"GPU{g.index}", *cells])
    return report.table(["", *(f"GPU{g.index}" for g in gpus), *(["NUMA"] if numa is not None else [])], rows)
