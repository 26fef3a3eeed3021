"""What sm120kit quotes from a server's log reaches a terminal as text: no escape sequence
of the log recolours it or sets its title (`diagnose`, serve's death report). What it shows
of a known failure's symptom is a line a log would hold, never the regular expression that
matches it; each such line is matched by its own pattern (issue 31, item 13)."""

from __future__ import annotations

import json
import re

from support.clock import FakeClock
from support.serve import MY_FAILURE
from support.sites import WINDOW, install

from sm120kit.catalogue.survey import load_survey
from sm120kit.serve.diagnose import diagnose, signatures
from sm120kit.serve.machine import Machine, Policy, Say, ServerSpec

# What a terminal acts on: ESC (colours, titles, cursor moves), BEL, the 8-bit CSI/OSC, a
# carriage return (writes over the line), the bidirectional overrides.
TERMINAL_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
TITLE = "\x1b]0;you have been pwned\x07"
RED, RESET = "\x1b[31m", "\x1b[0m"
ILLEGAL_ACCESS = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


def hostile_log() -> str:
    """A log whose lines carry what a coloured logger, a tqdm bar or a crafted line writes."""
    return "".join(
        [
            f"{TITLE}[2026-11-29 10:00:00 TP0] Load weight begin\n",
            f"{RED}{ILLEGAL_ACCESS}{RESET}\n",
            f"{RED}ModuleNotFoundError: No module named 'vllm{TITLE}\x9b2J\x08'{RESET}\n",
        ]
    )


def test_printable_removes_escape_sequences_and_spells_out_other_controls():
    from sm120kit.textcheck import printable  # the one sanitiser of log text shown on a terminal

    assert printable(f"{RED}red{RESET} text") == "red text"
    assert printable(f"a{TITLE}b") == "ab"  # OSC ended by BEL
    assert printable("x\x1b]8;;https://example.invalid\x1b\\link\x1b]8;;\x1b\\y") == "xlinky"  # ... by ST
    assert printable("\x9b31mc1 csi") == "c1 csi"  # the 8-bit CSI
    assert printable("reset\x1bc") == "reset"  # ESC c resets the terminal
    assert printable("bell\x07 and nul\x00") == "bell\\x07 and nul\\x00"
    assert printable("\u202eevil") == "\\u202eevil"
    assert printable("tab\tkept, ünïcode kept") == "tab\tkept, ünïcode kept"


def test_diagnose_quotes_the_log_without_its_escape_sequences(cli, tmp_path):
    """HEAD: the title and colour sequences are echoed raw, and the coloured traceback line
    is not diagnosed (its pattern is anchored at the line's start, behind the colour)."""
    log = tmp_path / "server.log"
    log.write_text(hostile_log())
    code, out, err = cli("diagnose", log)
    assert code == 1, err
    assert not TERMINAL_CONTROL.search(out.replace("\n", "")), repr(out)
    assert ILLEGAL_ACCESS in out
    assert "no module named 'vllm\\x08'" in out  # its escape sequences gone, a backspace spelled out
    code, doc = cli.json("diagnose", log)
    found = {d["id"]: d for d in doc["diagnoses"]}
    assert set(found) == {"illegal-memory-access", "missing-module"}
    assert found["illegal-memory-access"]["line"] == ILLEGAL_ACCESS
    assert not any(TERMINAL_CONTROL.search(json.dumps(d, ensure_ascii=False)) for d in doc["diagnoses"])


def test_a_servers_death_report_quotes_its_log_without_escape_sequences():
    """serve's report of a death: the diagnosis and, with none, the log's last lines. HEAD:
    both raw."""
    spec = ServerSpec("fake", ["sglang"], ["sglang"], {}, "127.0.0.1", 30000, [], check_gpus=False)
    policy = Policy(60, 1.0, 2.0, 2, 0, 0.2, 0.5, 10, 600)
    for tail, shown in (
        (hostile_log(), ILLEGAL_ACCESS),
        (f"{TITLE}{RED}Segmentation fault (core dumped){RESET}\n{RED}{RESET}\n", "Segmentation fault (core dumped)"),
    ):
        machine = Machine(spec, policy, FakeClock(), "server.log", "events.jsonl")
        machine.tick()
        machine.started(1000, "fake:1")
        machine.exited("killed by SIGKILL", None)
        said = "\n".join(a.text for a in machine.after_end(tail) if isinstance(a, Say))
        assert shown in said and not TERMINAL_CONTROL.search(said.replace("\n", "")), repr(said)
        assert "\n    \n" not in said  # a line that was only escape sequences is no line


def test_every_signature_shows_a_line_its_pattern_matches():
    """signatures.toml and the survey: each pattern has an example, a line a log would hold,
    which the pattern matches; a generic signature's example is diagnosed as that signature."""
    survey_ids = {f.id for f in load_survey(validate_patches=False).failures}
    for sig in signatures():
        assert sig.example and not TERMINAL_CONTROL.search(sig.example), sig.id
        assert sig.pattern.search(sig.example), f"{sig.id}: {sig.pattern.pattern!r} !~ {sig.example!r}"
        found = [d.id for d in diagnose(sig.example)]
        assert found, sig.id
        if sig.id not in survey_ids:
            assert found == [sig.id]


