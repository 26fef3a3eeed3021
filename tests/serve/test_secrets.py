"""The API key (sm120kit.serve.scrub and the key's way through serve): a server's output
with the key written as "$NAME", and the key never in a record, a process title, a repr or
an error, yet reaching the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from support.node import check_inputs as inputs
from support.serve import SECRET, profile, ps

from sm120kit.node.check import Status
from sm120kit.node.checks import serving
from sm120kit.serve import procs
from sm120kit.serve.machine import Policy, ServerSpec
from sm120kit.serve.scrub import held_back


def test_api_key_reaches_the_server_and_never_the_record(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret}).start()
    s.wait("ready")
    import http.client

    def models(key: str | None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        return conn.getresponse().status

    assert models(secret) == 200 and models(None) == 401
    launcher = psutil.Process(s.events("started")[0]["pid"])
    key_file = s.dir / "api-key.yaml"
    assert (
        secret not in " ".join(launcher.cmdline()) and str(key_file) in launcher.cmdline()
    )  # the process list shows a path
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert s.signal() == 0
    assert not key_file.exists()
    assert secret in (s.dir / "server.log").read_text()  # sglang's own server_args line: the directory is private
    assert s.dir.stat().st_mode & 0o777 == 0o700
    record = "".join(
        p.read_text()
        for p in s.dir.iterdir()
        if p.is_file() and not p.name.startswith(("server.log", "supervisor.lock"))
    )
    assert secret not in record and secret not in s.output  # events, state and the live tail say $STANDIN_KEY
    assert s.events("started")[0]["argv"][-2:] == ["--config", str(key_file)] and "api_key='$STANDIN_KEY'" in s.output


@pytest.mark.preflight
def test_an_api_key_with_a_trailing_carriage_return_is_refused_and_never_printed(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret + "\r"})
    code, out = s.run()
    assert code == 2 and "FAIL api key: $STANDIN_KEY ends with a carriage return" in out, out
    assert secret not in out and "Traceback" not in out and not s.events("started")


def test_a_key_that_is_also_part_of_the_record_leaves_the_record_intact(serve):
    """Redaction by text substitution once rewrote state.json ("host": "127.$KEY.$KEY.1")."""
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": "127.0.0.1"}).start()
    s.wait("ready")
    code, doc, _ = ps(s)
    [run] = doc["runs"]
    assert code == 0 and run["host"] == "127.0.0.1" and run["status"] == "ready" and run["running"]
    assert s.events("started")[0]["argv"][-2:] == ["--config", str(s.dir / "api-key.yaml")]
    assert s.signal() == 0


def test_a_key_file_left_by_a_killed_supervisor_is_removed_by_the_next_start(serve):
    secret = "sk-" + uuid.uuid4().hex
    s = serve(sets=["server.api_key_env=STANDIN_KEY"], env={"STANDIN_KEY": secret}).start()
    s.wait("ready")
    key_file = s.dir / "api-key.yaml"
    s.proc.kill()  # SIGKILL: no finally runs
    s.proc.wait()
    assert secret in key_file.read_text()  # what it leaves behind
    again = serve(sets=["server.api_key_env=STANDIN_KEY_UNSET"])  # the next start (refused later by its preflight)
    again.env["SM120KIT_STATE_DIR"] = str(s.state)
    code, out = again.run()
    assert code == 2 and not key_file.exists(), out
    assert f"removed the API key file that a killed supervisor left behind: {key_file}" in out


@pytest.mark.preflight
def test_api_key_variable_unset_is_refused(serve):
    code, out = serve(sets=["server.api_key_env=STANDIN_KEY_UNSET"]).run()
    assert (
        code == 2
        and "FAIL api key: server.api_key_env = STANDIN_KEY_UNSET, but $STANDIN_KEY_UNSET is empty or not set" in out
    )


def test_api_keys_are_masked_in_process_titles():
    assert procs._title(["python", "-m", "sglang.launch_server", "--api-key", "sk-1", "--admin-api-key=sk-2"], "x") == (
        "python -m sglang.launch_server --api-key *** --admin-api-key=***"
    )


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (SECRET + "\r", "a carriage return"),
        (SECRET + "\n", "a newline"),
        (SECRET + "\r\n", "a carriage return"),
        (" " + SECRET, "a space"),
        (SECRET[:6] + "\t" + SECRET[6:], "a tab"),
        (SECRET + "\x00", "a control character"),
        (SECRET + "é", "a non-ASCII character"),
    ],
)
def test_an_api_key_that_is_not_one_printable_word_is_refused(key, says):
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": key}))
    assert check.status is Status.FAIL and says in check.detail and "$K" in check.detail
    assert SECRET not in check.detail + check.fix and "tr -d" in check.fix


def test_a_good_api_key_passes():
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": SECRET}))
    assert check.status is Status.OK and SECRET not in check.detail


def test_a_probe_with_a_key_that_breaks_the_header_fails_without_raising_or_telling_the_key():
    from sm120kit.serve.probe import probe

    with socket.socket() as listener:  # a port of our own that accepts: nothing of the host's
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        result = probe("127.0.0.1", listener.getsockname()[1], 1.0, api_key=SECRET + "\r")
    assert result.ok is False and result.status is None
    assert SECRET not in result.detail and "\r" not in result.detail


def test_an_error_that_mentions_the_key_is_reraised_without_it():
    import traceback

    from sm120kit.serve.command import keep_secret

    with pytest.raises(RuntimeError) as info, keep_secret(SECRET, "$K"):
        try:
            raise OSError(f"header Bearer {SECRET}")
        except OSError:
            raise RuntimeError("wrapped")  # noqa: B904 -- the chained one carries the key
    text = "".join(traceback.format_exception(info.value))
    assert SECRET not in text and "RuntimeError: wrapped" in text
    with pytest.raises(ValueError, match="no key here"), keep_secret(SECRET, "$K"):
        raise ValueError("no key here")


def test_the_record_is_never_rewritten_by_text_substitution(tmp_path):
    """A key that is also a piece of the record ("0") must not turn 127.0.0.1 into
    127.$KEY.$KEY.1: state and events are written as they are; the key is kept out of
    them where it could enter (log lines, argv), not by rewriting the JSON."""
    import json

    from sm120kit.serve.rundir import RunRecord

    record = RunRecord(tmp_path / "run")
    record.secrets["0"] = "$KEY"
    record.update(host="127.0.0.1", port=30000, supervisor_pid=1030)
    record.event("started", pid=10, argv=["--port", "30000"])
    state = json.loads(record.state_file.read_text())
    [event] = [json.loads(line) for line in record.events.read_text().splitlines()]
    assert (state["host"], state["port"], state["supervisor_pid"]) == ("127.0.0.1", 30000, 1030)
    assert (event["pid"], event["argv"]) == (10, ["--port", "30000"])
    assert record.redact("api_key='0'") == "api_key='$KEY'"  # log lines are still redacted


@pytest.mark.parametrize("key", ["0", "sk-1234"])
def test_a_key_too_short_to_be_a_secret_is_refused(key):
    check = serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": key}))
    assert check.status is Status.FAIL and f"{len(key)} character" in check.detail and "at least 8" in check.detail
    assert repr(key) not in check.detail + check.fix
    assert serving.api_key(inputs(profile(server={"api_key_env": "K"}), {"K": "sk-12345"})).status is Status.OK


def test_the_specs_that_carry_the_key_keep_it_out_of_their_repr():
    from sm120kit.bench.client import Sweep

    server = ServerSpec(
        "p", ["x", "--api-key", SECRET], ["x", "--api-key", "$K"], {"K": SECRET}, "127.0.0.1", 1, [], api_key=SECRET
    )
    sweep = Sweep("python", "sglang.benchmark.serving", "http://127.0.0.1:1", 256, 128, 3.0, api_key=SECRET)
    assert SECRET not in repr(server) and "$K" in repr(server) and SECRET not in repr(sweep)


def test_a_key_split_across_two_reads_of_the_log_is_redacted(tmp_path):
    import io

    from sm120kit.serve import supervisor
    from sm120kit.serve.rundir import RunRecord

    server = ServerSpec("p", ["x"], ["x"], {}, "127.0.0.1", 1, [], api_key=SECRET, api_key_env="K")
    out = io.StringIO()
    sup = supervisor.Supervisor(server, Policy.from_health(profile().health), RunRecord(tmp_path / "run"), out=out)
    log = tmp_path / "server.log"
    log.write_text("")
    with open(log, "rb") as fh:
        run = supervisor.Child(None, fh)
        for part in (f"server_args=ServerArgs(api_key='{SECRET[:7]}", f"{SECRET[7:]}', port=1)\n"):
            with open(log, "a") as w:
                w.write(part)
            sup._read_log(run)
    assert SECRET not in out.getvalue() and "api_key='$K', port=1)" in out.getvalue()


def test_the_key_file_replaces_the_key_by_its_place_in_argv_not_its_text(tmp_path):
    """A key that is also another argument ("127.0.0.1", --host's value) once had --config
    replace --host, and left --api-key KEY in the process list."""
    from sm120kit.profiles.render import EnvRef, Launch
    from sm120kit.serve.command import resolve_argv

    launch = Launch(
        ["python3", "-m", "sglang.launch_server", "--host", "127.0.0.1", "--api-key", EnvRef("K")], {}, "0.5.23"
    )
    argv, shown, key = resolve_argv(launch, {"K": "127.0.0.1"}, tmp_path / "api-key.yaml")
    assert argv[3:] == shown[3:] == ["--host", "127.0.0.1", "--config", str(tmp_path / "api-key.yaml")]
    assert key == "127.0.0.1" and '"127.0.0.1"' in (tmp_path / "api-key.yaml").read_text()


KEY = "sk-0123456789abcdef"


def scrub(code: str, **kw) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "sm120kit.serve.scrub", "THE_KEY", "--", sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, env={**os.environ, "THE_KEY": KEY}, timeout=30, **kw)


@pytest.mark.parametrize("split", [1, 3, len(KEY) - 1])
def test_a_key_split_across_writes_is_scrubbed(split):
    code = (
        "import sys, time\n"
        f"sys.stdout.write('server_args=ServerArgs(api_key={KEY[:split]}'); sys.stdout.flush(); time.sleep(0.2)\n"
        f"sys.stdout.write('{KEY[split:]}, port=1)\\n'); sys.stderr.write('again {KEY}\\n')\n"
    )
    done = scrub(code)
    assert done.returncode == 0
    assert KEY.encode() not in done.stdout
    assert b"server_args=ServerArgs(api_key=$THE_KEY, port=1)\n" in done.stdout and b"again $THE_KEY\n" in done.stdout


def test_the_exit_status_is_the_servers():
    assert scrub("import sys; print('bye'); sys.exit(7)").returncode == 7


def test_sigterm_reaches_the_server_which_drains():
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('draining', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True); time.sleep(30)\n"
    )
    argv = [sys.executable, "-m", "sm120kit.serve.scrub", "THE_KEY", "--", sys.executable, "-c", code]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env={**os.environ, "THE_KEY": KEY})
    assert proc.stdout.readline() == b"ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.read() == b"draining\n" and proc.wait(10) == 0


def test_bad_usage_is_exit_2():
    done = subprocess.run([sys.executable, "-m", "sm120kit.serve.scrub", "THE_KEY"], capture_output=True, timeout=30)
    assert done.returncode == 2 and b"usage" in done.stderr


def test_held_back_is_the_longest_end_that_begins_the_key():
    assert held_back(b"abc sk-01", KEY.encode()) == 5
    assert held_back(b"abc", KEY.encode()) == 0
    assert held_back(b"x" + KEY.encode()[:-1], KEY.encode()) == len(KEY) - 1
