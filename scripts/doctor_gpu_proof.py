"""On a machine with NVIDIA GPUs: does `sm120kit doctor` tell the truth about them?

Runs `sm120kit doctor --json` and `sm120kit doctor --profile glm5-nvfp4 --json`, and
compares what the doctor read through NVML with what `nvidia-smi` says on its own (count,
names, memory, compute capability, driver, persistence mode, PCIe link). On a GPU that is
not SM120 the profile run must fail the `gpus` check. Writes the NVML document to
--record FILE (a real recording for tests: `sm120kit doctor --nvml FILE` replays it).

    python scripts/doctor_gpu_proof.py [--record nvml.json]

Exit 0 when every figure agrees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

FIELDS = "index,name,memory.total,compute_cap,driver_version,persistence_mode,pcie.link.width.max,pcie.link.gen.max"


def doctor(*extra: str) -> tuple[int, dict, float]:
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sm120kit", "doctor", "--json", *extra], capture_output=True, text=True
    )
    return proc.returncode, json.loads(proc.stdout), time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", metavar="FILE")
    args = parser.parse_args()
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    truth = [dict(zip(FIELDS.split(","), (v.strip() for v in line.split(",")))) for line in smi.strip().splitlines()]
    code, doc, seconds = doctor()
    nv = doc["nvml"]
    problems = []
    if len(nv["gpus"]) != len(truth):
        problems.append(f"count: doctor {len(nv['gpus'])}, nvidia-smi {len(truth)}")
    for g, t in zip(nv["gpus"], truth):
        pairs = [
            ("name", g["name"], t["name"]),
            ("memory MiB", str(g["memory_total_mib"]), t["memory.total"]),
            ("compute capability", g["compute_capability"], t["compute_cap"]),
            ("driver", nv["driver_version"], t["driver_version"]),
            ("persistence", "Enabled" if g["persistence_mode"] else "Disabled", t["persistence_mode"]),
            ("pcie max width", str(g["pcie"]["max_width"]), t["pcie.link.width.max"]),
            ("pcie max gen", str(g["pcie"]["max_gen"]), t["pcie.link.gen.max"]),
        ]
        problems += [f"GPU {g['index']} {what}: doctor {a!r}, nvidia-smi {b!r}" for what, a, b in pairs if a != b]
    pcode, pdoc, _ = doctor("--profile", "glm5-nvfp4")
    gpus_check = next(c for c in pdoc["checks"] if c["check"] == "gpus")
    not_sm120 = all(g["compute_capability"] != "12.0" for g in nv["gpus"])
    if not_sm120 and (pcode != 1 or gpus_check["status"] != "fail"):
        problems.append(f"--profile glm5-nvfp4 on a non-SM120 GPU: exit {pcode}, gpus check {gpus_check['status']}")
    if args.record:
        with open(args.record, "w") as fh:
            json.dump(nv, fh, indent=2)
    print(
        json.dumps(
            {
                "doctor_exit": code,
                "doctor_seconds": round(seconds, 2),
                "checks": {c["check"]: [c["status"], c["detail"]] for c in doc["checks"]},
                "profile_exit": pcode,
                "profile_gpus_check": gpus_check,
                "nvidia_smi": truth,
                "problems": problems,
            },
            indent=2,
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
