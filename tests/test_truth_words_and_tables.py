"""Issue 31, item 14: the words and the tables tell the truth. The docs' claims checked
against what the code does (the exit code of a known failure, the time `sm120kit try`
takes, the license the docs site links to); the tables of the real renderers at 60 and 100
columns, a word broken only at its hyphens and only where the table cannot fit otherwise;
`try` cutting a command's output only between items; `--only` with a typo; `ps` on a
record it cannot read; `profile show --json`'s help."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from support.paths import ROOT
from support.sites import WINDOW, install

from sm120kit import report, wheels
from sm120kit.cli import build_parser
from sm120kit.patching.registry import load_patches

BREAKS = ("-", "/", ",", "–")  # where a word may break in a table cell


# -- tables ----------------------------------------------------------------------------------


def table_cells(text: str, headers: list[str], ids: list[str]) -> list[list[list[str]]]:
    """The cells of a fitted table, each as the pieces it was broken into, row by row: one
    row per id (its first column), in order. A line indented less than the second column is
    a note under its row, not a cell."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if all(h in line for h in headers))
    starts = [lines[top].index(h) for h in headers]
    rows: list[list[list[str]]] = []
    for line in lines[top + 1 :]:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or 0 < indent < starts[1]:
            continue
        if indent == 0 and (not rows or _joined(rows[-1][0]) == ids[len(rows) - 1]):
            if len(rows) == len(ids):
                break  # past the table: what follows it
            rows.append([[] for _ in headers])
        for column, (a, b) in enumerate(zip(starts, [*starts[1:], None])):
            if piece := line[a:b].strip():
                rows[-1][column].append(piece)
    return rows


def _joined(pieces: list[str]) -> str:
    """A cell's pieces as one text: a piece broken at a break mark joins the next directly,
    one broken at a space with a space."""
    text = ""
    for piece in pieces:
        text += ("" if not text or text.endswith(BREAKS) else " ") + piece
    return text


def fitted(cli, width: int, *argv) -> tuple[int, str, str]:
    with report.fitted_to(width):
        return cli(*argv)


def test_status_at_60_columns_shrinks_every_column_and_breaks_words_only_at_hyphens(cli, site):
    """HEAD: PATCH stays 40 wide, the lines run past 60, and `flashinfer-python` is
    `flashinf` / `er-` / `python`."""
    install(site, WINDOW[-1])
    _, doc = cli.json("status", "--site", site)
    code, out, _ = fitted(cli, 60, "status", "--site", site)
    assert code == 1
    headers = ["PATCH", "PACKAGE", "VERSION", "OUTCOME", "FIXED IN"]
    results = doc["results"]
    rows = table_cells(out, headers, [r["patch"] for r in results])
    assert len(rows) == len(results)
    for row, result in zip(rows, results):  # every cell whole again when its pieces are joined
        expected = [result["patch"], result["package"], result["version"], result["outcome"]]
        assert [_joined(pieces) for pieces in row[:4]] == expected, row
    table_lines = [line for line in out.splitlines() if not line.startswith("  ")]  # notes: prose
    assert max(map(len, table_lines)) <= 60, "\n".join(line for line in table_lines if len(line) > 60)
    assert {tuple(row[1]) for row in rows} == {("sglang",), ("flashinfer-", "python")}


def test_status_without_sglang_at_100_columns_keeps_the_package_whole(cli, site):
    """HEAD: the rows of an uninstalled sglang's patches name every release that fixed a
    part (`0.5.9, 0.5.14, open`) and `flashinfer-python` gave up its width for them."""
    install(site, WINDOW[-1])
    wheels.uninstall(site, "sglang")
    _, doc = cli.json("status", "--site", site)
    _, out, _ = fitted(cli, 100, "status", "--site", site)
    headers = ["PATCH", "PACKAGE", "VERSION", "OUTCOME", "FIXED IN"]
    rows = table_cells(out, headers, [r["patch"] for r in doc["results"]])
    assert {tuple(row[1]) for row in rows} == {("sglang",), ("flashinfer-python",)}, out
    assert any(len(row[4]) > 1 for row in rows), out  # the releases wrapped at their spaces instead
    assert max(len(line) for line in out.splitlines() if not line.startswith("  ")) <= 100


def test_known_failures_at_60_columns_break_only_at_break_marks(cli):
    """HEAD: `flashinf` / `er-` / `python`, and `>=0.5.20` / `,<0.5.21`."""
    _, doc = cli.json("known-failures")
    code, out, _ = fitted(cli, 60, "known-failures")
    assert code == 0
    failures = doc["failures"]
    rows = table_cells(out, ["FAILURE", "PACKAGE", "AFFECTED", "FIXED IN"], [f["id"] for f in failures])
    assert len(rows) == len(failures)
    for row, f in zip(rows, failures):
        assert [_joined(pieces) for pieces in row] == [f["id"], f["package"], f["affected"], f.get("fixed_in", "open")]
    assert max(len(line) for line in out.splitlines() if not line.startswith("  ")) <= 60


