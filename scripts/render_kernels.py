#!/usr/bin/env python3
"""Render the kernel table (patches/kernels.toml) as docs/kernels.md.

    python scripts/render_kernels.py            # rewrite docs/kernels.md
    python scripts/render_kernels.py --check    # exit 1 when the page is not the table's

tests/test_kernel_table.py runs the check, so the page never drifts from the data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm120kit.catalogue.kernels import read_table  # noqa: E402

PAGE = ROOT / "docs" / "kernels.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _yes(value: bool) -> str:
    return "runs" if value else "**no build**"


def render() -> str:
    table = read_table()
    lines = [
        "# The kernel table",
        "",
        "Generated from `patches/kernels.toml` by `scripts/render_kernels.py`; edit the table, not this page.",
        "Every kernel family that sglang's selection can dispatch on an SM12x node, the choice that",
        "dispatches it (a *slot* of the resolved launch: [what sglang will run](what-runs.md)), and",
        "whether each release range of the package whose code decides runs it on compute capability",
        "12.0 and 12.1, with the evidence read in that release's wheel. A launch that dispatches a kernel",
        "with no build is refused before the load (`--allow-known-failure ID` overrides).",
        "",
        "| kernel | dispatched by | package releases | 12.0 | 12.1 |",
        "|---|---|---|---|---|",
    ]
    for kernel in table.kernels:
        dispatched = " or ".join(f"`{a}`" for a in kernel.dispatched_by)
        if kernel.when:
            dispatched += " when " + " and ".join(f"`{a}`" for a in kernel.when)
        for i, row in enumerate(kernel.support):
            head = f"`{kernel.id}`: {_cell(kernel.title)}" if i == 0 else ""
            lines.append(
                f"| {head} | {dispatched if i == 0 else ''} | {row.package} `{_cell(row.releases)}` "
                f"| {_yes(row.sm120)} | {_yes(row.sm121)} |"
            )
    lines += ["", "## Evidence", ""]
    for kernel in table.kernels:
        lines += [f"### `{kernel.id}`", ""]
        for row in kernel.support:
            lines.append(f"- {row.package} `{_cell(row.releases)}`: {_cell(row.evidence)}")
        if kernel.upstream:
            lines.append("- upstream: " + " ".join(f"<{u}>" for u in kernel.upstream))
        if kernel.survey:
            lines.append("- accounts for the survey's " + ", ".join(f"`{s}`" for s in kernel.survey))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the table")
    args = parser.parse_args()
    text = render()
    if args.check:
        return 0 if PAGE.is_file() and PAGE.read_text() == text else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
