"""`sm120kit doctor`: every check on one screen, the fix for each that is not ok, and the
GPU peer-to-peer / topology matrix."""

from __future__ import annotations

import os
from pathlib import Path

from sm120kit import report
from sm120kit.doctor import nvml
from sm120kit.doctor.checks import FAIL, OK, Host, run_all
from sm120kit.errors import UserError

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "info"}
SHORT = {
    "internal": "X",
    "single-switch": "PIX",
    "multiple-switches": "PXB",
    "host-bridge": "PHB",
    "numa-node": "NODE",
    "across-sockets": "SYS",
    "unknown": "?",
}


def matrix(doc: dict) -> list[str]:
    """nvidia-smi topo style: the common ancestor of each pair; "!" where P2P is not ok."""
    gpus, topo, p2p = doc.get("gpus", []), doc.get("topology") or [], doc.get("p2p") or []
    if len(gpus) < 2 or not topo:
        return []
    headers = ["", *(f"GPU{g['index']}" for g in gpus)]
    rows = []
    for i, g in enumerate(gpus):
        cells = []
        for j in range(len(gpus)):
            if i == j:
                cells.append("X")
                continue
            pair = p2p[i][j] if i < len(p2p) and j < len(p2p[i]) else None
            blocked = pair is not None and (pair["read"] != "ok" or pair["write"] != "ok")
            cells.append(SHORT.get(topo[i][j] or "unknown", "?") + ("!" if blocked else ""))
        rows.append([f"GPU{g['index']}", *cells])
    legend = "PIX one PCIe switch, PXB several, PHB host bridge, NODE same NUMA node, SYS across sockets; ! no P2P"
    return [report.table(headers, rows), legend]


def doctor(args, profile, target) -> int:
    """Exit 0: nothing failed (warnings allowed); 1: something failed."""
    if args.root and not Path(args.root).is_dir():
        raise UserError(
            f"--root {args.root}: no such directory", "pass a directory that holds proc/ and sys/ copied from the node"
        )
    if args.root and not any((Path(args.root) / part).is_dir() for part in ("proc", "sys")):
        # An empty copy would read as a node without a GPU, an IOMMU or a hypervisor.
        raise UserError(
            f"--root {args.root}: holds neither proc/ nor sys/, so it is no copy of a node",
            "pass a directory that holds proc/ and sys/ copied from the node",
        )
    doc = nvml.load(args.nvml) if args.nvml else nvml.read()
    host = Host(Path(args.root or "/"), dict(os.environ), doc, target)
    results = run_all(host, profile)
    code = int(any(r.status == FAIL for r in results))
    if args.json:
        report.emit_json(
            {
                "profile": profile.name if profile else None,
                "checks": [r.as_json() for r in results],
                "nvml": doc,
                "exit_code": code,
            }
        )
        return code
    title = "sm120kit doctor" + (f" --profile {profile.name}" if profile else "")
    print(title)
    print(report.table(["", "CHECK", "DETAIL"], [[MARK[r.status], r.id, r.detail] for r in results]))
    fixes = [r for r in results if r.status not in (OK, "info") and r.fix]
    if fixes:
        print("\nto fix:")
        for r in fixes:
            print(f"  {r.id}: {r.fix}")
    lines = matrix(doc)
    if lines:
        print("\n" + "\n".join(lines))
    counts = {s: sum(r.status == s for r in results) for s in ("fail", "warn")}
    verdict = f"{counts['fail']} failed, {counts['warn']} warning(s)"
    if not code and host.gpus:
        verdict += ": this node can serve" + (f" {profile.name}" if profile else "")
    print("\n" + verdict)
    return code
