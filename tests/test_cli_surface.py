"""The command line as a new user meets it: what every command prints fits a terminal of
100 columns, every `--help` has a description, help for its positionals and its exit
codes, and the docs' tables of options, exit codes and patches say what the parsers
and `sm120kit patches` do."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
from support.paths import ROOT
from support.sites import install, raise_version
from support.standin import make_env_python

from sm120kit import report
from sm120kit.cli import build_parser
from sm120kit.patching import render
from sm120kit.patching.registry import load_patches

WIDTH = 100
DOCS = ROOT / "docs"
NVML_8_GPUS = ROOT / "tests" / "fixtures" / "doctor" / "rtx-pro-6000-x8.json"
TRITON_LOG = (
    "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 147456, "
    "Hardware limit: 101376. Reducing block sizes or `num_stages` may help."
)


@pytest.fixture(autouse=True)
def state_dir(monkeypatch, tmp_path):
    """The output is not a terminal here: 100 columns, as in a pipe or a CI log."""
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path / "state"))


# -- every command's output at 100 columns ------------------------------------------------


def site_at(tmp_path: Path, version: str) -> Path:
    site = tmp_path / f"site-{version}"
    site.mkdir(exist_ok=True)
    install(site, version)
    return site


def patched(tmp_path: Path, cli, version: str = "0.5.10") -> Path:
    site = site_at(tmp_path, version)
    assert cli("patch", "--site", site)[0] == 0
    return site


def past_the_window(tmp_path: Path, cli) -> list:
    """0.5.23 patched, then upgraded to a 0.5.24 with the same code: lost, re-applied, unproven."""
    site = patched(tmp_path, cli, "0.5.23")
    install(site, "0.5.23")
    raise_version(site, "sglang", "0.5.24")
    return ["patch", "--verify", "--site", site]


def foreign_edit(tmp_path: Path, cli) -> list:
    site = patched(tmp_path, cli)
    path = site / "sglang/srt/model_executor/model_runner.py"
    path.write_text(path.read_text() + "\n# an edit by hand\n")
    return ["status", "--site", site]


def run_records(tmp_path: Path, cli) -> list:
    now = time.time()
    runs = {
        "glm5-nvfp4": {
            "status": "ready",
            "server_pid": 2345678,
            "since": now - 100000,
            "restarts": 2,
            "host": "127.0.0.1",
            "port": 30000,
            "last_health": {
                "ok": False,
                "detail": "timed out after 10s waiting for /health_generate (503 Service Unavailable)",
                "at": now - 5,
            },
        },
        "qwen3-30b-a3b-nvfp4-1gpu": {"status": "stopped", "since": now - 50, "host": "0.0.0.0", "port": 30001},
    }
    for profile, state in runs.items():
        path = tmp_path / "state" / "serve" / profile / "state.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"profile": profile, "supervisor_pid": 1234567, **state}))
    return ["ps"]


def server_log(tmp_path: Path, cli) -> list:
    log = tmp_path / "server.log"
    log.write_text(f"[2025-06-01 12:00:00 TP3] Scheduler hit an exception: {TRITON_LOG}\n")
    return ["diagnose", log]


def bench_runs(tmp_path: Path, cli) -> list:
    dirs = []
    for name, totals in (("before", {256: 879.87, 512: 912.7}), ("after", {256: 1846.0, 512: 2800.0, 1024: 3740.0})):
        levels = [
            {"concurrency": c, "prompts": 3 * c, "figures": {"total_throughput": t, "output_throughput": t / 3}}
            for c, t in totals.items()
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"title": f"glm5-nvfp4, {name}", "levels": levels}))
        dirs.append(tmp_path / name)
    return ["bench", "compare", *dirs]


def serve_check(tmp_path: Path, cli) -> list:
    (tmp_path / "env").mkdir()
    python = make_env_python(tmp_path / "env", "0.5.23")
    return ["serve", "glm5-nvfp4", "--python", python, "--check", "--no-gpu-check"]


COMMANDS = {
    "patches": lambda tmp, cli: ["patches"],
    "status, would apply": lambda tmp, cli: ["status", "--site", site_at(tmp, "0.5.10")],
    "status, fixed upstream": lambda tmp, cli: ["status", "--site", site_at(tmp, "0.5.23")],
    "status, a foreign edit": foreign_edit,
    "status --debug": lambda tmp, cli: ["status", "--debug", "--site", site_at(tmp, "0.5.23")],
    "patch --check": lambda tmp, cli: ["patch", "--check", "--site", site_at(tmp, "0.5.10")],
    "patch --verify": lambda tmp, cli: ["patch", "--verify", "--site", site_at(tmp, "0.5.10")],
    "patch --verify past the window": past_the_window,
    "unpatch --dry-run": lambda tmp, cli: ["unpatch", "--dry-run", "--site", patched(tmp, cli)],
    "unpatch": lambda tmp, cli: ["unpatch", "--site", patched(tmp, cli)],
    "profiles": lambda tmp, cli: ["profiles"],
    "profile check": lambda tmp, cli: ["profile", "check", "glm5-nvfp4", "--site", site_at(tmp, "0.5.23")],
    "ps": run_records,
    "diagnose": server_log,
    "doctor --nvml": lambda tmp, cli: ["doctor", "--nvml", NVML_8_GPUS],
    "doctor --nvml --profile": lambda tmp, cli: ["doctor", "--nvml", NVML_8_GPUS, "--profile", "glm5-nvfp4"],
    "serve --check": serve_check,
    "bench compare": bench_runs,
}


@pytest.mark.parametrize("argv_for", COMMANDS.values(), ids=COMMANDS.keys())
def test_what_a_command_prints_fits_100_columns(argv_for, tmp_path, cli):
    _code, out, err = cli(*argv_for(tmp_path, cli))
    assert out.strip() and "Traceback" not in out + err, err
    too_wide = [line for line in out.splitlines() if len(line) > WIDTH]
    assert too_wide == [], f"{len(too_wide)} line(s) wider than {WIDTH} columns:\n" + "\n".join(too_wide)


def test_wide_puts_every_column_on_one_line(tmp_path, cli):
    site = site_at(tmp_path, "0.5.23")
    _, out, _ = cli("status", "--wide", "--site", site)
    header, *rows = out.splitlines()[1:9]
    assert header.split() == ["PATCH", "PACKAGE", "VERSION", "OUTCOME", "FIXED", "IN", "FILE", "DETAIL"]
    dsa = next(r for r in rows if r.startswith("sglang-dsa-page-table-guard"))
    assert dsa.split() == [
        "sglang-dsa-page-table-guard",
        "sglang",
        "0.5.23",
        "would-apply",
        "open",
        "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py",
    ]
    assert max(len(r) for r in rows) > WIDTH  # nothing wrapped, nothing dropped
    _, fitted, _ = cli("status", "--site", site)
    assert "  sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py" in fitted.splitlines()


def test_status_says_why_it_exits_1(tmp_path, cli):
    site = site_at(tmp_path, "0.5.10")
    code, out, _ = cli("status", "--site", site, "--wide")
    assert code == 1
    assert out.splitlines()[-2:] == [
        "3 fixed-upstream, 6 would-apply, 3 not-applicable",
        f"would change: run `sm120kit patch --site {site}` to apply",  # that site, not this interpreter's
    ]


def test_the_json_documents_keep_their_shape(tmp_path, cli):
    _, doc = cli.json("patches")
    patch = next(p for p in doc["patches"] if p["id"] == "sglang-triton-smem-sm120")
    assert set(patch) >= {"id", "package", "summary", "why", "revision", "fixed_in", "proven_window", "refs"}
    assert set(patch) >= {"rewrites", "source", "releases"} and patch["releases"] == "0.5.9–0.5.23"
    assert all(set(r) >= {"path", "versions", "fixed_in"} for r in patch["rewrites"])
    code, doc = cli.json("status", "--site", site_at(tmp_path, "0.5.10"))
    assert code == 1 and doc["exit_code"] == 1 and {r["fixed_in"] for r in doc["results"]} >= {None, "0.5.13"}


# -- tables and release ranges ----------------------------------------------------------


@pytest.mark.parametrize(
    "ranges, span",
    [
        ([">=0.5.9,<0.5.16", ">=0.5.16,<=0.5.23"], "0.5.9–0.5.23"),  # a file that moved
        ([">=0.5.9,<0.5.16", ">=0.5.9,<0.5.11", ">=0.5.11,<=0.5.23", ">=0.5.16,<=0.5.23"], "0.5.9–0.5.23"),
        ([">=0.5.9,<0.5.11", ">=0.5.13,<=0.5.20"], ">=0.5.9,<0.5.11, 0.5.13–0.5.20"),
        ([">=0.5.9,<0.5.11", ">0.5.11,<=0.5.20"], ">=0.5.9,<0.5.11, >0.5.11,<=0.5.20"),  # 0.5.11 in neither
        ([">=0.5.9,<=0.5.11", ">0.5.11,<=0.5.20"], "0.5.9–0.5.20"),
        ([">=0.6.3,<=0.6.3"], "0.6.3"),
        (["==0.6.3"], "0.6.3"),
        ([">=0.5.9", ">=0.5.20,<=0.5.23"], ">=0.5.9"),
        ([">=0.5.9,<0.5.14", "!=0.5.10"], ">=0.5.9,<0.5.14, !=0.5.10"),
        ([], "any release"),
    ],
)
def test_release_ranges_merge_into_one_span(ranges, span):
    assert render.release_span(ranges) == span


def test_a_table_fits_its_width_by_wrapping_the_columns_allowed_to():
    rows = [["glm5-nvfp4", "a description " * 8], ["sm120-base", "short"]]
    text = report.table(["PROFILE", "DESCRIPTION"], rows, 53, narrow=(1,), notes=["a note " * 10, ""])
    assert max(len(line) for line in text.splitlines()) <= 53
    assert text.splitlines()[1:4] == [
        "glm5-nvfp4  a description a description a description",
        "            a description a description a description",
        "            a description a description",
    ]
    assert text.splitlines()[4].startswith("  a note a note") and text.splitlines()[-1] == "sm120-base  short"
    path = "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"
    assert report.table(["RELEASES", "FILE"], [["0.5.11–0.5.23", path]], 60, narrow=(1,)).splitlines()[1:] == [
        "0.5.11–0.5.23  sglang/srt/layers/moe/moe_runner/",  # a path breaks after a "/"
        "               triton_utils/fused_moe_triton_config.py",
    ]
    assert report.table(["PROFILE", "DESCRIPTION"], rows) == report.table(["PROFILE", "DESCRIPTION"], rows, None, (1,))


# -- --help ------------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every subcommand, `profile show` included, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from subcommands(sub, f"{prefix}{name} ")


PARSERS = dict(subcommands(build_parser()))
LEAVES = {name: p for name, p in PARSERS.items() if p.get_default("func")}


def exit_codes(parser: argparse.ArgumentParser) -> set[int]:
    """The codes its `--help` lists under "exit codes:"."""
    _, _, table = (parser.epilog or "").partition("exit codes:\n")
    return {int(m) for m in re.findall(r"^\s+(\d+)\s\s", table, re.M)}


@pytest.mark.parametrize("name", PARSERS)
def test_every_help_has_a_description_its_positionals_and_its_exit_codes(name):
    parser = PARSERS[name]
    assert parser.description and len(parser.description) > 40
    assert 0 in exit_codes(parser) and 2 in exit_codes(parser)  # any command: bad input is 2
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            assert action.help, f"{name}: {action.dest} has no help"
    python = next((a for a in parser._actions if "--python" in a.option_strings), None)
    if python and name != "patch":
        assert "environment to patch" not in python.help, "--python says what it is for in this command"
    assert max(len(line) for line in parser.format_help().splitlines()) <= WIDTH


def test_declaring_the_commands_imports_no_library_module():
    """`sm120kit --help` builds every parser: the commands' own modules load in the command."""
    code = (
        "import sys; from sm120kit.cli import build_parser; build_parser(); "
        "print(' '.join(m for m in ('sm120kit.tryout', 'sm120kit.wheels', 'sm120kit.patching.registry', "
        "'sm120kit.profiles.render', 'sm120kit.target') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


# -- the docs' claims --------------------------------------------------------------------


def docs_table(page: str, header: str) -> list[list[str]]:
    """The cells of the table whose header line is `header` on the docs page `page`."""
    text = (DOCS / page).read_text()
    rows = []
    for line in text[text.index(header) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def commands_named(cell: str) -> set[str]:
    """The commands a docs table's cell names: `status`, `profile check`; "every command but `bench`"."""
    named = {c for c in re.findall(r"`([^`]+)`", cell) if c in LEAVES}
    if cell.startswith("every command"):
        return set(LEAVES) - named
    return named


def test_the_docs_say_which_command_takes_which_option():
    rows = docs_table("commands.md", "| option | what | taken by |")
    assert len(rows) == 9
    for options, _, taken_by in rows:
        for option in re.findall(r"`(--[a-z-]+)", options):
            takes = {name for name, p in LEAVES.items() if any(option in a.option_strings for a in p._actions)}
            assert takes == commands_named(taken_by), option


def docs_exit_codes() -> dict[str, set[int]]:
    """Per command, the codes the exit-code table of docs/exit-codes.md gives it (2 for bad input, always)."""
    codes: dict[str, set[int]] = {}
    for commands, ok, findings, _always, other in docs_table(
        "exit-codes.md", "| command | 0 | 1 | 2 (besides bad input) | other |"
    ):
        row = {0} if ok else set()
        row |= {1} if findings else set()
        row |= {2} | {int(c) for c in re.findall(r"(?:^|; )(\d+):", other)}
        for command in re.findall(r"`([^`]+)`", commands):
            name = command if command in LEAVES else command.split()[0]
            codes.setdefault(name, set()).update(row)
    return codes


@pytest.mark.parametrize("name", LEAVES)
def test_the_docs_exit_codes_are_those_of_help(name):
    global_codes = {130, 141}  # Ctrl-C and a reader gone away: every command, said once
    assert docs_exit_codes()[name] - global_codes == exit_codes(LEAVES[name]) - global_codes


def test_the_docs_patch_table_is_what_patches_prints():
    rows = {r[0].strip("`"): r[1:4] for r in docs_table("patches.md", "| id | package | releases | fixed in | what |")}
    patches = {p.id: p for p in load_patches()}
    assert set(rows) == set(patches)
    for patch_id, (package, releases, fixed_in) in rows.items():
        p = patches[patch_id]
        assert [package, releases, fixed_in] == [
            p.package,
            render.release_span(r.versions for r in p.rewrites),
            render.fixed_in_text(p),
        ], patch_id


# -- errors, warnings and argparse's mistakes --------------------------------------------


@pytest.fixture
def stderr_is_a_terminal(monkeypatch, capsys):
    """stderr is a terminal 100 columns wide (pytest's capture stands in for it)."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.setattr(report, "stderr_is_a_terminal", lambda: True)


def fits(text: str, width: int = WIDTH) -> bool:
    return all(len(line) <= width for line in text.splitlines())


@pytest.mark.parametrize(
    "argv, first",
    [
        (["status", "--only", "nope"], "sm120kit: error: --only: unknown patch id 'nope'"),
        (["profile", "show", "nope"], "sm120kit: error: unknown profile 'nope'"),
        (["profile", "show", "glm5-nvfp4", "--set", "engine.nope=1"], "sm120kit: error: --set 'engine.nope=1'"),
    ],
)
def test_an_error_wraps_to_100_columns_with_its_next_line(argv, first, cli, stderr_is_a_terminal):
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith(first) and fits(err), err
    lines = err.splitlines()
    assert len(lines) > 2 and all(line.startswith("  ") for line in lines[1:])  # continued, indented
    assert sum(line.startswith("  next: ") for line in lines) == 1


def test_wide_keeps_an_error_on_one_line(cli, stderr_is_a_terminal):
    _, _, err = cli("status", "--wide", "--only", "nope")
    error, hint = err.splitlines()
    assert len(error) > WIDTH and error.endswith("sglang-trtllm-mla-prefill-sm120") and hint.startswith("  next: ")


def test_to_a_pipe_an_error_stays_one_line_for_grep(cli):
    _, _, err = cli("status", "--only", "nope")
    error, hint = err.splitlines()
    assert len(error) > WIDTH and hint.startswith("  next: ")


def test_warnings_and_internal_errors_wrap(monkeypatch, capsys, cli, stderr_is_a_terminal):
    report.print_warnings(["the fp8 KV cache " * 12])
    err = capsys.readouterr().err
    assert err.startswith("warning: the fp8") and fits(err) and len(err.splitlines()) > 1
    report.print_warnings(["the fp8 KV cache " * 12], wide=True)
    assert len(capsys.readouterr().err.splitlines()) == 1

    def boom(args):
        raise RuntimeError("a bug " * 40)

    monkeypatch.setattr("sm120kit.cli.profiles.cmd_profile_schema", boom)
    code, _, err = cli("profile", "schema")
    assert code == 2 and err.startswith("sm120kit: internal error: RuntimeError: a bug") and fits(err)
    assert err.splitlines()[-1] == "  rerun with --debug for the traceback and report it"


@pytest.mark.parametrize(
    "argv, command, error",
    [
        (["status", "--bogus"], "status", "unrecognized arguments: --bogus"),
        (["status", "--only"], "status", "argument --only: expected one argument"),
        (["diagnose", "log", "--tail", "x"], "diagnose", "argument --tail: invalid int value: 'x'"),
        (["profile", "show", "glm5-nvfp4", "--bogus"], "profile show", "unrecognized arguments: --bogus"),
        (["bogus"], "", "argument COMMAND: invalid choice: 'bogus'"),
    ],
)
def test_an_argparse_error_gives_the_commands_usage_and_the_next_step(
    argv, command, error, capsys, stderr_is_a_terminal
):
    from sm120kit.cli import main

    prog = f"sm120kit {command}".strip()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: {prog} [-h]")
    assert f"{prog}: error: {error}" in err and err.splitlines()[-1] == f"  next: {prog} --help" and fits(err)


def test_the_top_help_lists_every_exit_code():
    epilog = build_parser().epilog
    for code in ("0 ok", "1 something", "2 an error", "3 the server", "130 interrupted", "141 the reader"):
        assert code in " ".join(epilog.split()), code


def test_profile_show_wraps_its_comment(tmp_path, cli):
    # "# glm5-nvfp4  (PATH)" is over 100 columns; "# (PATH)" alone fits (a path is never broken).
    deep = tmp_path / ("d" * max(1, 92 - len(str(tmp_path / "x/glm5-nvfp4.toml"))))
    deep.mkdir()
    assert 88 < len(str(deep / "glm5-nvfp4.toml")) <= 97, "the test's temporary directory is too deep for its case"
    (deep / "glm5-nvfp4.toml").write_text((ROOT / "profiles" / "glm5-nvfp4.toml").read_text())
    code, out, _ = cli("profile", "show", "glm5-nvfp4", "--profile-dir", deep)
    assert code == 0
    comment = [line for line in out.splitlines() if line.startswith("#")]
    assert len(comment) > 1 and fits("\n".join(comment)) and comment[1] == f"# ({deep / 'glm5-nvfp4.toml'})"
    assert tomllib.loads(out)["extends"] == "sm120-base"  # the body: TOML, the comment lines its comments


def test_a_table_fills_its_width_exactly_and_no_more(cli):
    """A row as wide as the width stays on one line (`patches` indents its file tables by 2 and
    fits them to 98: 100 characters; "–" is one column, three bytes); one column less and its
    path wraps."""
    path = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"
    row = [["0.5.9–0.5.23", "open", path]]
    headers = ["RELEASES", "FIXED IN", "FILE"]
    line = f"0.5.9–0.5.23  open      {path}"
    assert report.table(headers, row, len(line), narrow=(2,)).splitlines()[1:] == [line]
    assert len(report.table(headers, row, len(line) - 1, narrow=(2,)).splitlines()) == 3
    _, out, _ = cli("patches")
    rows = [r for r in out.splitlines() if r.endswith("forward_mha.py")]
    assert rows and all(len(r) <= WIDTH for r in rows)
