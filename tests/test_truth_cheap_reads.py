"""The cheap reads (issue 32, item 9). A `patch --check` on a release that the shipped seed
does not cover (a build of sglang's main) decides every verdict from ast and tokens, without
importing libcst; each shipped patch's quick read says what its transform says, with the
same reason, on every release of the window, on the vendor's file and on the patched one;
and `sm120kit ps` reads a sound record without pydantic. Speed is measured by
scripts/bench_kit.py, never here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import psutil
import pytest
from support import patch_cases
from support.patch_cases import shipped_patch, shipped_patches, window
from support.sites import install, raise_version, wheel_bytes

from sm120kit.patching import transform
from sm120kit.patching.spec import Outcome
from sm120kit.serve import record_schema
from sm120kit.serve.rundir import RunRecord

# Runs the CLI in a child and says on stderr whether a module was imported: an import is
# for the process, so only a fresh interpreter can tell.
CHILD = """\
import json, sys
from sm120kit.cli import main
code = main(sys.argv[2:])
print(json.dumps({"code": code, "imported": sys.argv[1] in sys.modules}), file=sys.stderr)
"""


def child(module: str, *argv: str, **env: str) -> tuple[int, bool, str]:
    """(exit code, whether `module` was imported, stdout) of `sm120kit argv` in a fresh
    interpreter, the shipped seed on as a user has it."""
    environ = {k: v for k, v in os.environ.items() if k != "SM120KIT_NO_OUTCOME_SEED"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, module, *argv], capture_output=True, text=True, env={**environ, **env}
    )
    said = json.loads(done.stderr.strip().splitlines()[-1])
    return said["code"], said["imported"], done.stdout


def verdict(finding) -> tuple:
    return finding.outcome, finding.detail, finding.fixed_in


# -- item 9: every verdict of the window is cheap, and the cheap one is the transform's ----


def _cases() -> list:
    return [
        pytest.param(p.id, v, id=f"{p.id}-{v}")
        for package in ("sglang", "flashinfer-python")
        for p in shipped_patches(package)
        for v in window(package)
        if p.rewrites_for(v)
    ]


@pytest.mark.parametrize(("patch_id", "version"), _cases())
def test_a_quick_read_says_what_its_transform_says(patch_id, version):
    """On the release's own file: the quick read decides (no libcst needed) and gives the
    transform's verdict and reason; on the file the transform writes, it decides
    already-applied, as the transform does there (run_rewrites' self-check proved that)."""
    patch = shipped_patch(patch_id)
    for rewrite in patch.rewrites_for(version):
        item = [(patch, rewrite)]
        source, after, full = patch_cases.transform(patch, version, path=rewrite.path)  # once per run
        quick = transform.quick_verdicts(source, item, version, rewrite.path)
        assert quick is not None, f"{rewrite.path}: the quick read could not tell ({full.outcome.value})"
        assert [verdict(f) for f in quick] == [verdict(full)], rewrite.path
        if after != source:
            assert full.outcome is Outcome.WOULD_APPLY
            patched = transform.quick_verdicts(after, item, version, rewrite.path)
            assert patched is not None, f"{rewrite.path}, patched: the quick read could not tell"
            assert [f.outcome for f in patched] == [Outcome.ALREADY_APPLIED], rewrite.path


def test_a_quick_read_of_code_it_was_not_written_for_is_the_transforms_or_none():
    """The files a rewrite names, on the releases its range leaves out (the code moved, or
    was fixed): anchor-missing and fixed-upstream shapes. Where a quick read tells, it tells
    what the transform tells. (The flashinfer rewrites cover their whole window.)"""
    decided, package = 0, "sglang"
    for patch in shipped_patches(package):
        for version in (window(package)[0], window(package)[-1]):
            for rewrite in patch.rewrites:
                if rewrite.covers(version):
                    continue
                try:
                    source = wheel_bytes(version, rewrite.path, package)
                except KeyError:  # not in this release
                    continue
                item = [(patch, rewrite)]
                [full] = transform.run_rewrites(source, item, version, rewrite.path)[1]
                quick = transform.quick_verdicts(source, item, version, rewrite.path)
                if quick is not None:
                    decided += 1
                    assert [verdict(f) for f in quick] == [verdict(full)], (patch.id, version, rewrite.path)
    assert decided  # the shapes were read, not passed over


MARKER_EDITS = {
    # a note at the marker's own indentation between it and its statement: libcst still gives
    # the statement the marker, and a quick read must place it as libcst does
    "a note between the marker and its statement": lambda line, indent: line + "\n" + indent + "# a note\n",
    # a comment deeper than the marked statement, after the marker: libcst gives the marker
    # to the block before (its footer), not to the statement
    "a deeper comment after the marker": lambda line, indent: line + indent + "        # a note\n",
    # the marker at the end of a line of code: a trailing comment, nobody's leading line
    "the marker after code": lambda line, indent: indent + "pass  " + line.lstrip(),
}


@pytest.mark.parametrize("edit", MARKER_EDITS)
def test_a_marker_where_libcst_may_see_it_otherwise_is_read_as_libcst_does_or_left_to_it(edit):
    """Where a marker comment stands decides whether libcst's statement carries it: a quick
    read either places it as libcst does or leaves the verdict to the transform. (Edits of
    the patched files of the window's newest release.)"""
    version, decided = window("sglang")[-1], 0
    for patch in shipped_patches("sglang"):
        for rewrite in patch.rewrites_for(version):
            item = [(patch, rewrite)]
            _, after, full = patch_cases.transform(patch, version, path=rewrite.path)
            if full.outcome is not Outcome.WOULD_APPLY:
                continue
            lines = after.decode().splitlines(keepends=True)
            at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"# sm120kit: {patch.id} r"))
            indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
            edited = "".join([*lines[:at], MARKER_EDITS[edit](lines[at], indent), *lines[at + 1 :]]).encode()
            [judged] = transform.run_rewrites(edited, item, version, rewrite.path)[1]
            quick = transform.quick_verdicts(edited, item, version, rewrite.path)
            if quick is not None:
                decided += 1
                assert [verdict(f) for f in quick] == [verdict(judged)], (patch.id, rewrite.path)
    if edit == "a note between the marker and its statement":
        assert decided  # read, not passed over


