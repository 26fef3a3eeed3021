"""Serving the sglang stand-in (TEST FIXTURE, fixtures/sglang_standin.py) with `sm120kit
serve` in a process of its own (one server, or a fleet behind the real router), and the
python that runs it (and the benchmark client stand-in): used by tests/serve/,
test_fleet.py, test_bench.py and scripts/bench_serve.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from support.paths import FIXTURES
from support.sites import install

STANDIN = FIXTURES / "sglang_standin.py"
CLIENT_STANDIN = FIXTURES / "bench_serving_standin.py"
PROFILES = FIXTURES / "profiles"
# The replicas of the standin-fleet profile (fixtures/profiles).
REPLICAS = ("replica-0", "replica-1", "replica-2")


def make_env_python(root: Path, version: str) -> Path:
    """A python whose environment has sglang==version (its real files) and whose
    `-m sglang.launch_server` is the stand-in (its module too)."""
    site = root / "site-packages"
    site.mkdir()
    install(site, version, flashinfer=False)
    # sglang's own launch_server.py is not unpacked (its imports need torch): the stand-in's,
    # whose imports are what serve's preflight reads (sm120kit.node.checks.imports)
    (site / "sglang" / "launch_server.py").write_text(
        "# TEST FIXTURE: the stand-in is this environment's sglang server.\n"
        f"import runpy\n\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    shim = root / "python"
    shim.write_text(
        f"#!{sys.executable}\n"
        "# TEST FIXTURE: the serving environment's python, with the stand-ins as sglang's server and client.\n"
        "import os, sys\n"
        f"exe = {sys.executable!r}\n"
        'if sys.argv[1:3] == ["-m", "sglang.launch_server"]:\n'
        f"    os.execv(exe, [exe, {str(STANDIN)!r}, *sys.argv[1:]])\n"
        'if sys.argv[1:2] == ["-m"] and sys.argv[2] in ("sglang.bench_serving", "sglang.benchmark.serving"):\n'
        f"    os.execv(exe, [exe, {str(CLIENT_STANDIN)!r}, *sys.argv[3:]])\n"
        f'os.environ["PYTHONPATH"] = {str(site)!r}\n'
        "os.execv(exe, [exe, *sys.argv[1:]])\n"
    )
    shim.chmod(0o755)
    return shim


def foreign_server(root: Path, port: int, tp: int = 1, env: dict | None = None) -> subprocess.Popen:
    """A server someone else started by hand, `sglang serve` (the console script: the
    launcher's command line is `python .../bin/sglang serve ...`), with the stand-in as
    sglang: a launcher, its schedulers and a detokenizer. Not a child of any sm120kit."""
    script = root / "bin" / "sglang"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\n"
        "# TEST FIXTURE: sglang's console script, with the stand-in as sglang.\n"
        "import runpy, sys\n"
        f"sys.argv = [{str(STANDIN)!r}, *sys.argv[2:]]\n"
        f"runpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    script.chmod(0o755)
    argv = [str(script), "serve", "--model-path", "someone/else", "--port", str(port), "--tp-size", str(tp)]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "SGLANG_STANDIN": "{}", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 20
    while len([c for c in launcher.children() if c.cmdline()[:1] and c.cmdline()[0].startswith("sglang::")]) < tp + 1:
        if time.monotonic() > deadline:
            raise AssertionError("the foreign server's schedulers did not start")
        time.sleep(0.05)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One `sm120kit serve` process and its run directory."""

    def __init__(
        self,
        tmp_path: Path,
        python: Path,
        faults: dict,
        sets: list[str],
        extra: list[str],
        env: dict,
        profile: str = "standin",
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.port = free_port()
        self.state = tmp_path / "state"
        self.dir = self.state / "serve" / profile
        self.token = uuid.uuid4().hex
        self.pids = tmp_path / f"standin-pids-{self.token[:6]}"
        self.env = {
            **os.environ,
            "SM120KIT_STATE_DIR": str(self.state),
            "SGLANG_STANDIN": json.dumps(faults),
            "STANDIN_PIDS": str(self.pids),
            **env,
        }
        self.argv = [
            sys.executable,
            "-m",
            "sm120kit",
            "serve",
            profile,
            "--python",
            str(python),
            "--profile-dir",
            str(PROFILES),
            "--no-gpu-check",
            "--set",
            f"server.port={self.port}",
            *(a for s in sets for a in ("--set", s)),
            *extra,
        ]
        self.out_path = tmp_path / f"supervisor-{self.token[:6]}.out"
        self.proc: subprocess.Popen | None = None
        self.started_at = time.time()

    def start(self) -> Served:
        self.out_file = open(self.out_path, "w")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=self.out_file, stderr=subprocess.STDOUT, env=self.env)
        return self

    def run(self, timeout: float = 60) -> tuple[int, str]:
        """Run to the end (a crash loop that gives up, a refusal)."""
        proc = subprocess.run(self.argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr

    @property
    def output(self) -> str:
        return self.out_path.read_text() if self.out_path.exists() else ""

    def events(self, kind: str | None = None) -> list[dict]:
        path = self.dir / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found = [json.loads(line) for line in lines]
        return [e for e in found if kind is None or e["event"] == kind]

    def wait(self, kind: str, count: int = 1, timeout: float = 120) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.events(kind)
            if len(found) >= count:
                return found[count - 1]
            if self.proc and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"no {kind!r} event (#{count}) in time; events: {[e['event'] for e in self.events()]}\n{self.output}"
        )

    def signal(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def ours(self) -> list[psutil.Process]:
        """Every live process of the stand-in started for this test: each notes its pid in
        the file (setproctitle leaves nothing readable in /proc/PID/environ)."""
        found = []
        for pid in sorted({int(n) for n in self.pids.read_text().split()} if self.pids.exists() else ()):
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and p.create_time() >= self.started_at - 1:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def cleanup(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.ours():
            p.kill()
        if self.proc:
            self.out_file.close()


class Fleet(Served):
    """`sm120kit serve standin-fleet` with a free port for the router and each replica."""

    def __init__(self, tmp_path: Path, python: Path, faults: dict, sets=(), extra=(), replica_ports=None) -> None:
        self.replica_ports = replica_ports or [free_port() for _ in REPLICAS]
        self.requests_log = tmp_path / "requests.jsonl"
        self.metrics_port = free_port()
        ports = ", ".join(f"{{port={p}}}" for p in self.replica_ports)
        super().__init__(
            tmp_path,
            python,
            {"requests_log": str(self.requests_log), **faults},
            [f"fleet.replica=[{ports}]", f"fleet.router.prometheus_port={free_port()}", *sets],
            ["--metrics-port", str(self.metrics_port), *extra],
            {},
            profile="standin-fleet",
        )

    def member_state(self, name: str) -> dict:
        return json.loads((self.dir / name / "state.json").read_text())

    def answered(self) -> list[dict]:
        lines = self.requests_log.read_text().splitlines() if self.requests_log.exists() else []
        return [json.loads(line) for line in lines]

    def generations_by_port(self) -> dict[int, int]:
        done: dict[int, int] = {}
        for e in self.answered():
            if e["path"] == "/generate" and e["event"] == "end":
                done[e["port"]] = done.get(e["port"], 0) + 1
        return done

    def metrics(self) -> dict[tuple[str, str], float]:
        """(metric sample name, member) -> value, from our own /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, s.labels.get("member", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if "status" not in s.labels
        }

    def routed(self, name: str) -> int:
        return sum(1 for e in self.events("routed") if e.get("member") == name)
