#!/usr/bin/env python3
"""The bad-input campaign: every input here is a user mistake or damaged/hostile state,
run through the real CLI in a subprocess. Each must end in a clear message (no traceback,
no "internal error", the API key never printed) with the exit code it documents.

    python scripts/bad_inputs.py          # one line per input, then the tally

Prints `tried / clear / traceback / internal error / signal / wrong exit code`; exit 1 when
any is not clear. Needs the wheel cache the tests use (it installs real releases into
scratch sites), and strace for the I/O errors it injects (left out, and said so, without).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

from support.process_scope import scope_to_this_run  # noqa: E402
from support.sites import install  # noqa: E402
from support.standin import PROFILES, make_env_python  # noqa: E402

scope_to_this_run()  # as in the tests: an sglang the host runs is not this run's business

SECRET = "sk-live-0123456789abcdef"
DSA_FILE = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py"


def sm120kit(argv, env=None, cwd=None, prefix=()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*map(str, prefix), sys.executable, "-m", "sm120kit", *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=180,
    )


class Sites:
    """Scratch sites: a vendor sglang 0.5.23, and one patched, copied fresh per case."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.vendor = tmp / "vendor" / "site-packages"
        self.vendor.mkdir(parents=True)
        install(self.vendor, "0.5.23", flashinfer=False)
        self.patched = tmp / "patched" / "site-packages"
        shutil.copytree(self.vendor, self.patched)
        assert sm120kit(["patch", "--site", self.patched]).returncode == 0
        self.n = 0

    def copy(self, patched: bool = True) -> Path:
        self.n += 1
        site = self.tmp / f"case{self.n}" / "site-packages"
        shutil.copytree(self.patched if patched else self.vendor, site, symlinks=True)
        return site


def edit_ledger(site: Path, change) -> Path:
    path = site / ".sm120kit" / "ledger.json"
    doc = json.loads(path.read_text())
    change(doc, doc["files"][f"sglang:{DSA_FILE}"])
    path.write_text(json.dumps(doc))
    return site


