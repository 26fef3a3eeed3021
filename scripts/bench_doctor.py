"""How long `sm120kit doctor` takes, as an operator runs it (a new process each time).

    python scripts/bench_doctor.py [--runs 7] [-- extra doctor args, e.g. --profile glm5-nvfp4]

Prints the median and the range of the wall time. Target: under 2 s on a GPU node.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    runs = 7
    if args[:1] == ["--runs"]:
        runs, args = int(args[1]), args[2:]
    extra = args[1:] if args[:1] == ["--"] else args
    times = []
    for _ in range(runs):
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "sm120kit", "doctor", "--json", *extra], capture_output=True, check=False)
        times.append(time.monotonic() - began)
    print(
        f"sm120kit doctor {' '.join(extra)}: median {statistics.median(times):.3f} s, "
        f"min {min(times):.3f} s, max {max(times):.3f} s over {runs} runs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