def test_try_cuts_a_commands_output_only_between_items(cli):
    """At 60 columns. HEAD: the commands' lines cut at the width (`0.5.2…`, a version short
    of its digit) and a row shown without the note under it before `… N more lines`."""
    ids = {p.id for p in load_patches()}
    scratch = Path(tempfile.mkdtemp(prefix="try-", dir="/tmp"))  # short: a path is never broken
    try:
        _, out, err = fitted(cli, 60, "try", "--dir", scratch)
    finally:
        scratch.rmdir()
    assert "$ sm120kit unpatch" in out, out + err  # the cycle ran to its end
    assert not [line for line in out.splitlines() if re.search(r"\S…$", line)]  # no line cut short
    blocks = re.split(r"\n(?=\$ |# in place of)", out.split("\nsm120kit try: the cycle", 1)[0])
    trimmed = [b.splitlines()[1:] for b in blocks if re.search(r"^    … \d+ more lines$", b, re.M)]
    assert trimmed  # status and patch --verify print more than a screen
    for lines in trimmed:
        shown = lines[: next(i for i, line in enumerate(lines) if line.startswith("    … "))]
        # a table's row: an id, whole or broken after its hyphens, at the outermost indent
        rows = [i for i, line in enumerate(shown) if re.match(r"    (sglang|flashinfer)-\S*\s+\S", line)]
        for i in rows:
            first = [shown[i].split()[0]]
            for line in shown[i + 1 :]:  # the id's other pieces, then its note (indented 6)
                if not line.startswith("    ") or line.startswith("     "):
                    break
                first.append(line.split()[0])
            assert "".join(first) in ids, first
            below = shown[i + 1 : [*rows, len(shown)][rows.index(i) + 1]]
            assert any(line.startswith("      ") and "/" in line for line in below), (shown[i], "its note is cut")


# -- words -----------------------------------------------------------------------------------


def test_only_with_a_typo_names_the_nearest_patch_id(cli, tmp_path):
    code, out, err = cli("status", "--site", tmp_path, "--only", "sglang-dsa-kpool-sm12")
    assert code == 2 and not out and "Traceback" not in err
    assert "--only: unknown patch id 'sglang-dsa-kpool-sm12' (nearest: sglang-dsa-kpool-sm120)" in err
    assert "next: run `sm120kit patches` to list them" in err
    code, _, err = cli("status", "--site", tmp_path, "--only", "zzz")  # nothing near: every id
    assert code == 2 and "unknown patch id 'zzz'; known: " in err and "sglang-dsa-kpool-sm120" in err


def test_ps_says_unreadable_for_a_record_it_cannot_read(tmp_path, cli, monkeypatch):
    """A state.json this user may not read is not damaged (serving again would not help):
    the one call that opens it fails as it does without root's bypass. HEAD: `damaged`,
    and `sm120kit serve` of that profile as the way out."""
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    record = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"profile": "glm5-nvfp4", "status": "stopped", "supervisor_pid": 1}))
    opened = Path.open

    def no_permission(self, *args, **kwargs):
        if self == record:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", no_permission)
    code, out, err = cli("ps")
    assert code == 2 and "unreadable" in out and "damaged" not in out + err, out + err
    assert f"sm120kit: error: cannot read the run record {record}: Permission denied" in err
    assert f"next: ls -l {record}" in err and "Traceback" not in err
    code, doc = cli.json("ps")
    assert code == 2 and doc["runs"][0]["status"] == "unreadable" and doc["runs"][0]["error"].startswith(str(record))


def test_profile_show_json_help_says_it_replaces_the_toml():
    parser = build_parser()
    profile = next(a for a in parser._subparsers._group_actions if "profile" in a.choices).choices["profile"]
    show = next(a for a in profile._subparsers._group_actions if "show" in a.choices).choices["show"]
    [option] = [a for a in show._actions if "--json" in a.option_strings]
    assert "TOML" in option.help and "table" not in option.help, option.help


# -- the docs' claims ------------------------------------------------------------------------


def readme_exit_codes() -> dict[int, str]:
    """The README's exit codes: each bold code with what follows it, up to the next one."""
    text = " ".join((ROOT / "README.md").read_text().split())
    said = text[text.index("Exit codes, like Black:") :].split("[docs/commands.md]")[0]
    parts = re.split(r"\*\*(\d+)\*\*", said)
    return {int(code): meaning for code, meaning in zip(parts[1::2], parts[2::2])}


def test_the_readme_exit_codes_are_those_the_commands_return(cli, site, tmp_path):
    """HEAD: "1 ... a known failure found", where a known SM120 failure of the installed
    release is a refusal, 2 (a signature found in a log is 1: `diagnose`)."""
    codes = readme_exit_codes()
    install(site, WINDOW[-1])
    refused, out, err = cli(
        "profile", "check", "glm5-nvfp4", "--site", site, "--set", "engine.prefill_attention_backend=fa3"
    )
    assert "known failure fa3-attention-sm120" in err and not out, err
    log = tmp_path / "server.log"
    log.write_text(
        "[2025-06-01 12:00:00 TP3] Scheduler hit an exception: triton.runtime.errors.OutOfResources: "
        "out of resource: shared memory, Required: 147456, Hardware limit: 101376.\n"
    )
    found, _, _ = cli("diagnose", log)
    assert [c for c, meaning in codes.items() if "known SM120 failure" in meaning] == [refused], codes
    assert [c for c, meaning in codes.items() if "signature" in meaning] == [found], codes


def test_the_docs_home_page_links_the_license(tmp_path):
    """The site's home is the README; HEAD kept its LICENSE link's text and dropped the link."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", site],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr
    links = re.findall(r'<a href="([^"#]+)"[^>]*>LICENSE</a>', (site / "index.html").read_text())
    assert links, "the home page has no link to the license"
    assert all((site / link).read_bytes() == (ROOT / "LICENSE").read_bytes() for link in links), links