def patch_cases(sites: Sites, tmp: Path) -> list[tuple[str, list, dict, int]]:
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("precious\n")

    def moved(doc, entry, path):
        doc["files"].pop(f"sglang:{DSA_FILE}")
        entry["path"] = path
        doc["files"][f"sglang:{path}"] = entry

    def symlinked_backups():
        site = sites.copy()
        backups = site / ".sm120kit" / "backups"
        shutil.rmtree(backups)
        backups.symlink_to(outside)
        return site

    def symlinked_state():
        site = sites.copy(patched=False)
        (site / ".sm120kit").symlink_to(outside)
        return site

    def damaged(relpath, old: bytes, new: bytes, patched=False):
        site = sites.copy(patched)
        dist_info = next(site.glob("sglang-*.dist-info"))
        path = dist_info / relpath
        path.write_bytes(path.read_bytes().replace(old, new, 1) if old else new + path.read_bytes())
        return site

    bad_python = tmp / "python-fails"
    bad_python.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    bad_python.chmod(0o755)
    journal = sites.copy()
    (journal / ".sm120kit" / "journal.json").write_text("{not json")
    s = lambda site: ["--site", site]  # noqa: E731
    return [
        (
            "ledger path ../outside/victim.txt: unpatch",
            ["unpatch", *s(edit_ledger(sites.copy(), lambda d, e: moved(d, e, "../outside/victim.txt")))],
            {},
            2,
        ),
        (
            "ledger absolute path: unpatch --force",
            [
                "unpatch",
                "--force",
                *s(edit_ledger(sites.copy(), lambda d, e: moved(d, e, str(outside / "victim.txt")))),
            ],
            {},
            2,
        ),
        (
            'ledger "patches" a string: unpatch',
            ["unpatch", *s(edit_ledger(sites.copy(), lambda d, e: e.update(patches="x")))],
            {},
            2,
        ),
        (
            'ledger "patches" a string: status',
            ["status", *s(edit_ledger(sites.copy(), lambda d, e: e.update(patches="x")))],
            {},
            2,
        ),
        (
            "ledger revision a string: patch",
            [
                "patch",
                *s(edit_ledger(sites.copy(), lambda d, e: e.update(patches={"sglang-dsa-page-table-guard": "1"}))),
            ],
            {},
            2,
        ),
        (
            "ledger vendor hash a path: unpatch",
            ["unpatch", *s(edit_ledger(sites.copy(), lambda d, e: e.update(vendor_sha256="../../etc/passwd")))],
            {},
            2,
        ),
        (
            "ledger schema 99: status",
            ["status", *s(edit_ledger(sites.copy(), lambda d, e: d.update(schema=99)))],
            {},
            2,
        ),
        (
            "ledger a list: patch --verify",
            ["patch", "--verify", *s(edit_ledger(sites.copy(), lambda d, e: d.clear()))],
            {},
            2,
        ),
        ("backups a symlink out: unpatch", ["unpatch", *s(symlinked_backups())], {}, 2),
        ("state dir a symlink out: patch", ["patch", *s(symlinked_state())], {}, 2),
        ("journal not JSON: patch", ["patch", *s(journal)], {}, 2),
        (
            "RECORD with non-UTF-8 bytes: status",
            ["status", *s(damaged("RECORD", b"", b"caf\xe9.py,sha256=\xff,1\n"))],
            {},
            1,
        ),
        (
            "METADATA version not PEP 440: status",
            ["status", *s(damaged("METADATA", b"Version: 0.5.23", b"Version: 0.5.23 custom"))],
            {},
            2,
        ),
        ("--python that does not exist", ["status", "--python", tmp / "nope"], {}, 2),
        ("--python that fails", ["status", "--python", bad_python], {}, 2),
        ("--python and --site", ["status", "--python", sys.executable, "--site", sites.vendor], {}, 2),
        ("--site that does not exist", ["status", "--site", tmp / "nope"], {}, 2),
        ("--only unknown id", ["patch", "--only", "nope", *s(sites.vendor)], {}, 2),
        ("--allow-missing unknown id", ["patch", "--allow-missing", "nope", *s(sites.vendor)], {}, 2),
        ("--patch-dir that does not exist", ["status", "--patch-dir", tmp / "nope", *s(sites.vendor)], {}, 2),
        ("doctor --root of an empty directory", ["doctor", "--root", outside], {}, 2),
        ("doctor --nvml with wrong types", ["doctor", "--nvml", _json(tmp / "nvml.json", {"gpus": "x"})], {}, 2),
        ("doctor --nvml not JSON", ["doctor", "--nvml", _json(tmp / "nvml2.json", None)], {}, 2),
    ]


def _json(path: Path, doc) -> Path:
    path.write_text("{" if doc is None else json.dumps(doc))
    return path


def serve_cases(tmp: Path) -> list[tuple[str, list, dict, int]]:
    (tmp / "env").mkdir()
    py = make_env_python(tmp / "env", "0.5.23")
    log = tmp / "x.log"
    log.write_text("hello\n")
    cases = []
    for value in (
        "health.stop_timeout_s=inf",
        "health.startup_timeout_s=nan",
        "health.probe_interval_s=-1",
        "health.probe_timeout_s=1e300",
        "parallel.tp=0",
        "server.port=0",
        "engine.mem_fraction_static=nan",
        "engine.max_running_requests=-5",
        "engine.chunked_prefill_size=0",
        "health.max_restarts=-1",
        "extra_args.--x=nan",
        "node.gpus=100000",
    ):
        cases.append((f"--set {value}", ["profile", "show", "glm5-nvfp4", "--set", value], {}, 2))
    for opt, value in (
        ("--threshold", "inf"),
        ("--threshold", "0"),
        ("--input-len", "0"),
        ("--output-len", "-1"),
        ("--prompts-per-level", "nan"),
        ("--concurrency", "64,10000000"),
    ):
        cases.append((f"bench {opt} {value}", ["bench", "--url", "http://127.0.0.1:9", opt, value], {}, 2))
    cases += [(f"diagnose --tail {v}", ["diagnose", log, "--tail", v], {}, 2) for v in ("0", "-5")]
    cases.append(("serve sm120-base (no model)", ["serve", "sm120-base", "--dry-run", "--python", py], {}, 2))
    cases.append(("profile check sm120-base", ["profile", "check", "sm120-base", "--python", py], {}, 2))
    for flag, value in (("--host", "0.0.0.0"), ("--api-key", SECRET), ("--tensor-parallel-size", "4")):
        cases.append(
            (
                f"extra_args {flag}",
                ["serve", "glm5-nvfp4", "--dry-run", "--python", py, "--set", f"extra_args.{flag}={value}"],
                {},
                2,
            )
        )
    check = [
        "serve",
        "standin",
        "--profile-dir",
        PROFILES,
        "--python",
        py,
        "--no-gpu-check",
        "--set",
        "server.api_key_env=K",
        "--check",
    ]
    for label, key in (("ending in \\r", SECRET + "\r"), ("0", "0"), ("of 7 characters", "sk-1234")):
        cases.append((f"serve --check, API key {label}", check, {"K": key}, 1))
    return cases