def test_a_check_on_a_release_the_seed_does_not_cover_imports_no_libcst(cli, site, tmp_path, monkeypatch):
    """Before: every file was parsed with libcst (~0.2 s to import, then seconds of parsing:
    0.93 s to 2.5 s for the check). Now the quick reads decide every verdict, and they are the
    verdicts the transforms give."""
    install(site, "0.5.23")
    raise_version(site, "sglang", "0.5.24.dev0")  # a build of main: newer than the window, not seeded
    raise_version(site, "flashinfer-python", "0.7.5.dev0")
    code, imported, out = child(
        "libcst", "patch", "--check", "--site", str(site), "--json", SM120KIT_CACHE_DIR=str(tmp_path / "cold")
    )
    assert (code, imported) == (1, False)  # 1: patches would apply
    monkeypatch.setenv("SM120KIT_CACHE_DIR", str(tmp_path / "transforms"))
    monkeypatch.setattr(transform, "quick_verdicts", lambda *args: None)  # every verdict from the transforms
    assert json.loads(out)["results"] == cli.json("patch", "--check", "--site", site)[1]["results"]


# -- item 9: `ps` with one record ---------------------------------------------------------


def _record(run: RunRecord, supervisor: psutil.Process, started: float) -> None:
    """state.json as the supervisor writes it (sm120kit.serve.machine: launch, started, a probe)."""
    now = time.time()
    run.update(
        profile=run.dir.name,
        supervisor_pid=supervisor.pid,
        supervisor_started=started,
        status="ready",
        since=now - 60,
        host="127.0.0.1",
        port=30000,
        log=str(run.log),
        events=str(run.events),
        restarts=0,
        last_health={"at": now - 5, "ok": True, "detail": "generate 200", "seconds": 0.213},
        subreaper=True,
        server_pid=supervisor.pid,
        marker="run-1",
        attempt=1,
    )


def test_ps_reads_sound_records_without_pydantic(tmp_path):
    """Before: reading a state.json imported pydantic and built its model, most of `ps`'s
    time. Now a record that is plainly sound is read without it; ps still tells a live
    supervisor from one that is gone (its pid now another process's: another start time)."""
    me = psutil.Process()
    _record(RunRecord(tmp_path / "serve" / "live"), me, me.create_time())
    _record(RunRecord(tmp_path / "serve" / "stale"), me, me.create_time() - 3600)
    code, imported, out = child("pydantic", "ps", "--json", SM120KIT_STATE_DIR=str(tmp_path))
    assert (code, imported) == (0, False)
    runs = {r["profile"]: (r["status"], r["running"]) for r in json.loads(out)["runs"]}
    assert runs == {"live": ("ready", True), "stale": ("supervisor gone", False)}


SOUND = {
    "profile": "p",
    "status": "ready",
    "supervisor_pid": 4242,
    "supervisor_started": 1.5e9,
    "since": 1.5e9,
    "server_pid": 4243,
    "restarts": 0,
    "host": "127.0.0.1",
    "port": 30000,
    "marker": "m",
    "last_health": {"at": 1.5e9, "ok": True, "detail": "", "seconds": 0.2},
}
MISSING = object()
VALUES = [MISSING, None, True, False, 0, 1, -1, 7, 2**22, 2**22 + 1, 65536, 1.5, -0.5, 1e12, math.inf, math.nan]
VALUES += ["", "x", [], {}, {"at": "x"}, {"ok": 1}, {"detail": None}, {"seconds": -1}, {"seconds": math.inf}]


def test_a_plainly_sound_record_is_one_the_model_accepts():
    """The check that spares pydantic is never more lenient than the model: for every field
    (and every field of last_health) and every kind of value, a record it calls sound is one
    the model accepts; and what a supervisor writes is plainly sound."""
    model = record_schema._run_state()
    assert record_schema._plainly_valid(SOUND) and model.model_validate(SOUND)
    docs = []
    for key in SOUND:
        for value in VALUES:
            docs.append({k: v for k, v in {**SOUND, key: value}.items() if v is not MISSING})
    for key in SOUND["last_health"]:
        for value in VALUES:
            health = {k: v for k, v in {**SOUND["last_health"], key: value}.items() if v is not MISSING}
            docs.append({**SOUND, "last_health": health})
    lenient = []
    for doc in docs:
        if record_schema._plainly_valid(doc):
            try:
                model.model_validate(doc)
            except ValueError:
                lenient.append(doc)
    assert lenient == []
    assert sum(map(record_schema._plainly_valid, docs)) > len(SOUND)  # it does call most sound ones sound