def test_every_symptom_of_the_survey_has_an_example_it_matches():
    for f in load_survey(validate_patches=False).failures:
        if f.symptom is None:
            assert f.example is None and f.shown_symptom is None, f.id
            continue
        assert f.example and f.pattern and f.pattern.search(f.example), f.id
        assert f.shown_symptom == f.example


def test_a_user_entry_whose_example_its_symptom_does_not_match_is_refused(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    entry = """
[[failure]]
id = "boom-sm120"
title = "an example"
package = "sglang"
affected = ">=0.5.20"
checked = "0.5.23"
upstream = ["https://github.com/sgl-project/sglang/issues/1"]
symptom = 'boom at line \\d+'
example = "RuntimeError: boom at line twelve"
evidence = "nowhere"
answer = "compiled"
avoid = "--attention-backend flashinfer"
advice = "avoid it"
"""
    (mine / "known-failures.toml").write_text(entry)
    code, out, err = cli("known-failures", "--patch-dir", mine)
    assert (code, out) == (2, "") and "Traceback" not in err
    assert "known-failures.toml" in err and "failure[0] (boom-sm120)" in err and "does not match its example" in err
    (mine / "known-failures.toml").write_text(entry.replace("line twelve", "line 12"))
    code, doc = cli.json("known-failures", "--patch-dir", mine)
    assert code == 0 and doc["failures"][0]["example"] == "RuntimeError: boom at line 12"


def test_a_refusal_shows_the_line_a_log_would_hold_not_the_pattern(cli, site):
    """HEAD: `it fails with: FlashAttention v3 Backend requires SM>=80 and SM<=90|The 'fa3'
    backend is not supported on Blackwell GPUs` (the regular expression)."""
    install(site, WINDOW[-1])
    code, out, err = cli(
        "profile", "check", "glm5-nvfp4", "--site", site, "--set", "engine.prefill_attention_backend=fa3"
    )
    assert code == 2 and not out
    assert "SM<=90|The 'fa3'" not in err  # the pattern
    assert "it fails with: AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90." in err
    fa3 = load_survey(validate_patches=False).get("fa3-attention-sm120")
    assert fa3 is not None and f"it fails with: {fa3.shown_symptom}" in err


def test_a_port_taken_is_diagnosed_as_uvicorn_reports_it():
    """uvicorn binds through asyncio's create_server, which lowercases the strerror. HEAD:
    no diagnosis (the pattern was `Address already in use`)."""
    line = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use"
    assert [d.id for d in diagnose(line + "\n")] == ["address-in-use"]
    assert [d.id for d in diagnose("OSError: [Errno 98] Address already in use\n")] == ["address-in-use"]


def test_diagnose_reads_the_known_failures_of_each_patch_dir(cli, tmp_path):
    """A user's own known failure is diagnosed as serve and profile check know it (--patch-dir,
    before the shipped survey); a --patch-dir that is not there is refused, naming it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "known-failures.toml").write_text(MY_FAILURE)
    log = tmp_path / "server.log"
    log.write_text("[TP0] Load weight begin\nRuntimeError: boom at line 12\n")
    code, doc = cli.json("diagnose", log)
    assert (code, doc["diagnoses"]) == (0, [])
    code, doc = cli.json("diagnose", log, "--patch-dir", mine)
    assert code == 1 and [d["id"] for d in doc["diagnoses"]] == ["boom-sm120"]
    assert doc["diagnoses"][0]["line"] == "RuntimeError: boom at line 12"
    code, out, err = cli("diagnose", log, "--patch-dir", tmp_path / "nowhere")
    assert (code, out) == (2, "") and "Traceback" not in err and str(tmp_path / "nowhere") in err


def test_a_servers_death_is_diagnosed_with_the_known_failures_of_its_patch_dirs(tmp_path):
    """serve --patch-dir: the supervisor's report of a death knows the user's failures too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "known-failures.toml").write_text(MY_FAILURE)
    spec = ServerSpec("fake", ["sglang"], ["sglang"], {}, "127.0.0.1", 30000, [], check_gpus=False)
    policy = Policy(60, 1.0, 2.0, 2, 0, 0.2, 0.5, 10, 600)
    for dirs, shown in (((), "no known SM120 failure signature"), ((str(mine),), "diagnosis: a failure of my own")):
        machine = Machine(spec, policy, FakeClock(), "server.log", "events.jsonl", dirs)
        machine.tick()
        machine.started(1000, "fake:1")
        machine.exited("exit code 1", 1)
        said = "\n".join(a.text for a in machine.after_end("RuntimeError: boom at line 12\n") if isinstance(a, Say))
        assert shown in said, said