# -- issue 25, items 9, 10, 32, 31 (the rest): URLs, what render writes, ps records, server_args --


def first_day_cases(tmp: Path) -> list[tuple[str, list, dict, int]]:
    """Every URL option through the one parser; every value render writes (User=, control
    characters, Kubernetes names, docker's volume paths); run records with odd values; a
    target whose server_args module is garbage."""
    root = tmp / "first-day"
    root.mkdir()
    cases = []
    for url in (
        "http://[::1",
        "http://[::1]x:30000",
        "http://::1:30000",
        "http://[nope]:30000",
        "http://127.0.0.1:30000/v1",
        "http://127.0.0.1:30000?x=1",
        "http://user:pw@127.0.0.1:30000",
        "http://127.0.0.1:30000\n",
        "http://127.0.0.1 :30000",
        "http://127.0.0.1",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:abc",
        "ftp://127.0.0.1:30000",
        "",
    ):
        for command in ("smoke", "bench"):
            cases.append((f"{command} --url {url!r}", [command, "--url", url], {}, 2))
        if url:
            replica = ["--set", f"fleet.replica=[{{url={json.dumps(url)}}}]", "--set", "fleet.replicas=1"]
            cases.append(
                (
                    f"fleet replica url {url!r}",
                    ["profile", "show", "standin-fleet", "--profile-dir", PROFILES, *replica],
                    {},
                    2,
                )
            )
    for key, value in (("server.host", "a b"), ("server.host", "[::1"), ("fleet.replica_host", "10.0.0.1/24")):
        sets = ["--set", f"{key}={value}", "--set", "server.api_key_env=K"]
        cases.append(
            (f"--set {key}={value!r}", ["profile", "show", "standin-fleet", "--profile-dir", PROFILES, *sets], {}, 2)
        )
    node = ["--set", 'fleet.replica=[{node="10.0.0.7/x", port=30001}]', "--set", "fleet.replicas=1"]
    cases.append(
        (
            "fleet replica node '10.0.0.7/x'",
            ["profile", "show", "standin-fleet", "--profile-dir", PROFILES, *node],
            {},
            2,
        )
    )

    render = ["render", "systemd", "glm5-nvfp4"]
    for user in ("root;rm -rf /", "sglang\nExecStartPre=/bin/sh", "65535", "0100", "a/b", "-x", "a" * 32):
        cases.append((f"render systemd --unit-user {user!r}", [*render, f"--unit-user={user}"], {}, 2))
    for target, option, value in (
        ("systemd", "--env-file", "/etc/k.env\nExecStartPre=/bin/sh"),
        ("systemd", "--state-dir", "/var/lib/s\rx"),
        ("systemd", "--sm120kit", "/opt/bin/sm120kit\nx"),
        ("systemd", "--python", "/opt/bin/python\nx"),
        ("systemd", "--profile-dir", "/etc/p\nx"),
        ("systemd", "--patch-dir", "/etc/q\x1bx"),
        ("docker", "--image", "img\nx"),
        ("docker", "--env-file", "/etc/k.env\nx"),
        ("docker", "--state-dir", "/var/lib/a:b"),
        ("docker", "--image-python", "/opt/python\u2028x"),
        ("k8s", "--image-python", "python3\nx"),
        ("k8s", "--hf-cache-host-path", "/models\nx"),
        ("k8s", "--secret", "My_Key"),
        ("k8s", "--hf-cache-claim", "-cache"),
    ):
        image = ["--image", "img"] if target != "systemd" and option != "--image" else []
        cases.append(
            (
                f"render {target} {option} {value!r}",
                ["render", target, "glm5-nvfp4", f"{option}={value}", *image],
                {},
                2,
            )
        )
    cases.append(("render systemd NAME with a newline", ["render", "systemd", "glm5-nvfp4\nUser=root"], {}, 2))
    for target in ("systemd", "docker", "k8s"):
        image = ["--image", "img"] if target != "systemd" else []
        for setting in ("model.served_name=a\rUser=root", "env.HF_HOME=/x\n[Service]"):
            cases.append(
                (
                    f"render {target} --set {setting!r}",
                    ["render", target, "glm5-nvfp4", "--set", setting, *image],
                    {},
                    2,
                )
            )

    good = {"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "host": "127.0.0.1", "port": 30000}
    for label, fields in (
        ("a negative pid", {"supervisor_pid": -5}),
        ("a pid past pid_max", {"supervisor_pid": 2**40}),
        ("a negative server pid", {"server_pid": -3}),
        ("an infinite since", {"since": float("inf")}),
        ("a NaN since", {"since": float("nan")}),
        ("a since before 1970", {"since": -1e18}),
        ("a since far ahead", {"since": 1e300}),
        ("a NaN supervisor_started", {"supervisor_started": float("nan")}),
        ("last_health at a word", {"last_health": {"at": "yesterday", "ok": True}}),
        ("last_health at infinity", {"last_health": {"at": float("inf"), "ok": True}}),
        ("last_health ok a word", {"last_health": {"ok": "yes"}}),
        ("last_health a list", {"last_health": [True]}),
    ):
        state = root / "state" / label.replace(" ", "-")
        record = state / "serve" / "glm5-nvfp4" / "state.json"
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({**good, **fields}))
        cases.append((f"ps over a record with {label}", ["ps"], {"SM120KIT_STATE_DIR": str(state)}, 2))

    vendor = root / "vendor" / "site-packages"
    vendor.mkdir(parents=True)
    install(vendor, "0.5.23", flashinfer=False)
    for label, data in (
        ("not Python", b"def (:\n"),
        ("NUL bytes", b"x = 1\x00\n"),
        ("not UTF-8", b'x = "\xff"\n'),
        ("a binary", bytes(range(256)) * 4),
        ("nested too deep", b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n"),
    ):
        site = root / label.replace(" ", "-") / "site-packages"
        shutil.copytree(vendor, site, symlinks=True)
        (site / "sglang" / "srt" / "server_args.py").write_bytes(data)
        for argv in (["serve", "glm5-nvfp4", "--dry-run"], ["profile", "check", "glm5-nvfp4"]):
            cases.append((f"{' '.join(argv[:2])}: server_args.py {label}", [*argv, "--site", site], {}, 2))
    return cases


# -- issue 25, items 24-30: I/O errors at every step of a transaction, a failure after the --
# -- commit, patch modules that exit at import, paths too long, deep JSON and source files,  --
# -- binary and non-UTF-8 target files                                                        --

# What strace makes each kind of step fail with: a disk that errs, a full one (blocks or
# inodes), a read-only one.
FAULTS = {
    "write": ("EIO", "ENOSPC"),
    "fsync": ("EIO", "ENOSPC"),
    "rename": ("EIO", "EROFS"),
    "unlink": ("EIO", "EROFS"),
    "openat": ("ENOSPC", "EROFS"),  # a file created: out of inodes, read-only
}
TMP_SUFFIX = ".sm120kit-tmp"
STEP = re.compile(r"^\d+\s+(write|fsync|rename|unlink|openat)\((.*)\)\s+=\s+(-?\d+)")


def traced_steps(command: str, site: Path, env: dict, cwd: Path) -> list[tuple[str, int, str, int]]:
    """(syscall, its number among the run's calls of it, path, the exit code it must give
    when it fails) of every step of `sm120kit COMMAND --site SITE` that writes under the
    site, and its first write to stdout. Failing before the ledger's rename (the commit) is
    exit 2, nothing changed; after it, exit 4, the change made. Not counted: the fsync of a
    directory and the removal of an emptied state directory, which are best effort. The
    numbers hold for a run with the same environment and working directory (the imports
    that open files depend on them)."""
    trace = site.parent / "strace.out"
    argv = ["strace", "-f", "-y", "-o", trace, "-e", f"trace={','.join(FAULTS)}"]
    assert sm120kit([command, "--site", site], env, cwd=cwd, prefix=argv).returncode == 0
    seen: dict[str, int] = {}
    steps, commit, stdout = [], None, False
    for line in trace.read_text().splitlines():
        match = STEP.match(line)
        if not match:
            continue
        call, args, _ = match.groups()
        seen[call] = n = seen.get(call, 0) + 1
        paths = re.findall(r'(?:<|")(/[^<>"]*)(?:>|")', args)
        if call == "write" and args.startswith("1<") and not stdout:
            stdout = True
            steps.append((call, n, "stdout", len(steps)))
            continue
        path = paths[-1] if paths else ""
        if not path.startswith(f"{site}/") or (call == "openat" and "O_CREAT" not in args):
            continue
        if call == "fsync" and not path.endswith(TMP_SUFFIX):  # a directory's (write_atomic fsyncs its temp file)
            continue
        if call == "rename" and path == f"{site}/.sm120kit/ledger.json":
            commit = len(steps)
        if call == "unlink" and commit is not None and path.endswith(("/.sm120kit/ledger.json", "/.sm120kit/lock")):
            continue
        steps.append((call, n, path.removeprefix(f"{site}/"), len(steps)))
    assert commit is not None, f"{command}: no commit in {trace}"
    return [(call, n, path, 2 if i <= commit else 4) for call, n, path, i in steps]


def io_fault_cases(sites: Sites, tmp: Path) -> list[tuple]:
    """Items 24 and 25: every write, fsync, rename, unlink and create of `patch` and
    `unpatch` (sglang 0.5.23, every shipped patch: six files) made to fail by strace, and
    stdout a full device."""
    cases: list[tuple] = []
    if not shutil.which("strace"):
        print("note: strace is not installed (apt-get install strace): the injected I/O errors are left out")
    else:
        for command, patched in (("patch", False), ("unpatch", True)):
            # The environment main() runs every case in, made to open and write the same files in every
            # run: an outcome cache that only this command's runs fill, a bytecode cache of their own
            # that the first run fills (a stale .pyc would have each run read the source as well).
            env = {"SM120KIT_STATE_DIR": str(tmp / "state"), "SM120KIT_CACHE_DIR": str(tmp / f"cache-{command}")}
            env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
            sm120kit([command, "--site", sites.copy(patched)], env, cwd=tmp)
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            for call, n, path, want in traced_steps(command, sites.copy(patched), env, tmp):
                for err in FAULTS[call]:
                    strace = ["strace", "-f", "-o", os.devnull, "-e", f"trace={call}"]
                    strace += ["-e", f"inject={call}:error={err}:when={n}"]
                    label = f"{command}: {err} at {call} #{n} ({path})"
                    cases.append((label, [command, "--site", sites.copy(patched)], env, want, strace))
    full = ["sh", "-c", 'exec "$@" >/dev/full', "sh"]
    cases.append(("patch > /dev/full", ["patch", "--site", sites.copy(patched=False)], {}, 4, full))
    cases.append(("unpatch > /dev/full", ["unpatch", "--site", sites.copy()], {}, 4, full))
    for argv in (["status"], ["patch", "--check"], ["patch", "--json"]):
        cases.append((f"{' '.join(argv)} > /dev/full (nothing to do)", [*argv, "--site", sites.copy()], {}, 2, full))
    cases.append(("patches > /dev/full", ["patches"], {}, 2, full))
    return cases


def first_day_input_cases(sites: Sites, tmp: Path) -> list[tuple]:
    """Items 26, 28, 29, 30."""
    root = tmp / "items-26-30"
    root.mkdir()
    cases: list[tuple] = []
    for name, body in (
        ("sys.exit(0)", "import sys\nsys.exit(0)\n"),
        ("sys.exit('bye')", "raise SystemExit('bye')\n"),
        ("KeyboardInterrupt", "raise KeyboardInterrupt\n"),
        ("GeneratorExit", "raise GeneratorExit\n"),
    ):
        mine = root / f"patches-{len(cases)}"
        (mine / "sglang").mkdir(parents=True)
        (mine / "sglang" / "exits.py").write_text(body)
        for argv in (["patch", "--verify", "--site", sites.copy(patched=False)], ["patches"], ["status"]):
            cases.append((f"patch module raising {name} at import: {argv[0]}", [*argv, "--patch-dir", mine], {}, 2))

    long_name, long_path = "/tmp/" + "n" * 300, "/tmp/" + "d/" * 2100
    for value in (long_name, long_path):
        what = "a 300-byte name" if value == long_name else "a 4205-byte path"
        for argv in (
            ["status", "--site", value],
            ["status", "--python", value],
            ["profile", "check", "glm5-nvfp4", "--site", value],
            ["patch", "--json", "--site", value],
            ["unpatch", "--site", value],
            ["patches", "--patch-dir", value],
            ["profiles", "--profile-dir", value],
            ["doctor", "--nvml", value],
            ["diagnose", value],
        ):
            cases.append((f"{what}: {' '.join(argv[:-1])}", argv, {}, 2))

    deep_list, deep_object = "[" * 100_000 + "]" * 100_000, '{"a": ' * 50_000 + "1" + "}" * 50_000
    for label, doc in (("a deep list", deep_list), ("a deep object", deep_object)):
        site = sites.copy()
        (site / ".sm120kit" / "ledger.json").write_text(doc)
        for argv in (["status"], ["patch"], ["unpatch"], ["patch", "--verify"]):
            cases.append((f"ledger {label}: {' '.join(argv)}", [*argv, "--site", site], {}, 2))
        site = sites.copy()
        (site / ".sm120kit" / "journal.json").write_text(doc)
        cases.append((f"journal {label}: patch", ["patch", "--site", site], {}, 2))
        cases.append((f"journal {label}: status", ["status", "--site", site], {}, 2))
        state = root / f"state-{len(cases)}"
        (state / "serve" / "glm5-nvfp4").mkdir(parents=True)
        (state / "serve" / "glm5-nvfp4" / "state.json").write_text(doc)
        cases.append((f"state.json {label}: ps", ["ps"], {"SM120KIT_STATE_DIR": str(state)}, 2))
        document = root / f"doc-{len(cases)}.json"
        document.write_text(doc)
        cases.append((f"--nvml {label}", ["doctor", "--nvml", document], {}, 2))
        tune = ["tune-moe", "kimi-k2-int4-triton", "--plan", "--site", sites.vendor, "--model-config", document]
        cases.append((f"--model-config {label}", tune, {}, 2))

    for label, tail in (
        ("200 000 nested parentheses", b"x = " + b"(" * 100_000 + b")" * 100_000 + b"\n"),
        ("a chain of 50 000 operators", b"x = " + b"+".join([b"1"] * 50_000) + b"\n"),
        ("5 000 nested lambdas", b"x = " + b"lambda: " * 5_000 + b"1\n"),
        ("a syntax error, then 50 000 unary minus", b"def (:\n" + b"x = " + b"-" * 50_000 + b"1\n"),
    ):
        site = sites.copy(patched=False)
        (site / DSA_FILE).write_bytes((site / DSA_FILE).read_bytes() + tail)
        cases.append((f"target file with {label}: status", ["status", "--site", site], {}, 2))
        cases.append((f"target file with {label}: patch", ["patch", "--site", site], {}, 2))

    for label, data in (
        ("a binary", bytes(range(256)) * 16),
        ("NUL bytes", b"x = 1\n\0y = 2\n"),
        ("latin-1 in a comment", b"x = 1\n# caf\xe9\n"),
        ("latin-1 on the first line", b"x = 'caf\xe9'\n"),
        ("an unknown encoding", b"# -*- coding: nosuch -*-\nx = 1\n"),
    ):
        for patched in (False, True):
            site = sites.copy(patched)
            (site / DSA_FILE).write_bytes(data)
            state = "patched" if patched else "vendor"
            for argv in (["status"], ["patch", "--check"], ["patch"], ["unpatch"] if patched else ["patch", "--diff"]):
                cases.append((f"target file {label} ({state}): {' '.join(argv)}", [*argv, "--site", site], {}, 2))
    return cases


# -- issue 31: user directories that are not what they say, a user patch's range, a deep --
# -- site answer, a user's survey entry that says nothing                                  --


def truth_cases(sites: Sites, tmp: Path) -> list[tuple]:
    root = tmp / "truth"
    root.mkdir()
    cases: list[tuple] = []
    survey_dir = root / "survey-a-dir"
    (survey_dir / "known-failures.toml").mkdir(parents=True)
    on_site = ["--site", sites.vendor]
    for argv in (
        ["known-failures"],
        ["serve", "glm5-nvfp4", "--dry-run", *on_site],
        ["profile", "check", "glm5-nvfp4", *on_site],
    ):
        cases.append((f"{argv[0]}: known-failures.toml a directory", [*argv, "--patch-dir", survey_dir], {}, 2))
    a_file = root / "a-file"
    a_file.write_text("x\n")
    cases.append(("--profile-dir a file", ["profiles", "--profile-dir", a_file], {}, 2))
    cases.append(("--patch-dir a file", ["patches", "--patch-dir", a_file], {}, 2))
    source = (ROOT / "tests" / "fixtures" / "patches" / "sglang" / "version_marker.py").read_text()
    for label, bad in (
        (
            "range",
            source.replace('Rewrite("sglang/version.py", ">=0.5.9,<0.5.24"', 'Rewrite("sglang/version.py", "banana"'),
        ),
        ("fixed_in", source.replace("    summary=", '    fixed_in="banana",\n    summary=')),
    ):
        assert bad != source, f"the fixture patch changed: the {label} case no longer plants its mistake"
        mine = root / f"patch-{label}"
        (mine / "sglang").mkdir(parents=True)
        (mine / "sglang" / "bad.py").write_text(bad)
        for argv in (["patches"], ["status", "--site", sites.vendor], ["patch", "--site", sites.copy(patched=False)]):
            cases.append((f"user patch {label} 'banana': {argv[0]}", [*argv, "--patch-dir", mine], {}, 2))
    deep = root / "python-deep"
    deep.write_text("#!/bin/sh\ncat <<'EOF'\n" + "[" * 100_000 + "]" * 100_000 + "\nEOF\n")
    deep.chmod(0o755)
    cases.append(("--python answering deeply nested JSON", ["status", "--python", deep], {}, 2))
    for label, text in (
        ("neither a symptom nor a rule", '[[failure]]\nid = "ours-1"\naffected = ">=0.5.20"\n'),
        ("no range", '[[failure]]\nid = "ours-2"\nsymptom = "boom"\n'),
        ("a range PEP 440 cannot read", '[[failure]]\nid = "ours-3"\naffected = "banana"\nsymptom = "boom"\n'),
    ):
        mine = root / f"survey-{label.replace(' ', '-')}"
        mine.mkdir()
        (mine / "known-failures.toml").write_text(text)
        cases.append((f"user survey entry with {label}", ["known-failures", "--patch-dir", mine], {}, 2))
    return cases


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="sm120kit-bad-inputs-"))
    try:
        state = {"SM120KIT_STATE_DIR": str(tmp / "state")}
        sites = Sites(tmp)
        cases = patch_cases(sites, tmp) + serve_cases(tmp) + first_day_cases(tmp)
        cases += io_fault_cases(sites, tmp) + first_day_input_cases(sites, tmp) + truth_cases(sites, tmp)
        tally = {"tried": 0, "clear": 0, "traceback": 0, "internal error": 0, "signal": 0, "wrong exit code": 0}
        for label, argv, env, want, *prefix in cases:
            proc = sm120kit(argv, {**state, **env}, cwd=tmp, prefix=prefix[0] if prefix else ())
            text = proc.stdout + proc.stderr
            internal = "internal error" in text or "Traceback" in text
            tally["traceback"] += "Traceback" in text
            tally["signal"] += proc.returncode < 0  # killed by one (strace passes the tracee's on)
            clear = (
                not internal
                and SECRET not in text
                and proc.returncode == want
                and any(w in text for w in ("error", "FAIL", "warning", "foreign-edit", "anchor-missing"))
            )
            tally["tried"] += 1
            tally["clear"] += clear
            tally["internal error"] += internal
            tally["wrong exit code"] += proc.returncode != want
            said = next(
                (line for line in text.splitlines() if any(w in line for w in ("error", "FAIL", "warning"))), ""
            )
            print(f"{'ok ' if clear else 'BAD'} exit {proc.returncode} (want {want})  {label}: {said.strip()[:140]}")
        print(" / ".join(f"{n} {k}" for k, n in tally.items()))
        return 0 if tally["clear"] == tally["tried"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
