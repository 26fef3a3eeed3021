"""sm120kit.serve.scrub: a server's output with the API key written as "$NAME" (a
Kubernetes pod's log), the server's signals and exit status passed through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sm120kit.serve.scrub import held_back

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
