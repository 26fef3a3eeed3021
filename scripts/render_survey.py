#!/usr/bin/env python3
"""Render the known-failures survey (patches/known-failures.toml) as docs/known-failures.md.

    python scripts/render_survey.py            # rewrite docs/known-failures.md
    python scripts/render_survey.py --check    # exit 1 when the page is not the survey's

tests/test_known_failures.py runs the check, so the page never drifts from the data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sm120kit.catalogue.kernels import read_table
from sm120kit.catalogue.survey import load_survey

PAGE = Path(__file__).resolve().parent.parent / "docs" / "known-failures.md"
ANSWERS = {
    "patch": "patch",
    "rule": "launch rule",
    "compiled": "compiled code: avoid",
    "environment": "the node: doctor",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code; a text with a backtick in it (a log line quoting a flag) between two."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render() -> str:
    survey = load_survey(validate_patches=False)
    lines = [
        "# Known SM120 failures",
        "",
        "Generated from `patches/known-failures.toml` by `scripts/render_survey.py`; edit the survey, not this page.",
        "Every failure of sglang and flashinfer known on SM120 / SM121 (compute capability 12.x), with the",
        "releases whose real code has it (read in the release wheels, through the release named as checked),",
        "its upstream status, and sm120kit's answer: a patch (`sm120kit patch --verify`), a launch rule",
        "(`profile check`, `serve`, `bench` and `doctor` refuse the configuration before the load; ",
        "`--allow-known-failure ID` overrides), or flags that avoid compiled code. `sm120kit known-failures`",
        "prints the same list; `sm120kit diagnose` matches the symptoms.",
        "",
        "| failure | package | affected (checked through) | upstream | status | sm120kit's answer |",
        "|---|---|---|---|---|---|",
    ]
    for f in survey.failures:
        links = " ".join(f"[{_short(u)}]({u})" for u in f.upstream)
        answer = f"patch `{f.patch}`" if f.patch else ANSWERS[f.answer]
        if f.rule and f.answer != "rule":
            answer += " + launch rule"
        if f.avoid:
            answer += f"; avoid: `{_cell(f.avoid)}`"
        lines.append(
            f"| `{f.id}`: {_cell(f.title)} | {f.package} | `{_cell(f.affected)}` ({f.checked}) | {links} "
            f"| {f.status} | {answer} |"
        )
    lines += ["", "## Symptoms and evidence", ""]
    kernels = {}  # survey id -> the kernels of patches/kernels.toml that account for it
    for kernel in read_table().kernels:
        for failure_id in kernel.survey:
            kernels.setdefault(failure_id, []).append(kernel.id)
    for f in survey.failures:
        lines += [f"### `{f.id}`", "", f"- where: {f.evidence}"]
        if f.id in kernels:
            judged = ", ".join(f"`{k}`" for k in kernels[f.id])
            lines.append(
                f"- a selection question: judged on what sglang resolves, by [the kernel table](kernels.md) ({judged})"
            )
        if f.symptom:
            lines.append(f"- log: {_code(f.shown_symptom)}")
        else:
            lines.append("- log: nothing (slow, or wrong output)")
        if f.rule:
            when = "; ".join(c.describe() for c in f.rule.when)
            lines.append(f"- launch rule: refused when {when}; avoid with `--set {' --set '.join(f.rule.avoid)}`")
        lines += [f"- advice: {f.advice}", ""]
    return "\n".join(lines).rstrip() + "\n"


def _short(url: str) -> str:
    parts = url.split("/")
    return f"{parts[4]}#{parts[6]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the survey")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.name} is not the survey's: run python scripts/render_survey.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
