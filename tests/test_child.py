"""sm120kit/child_process.py on real child processes (this interpreter): JSON lines read with
their nesting and length bounded, a deadline that kills the whole process group (a grandchild
that ignores SIGTERM too), what a child leaves running killed when it exits, our own way out
(an exception in the middle of the wait) taking its group with it, no deadlock however much
it writes on both pipes, the exit status and the stderr tail kept; the long-lived LineChild;
sm120kit/target_script.py, the channel the scripts run in the target load by their path; and
each caller, where a child of ours misbehaves, reading through it."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from sm120kit import child_process
from sm120kit.child_process import KILL_GRACE_S, MAX_LINE
from sm120kit.node.checks import imports, nccl
from sm120kit.tune import worker_client

PACKAGE = Path(child_process.__file__).resolve().parent


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (this test run is a subreaper: the orphans
    of a killed group are its children, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# A grandchild in the child's group that ignores SIGTERM and sleeps: only SIGKILL ends it.
SLEEPER = (
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(120)'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
)


# ----------------------------------------------------------------------------- reading


def test_a_line_is_refused_as_json_when_it_nests_too_deep_or_is_too_long():
    assert child_process.loads_line('{"event": "ready", "n": [1, {"m": 2}]}') == {"event": "ready", "n": [1, {"m": 2}]}
    with pytest.raises(ValueError):
        child_process.loads_line("[" * 100_000 + "]" * 100_000)  # json's own: a RecursionError
    with pytest.raises(ValueError):
        child_process.loads_line('{"big": "' + "x" * MAX_LINE + '"}')
    with pytest.raises(ValueError):
        child_process.loads_line("Traceback (most recent call last):")


CHATTY = r"""
import json, sys
print(json.dumps({"event": "ready", "n": 1}))
print("a line that is not JSON")
print(json.dumps([1, 2]))
print("[" * 100000 + "]" * 100000)
print(json.dumps({"big": "x" * (16 << 20)}))
print("SM120KIT-TEST " + json.dumps({"event": "marked"}))
print(json.dumps({"event": "done"}))
"""


def test_its_json_objects_are_read_a_line_each_and_every_other_line_passed_over():
    done = child_process.run(python(CHATTY), deadline_s=120)
    assert (done.returncode, done.hung, done.left_running) == (0, False, [])
    assert list(done.objects()) == [{"event": "ready", "n": 1}, {"event": "done"}]
    assert list(done.objects("SM120KIT-TEST ")) == [{"event": "marked"}]
    assert done.last_line() == json.dumps({"event": "done"})


def test_its_exit_status_and_the_tail_of_its_stderr_are_kept():
    done = child_process.run(python("import sys; sys.stderr.write('first\\n\\n   \\nlast words  \\n'); sys.exit(7)"))
    assert (done.returncode, done.hung) == (7, False)
    assert done.stderr_tail() == ["last words"] and done.stderr_tail(5) == ["first", "last words"]
    assert list(done.objects()) == [] and done.last_line() == ""


# What a crafted or coloured line holds: a window title, colours, a bell.
HOSTILE = "\\x1b]0;pwned\\x07\\x1b[31mboom\\x1b[0m\\x07"


def test_the_tail_of_its_stderr_is_quoted_as_a_terminal_may_show_it():
    done = child_process.run(python(f"import sys; sys.stderr.write('{HOSTILE}\\n')"))
    assert done.stderr_tail() == ["boom\\x07"]


ECHO = r"""
import sys
while chunk := sys.stdin.buffer.read1(4096):
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
    sys.stderr.buffer.write(chunk[::-1])
    sys.stderr.flush()
"""


def test_much_on_every_pipe_at_once_is_no_deadlock():
    """1 MiB in, 1 MiB back on each of stdout and stderr as it reads: far past a pipe's 64 KiB,
    so a parent that wrote all of its input first, or read one pipe to its end first, would
    wait for the child while the child waits for it."""
    sent = bytes(range(256)) * 4096
    done = child_process.run(python(ECHO), input=sent, deadline_s=120)
    assert (done.returncode, done.hung) == (0, False)
    assert done.out == sent
    assert len(done.err) == len(sent) and done.err != sent  # each 4 KiB chunk reversed on stderr


def test_a_missing_program_is_an_oserror():
    with pytest.raises(FileNotFoundError):
        child_process.run(["/nonexistent/python3", "-c", "pass"])


# ----------------------------------------------------------------------------- the group


HANGS = f"""
import json, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = {SLEEPER}
print(json.dumps({{"event": "started", "pid": grandchild.pid}}), flush=True)
print("before the hang", file=sys.stderr, flush=True)
time.sleep(120)
"""


def test_past_its_deadline_its_whole_group_is_killed_and_what_it_wrote_kept():
    began = time.monotonic()
    done = child_process.run(python(HANGS), deadline_s=5.0)
    took = time.monotonic() - began
    assert done.hung and done.returncode == -signal.SIGKILL
    assert 5.0 <= took < 5.0 + KILL_GRACE_S, took
    (started,) = done.objects()
    assert started["event"] == "started" and done.stderr_tail() == ["before the hang"]
    assert gone(started["pid"]) and done.left_running == []  # the grandchild ignored SIGTERM: the group got SIGKILL


def test_what_it_leaves_running_in_its_group_is_killed_when_it_exits():
    done = child_process.run(python(f"import json, subprocess, sys\nprint(json.dumps({{'pid': {SLEEPER}.pid}}))"))
    (said,) = done.objects()
    assert (done.returncode, done.hung, done.left_running) == (0, False, [])
    assert gone(said["pid"])


def test_on_our_own_way_out_its_group_goes_too(tmp_path):
    """An exception in the middle of the wait (Ctrl-C's KeyboardInterrupt, here an alarm's)
    kills the child's group before it goes on up."""
    pids = tmp_path / "pids"
    code = f"import os, subprocess, sys, time\ngrandchild = {SLEEPER}\n"
    code += f"open({str(pids) + '.tmp'!r}, 'w').write(f'{{os.getpid()}} {{grandchild.pid}}')\n"
    code += f"os.replace({str(pids) + '.tmp'!r}, {str(pids)!r})\ntime.sleep(120)\n"

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        if pids.exists():  # both are running
            raise Interrupted
        signal.setitimer(signal.ITIMER_REAL, 0.1)

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupted):
            child_process.run(python(code), deadline_s=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert all(gone(int(pid)) for pid in pids.read_text().split())


def test_a_process_that_left_its_group_holding_the_pipes_keeps_us_no_longer_than_the_grace():
    """It cannot be killed with the group (it made a session of its own); what the child said
    is kept all the same, and the wait ends a grace period after the deadline."""
    code = (
        "import subprocess, sys\n"
        "outsider = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "print(outsider.pid, flush=True)\n"
    )
    began = time.monotonic()
    done = child_process.run(python(code), deadline_s=3.0, grace_s=1.0)
    took = time.monotonic() - began
    outsider = int(done.last_line())
    try:
        assert done.hung and done.returncode == 0 and took < 3.0 + 2 * 1.0 + 2.0, took
    finally:
        os.kill(outsider, signal.SIGKILL)


# ----------------------------------------------------------------------------- a long-lived child


TALKER = f"""
import json, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop() has to come to SIGKILL
grandchild = {SLEEPER}
print(json.dumps({{"event": "ready", "pid": grandchild.pid}}), flush=True)
for line in sys.stdin:
    print("not JSON", flush=True)
    print("said on stderr", file=sys.stderr, flush=True)
    print(json.dumps([1]), flush=True)
    print(json.dumps({{"event": "answer", "n": json.loads(line)["n"] * 2}}), flush=True)
"""


def test_a_long_lived_child_answers_as_it_goes_and_is_stopped_with_its_group():
    events: queue.Queue = queue.Queue()
    child = child_process.LineChild(python(TALKER), on_object=events.put, on_end=lambda: events.put(None))
    try:
        ready = events.get(timeout=60)
        assert child.send({"n": 21})
        assert events.get(timeout=60) == {"event": "answer", "n": 42}  # the JSON list is no object: not an event
        deadline = time.monotonic() + 30
        while "said on stderr" not in child.tail and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"not JSON", "said on stderr"} <= set(child.tail)
    finally:
        child.stop(grace_s=1.0)
    assert events.get(timeout=10) is None  # the end of its output
    assert child.proc.returncode == -signal.SIGKILL and gone(ready["pid"])
    assert child.send({"n": 1}) is False  # gone: said, not raised


def test_a_long_lived_childs_tail_is_kept_as_a_terminal_may_show_it():
    ended = threading.Event()
    code = f"import sys; sys.stdout.write('{HOSTILE}\\n'); sys.stderr.write('{HOSTILE}\\n')"
    child = child_process.LineChild(python(code), on_object=lambda doc: None, on_end=ended.set)
    try:
        assert ended.wait(60)
        deadline = time.monotonic() + 30
        while len(child.tail) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(child.tail) == ["boom\\x07", "boom\\x07"]
    finally:
        child.stop(grace_s=1.0)


def test_a_compile_workers_log_is_quoted_as_a_terminal_may_show_it(tmp_path):
    from sm120kit.tune.fit_workers import log_tail

    log = tmp_path / "worker-0.log"
    log.write_text("ptxas fatal\n\x1b]0;pwned\x07\x1b[31mout of resources\x1b[0m\n")
    assert log_tail(log) == "ptxas fatal\nout of resources"


def test_a_long_lived_child_that_closes_its_input_ends_its_output():
    events: queue.Queue = queue.Queue()
    echo = "import sys\nfor line in sys.stdin:\n    print(line, end='', flush=True)\n"
    child = child_process.LineChild(python(echo), on_object=events.put, on_end=lambda: events.put(None))
    child.send({"event": "echo"})
    assert events.get(timeout=60) == {"event": "echo"}
    child.close_stdin()
    assert events.get(timeout=60) is None and child.proc.wait(60) == 0
    child.stop()


# ----------------------------------------------------------------------------- the child's side


def test_the_target_scripts_speak_through_the_shared_channel_without_sm120kit():
    """nccl_probe.py and worker.py load target_script.py by its path: run where sm120kit
    cannot be imported (-I: no PYTHONPATH or working directory, -S: no site-packages), their
    fatal event is the one line on stdout."""
    nccl = child_process.run([sys.executable, "-I", "-S", str(PACKAGE / "node" / "nccl_probe.py"), "--world", "0"])
    assert nccl.returncode == 3 and nccl.stdout.splitlines() == [
        json.dumps({"event": "fatal", "kind": "bad-args", "error": "--world 0: at least one rank"})
    ]
    worker = child_process.run([sys.executable, "-I", "-S", str(PACKAGE / "tune" / "worker.py")], input="not JSON\n")
    (fatal,) = worker.objects()
    assert worker.returncode == 3 and len(worker.stdout.splitlines()) == 1
    assert fatal["kind"] == "bad-job" and fatal["error"].startswith("the job is not readable JSON")


def test_what_a_library_prints_on_file_descriptor_1_goes_to_stderr(tmp_path):
    """keep_stdout_for_protocol: only the script's JSON lines reach the parent's stdout, and
    those of a process it starts on its channel (as nccl_probe.py's ranks write theirs)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, runpy, subprocess, sys, types\n"
        f"shared = types.SimpleNamespace(**runpy.run_path({str(PACKAGE / 'target_script.py')!r}))\n"
        "shared.keep_stdout_for_protocol()\n"
        "os.write(1, b'a C library prints\\n')\n"
        "print('a Python print')\n"
        "shared.emit('ready', pid=os.getpid())\n"
        'rank = \'import json; print(json.dumps({"event": "rank"}))\'\n'
        "subprocess.run([sys.executable, '-I', '-S', '-c', rank], stdout=shared.channel(), check=True)\n"
        "try:\n"
        "    raise shared.Fatal('no-gpu', 'none here')\n"
        "except shared.Fatal as fatal:\n"
        "    shared.emit('fatal', kind=fatal.kind, error=shared.first_line(ValueError(fatal.error + '\\nmore')))\n"
    )
    done = child_process.run([sys.executable, "-I", "-S", str(script)])
    assert done.returncode == 0, done.stderr
    assert [e["event"] for e in done.objects()] == ["ready", "rank", "fatal"] and len(done.stdout.splitlines()) == 3
    assert list(done.objects())[2]["error"] == "ValueError: none here"
    assert done.stderr.splitlines() == ["a C library prints", "a Python print"]


# ----------------------------------------------------------------------------- the callers

BOMB = "[" * 100_000 + "]" * 100_000  # json's own reading of it is a RecursionError, which no caller caught


def misbehaving(tmp_path: Path, *lines: str) -> Path:
    """An executable child of ours that writes `lines` on its stdout, whatever it is asked."""
    path = tmp_path / "misbehaving.py"
    said = "".join(line + "\n" for line in lines)
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({said!r})\n")
    path.chmod(0o755)
    return path


def test_the_imports_probe_takes_a_line_nested_too_deep_for_no_answer(tmp_path):
    python = misbehaving(tmp_path, BOMB)
    said = imports.probe(str(python), ["sglang.launch_server"], {"PATH": os.environ["PATH"]})
    assert said == "it did not answer as a Python interpreter would"


def test_the_nccl_probe_passes_over_a_line_nested_too_deep(tmp_path):
    result = {"event": "result", "rank": 0, "busbw_gbps": 31.25, "algbw_gbps": 20.0, "transport": ["P2P/CUMEM"]}
    lines = [json.dumps({"event": "ready", "nccl": "2.27.7"}), BOMB, json.dumps(result), json.dumps({"event": "done"})]
    run = nccl.probe(sys.executable, "0,1", {"PATH": os.environ["PATH"]}, "P2P", 60.0, misbehaving(tmp_path, *lines))
    assert (run.outcome, run.busbw_gbps, run.transport) == ("ok", 31.25, ["P2P/CUMEM"])


def test_the_timing_workers_probe_passes_over_a_line_nested_too_deep(tmp_path):
    event = {"event": "probe", "sglang": "0.5.23", "triton": "3.5.1", "torch": "2.9.1", "cuda": "12.9"}
    event.update(devices=["NVIDIA RTX PRO 6000 Blackwell Server Edition"], memory=[97887 << 20])
    found = worker_client.probe(Path(sys.executable), misbehaving(tmp_path, BOMB, json.dumps(event)))
    assert (found.sglang, found.devices) == ("0.5.23", event["devices"])


def test_a_timing_worker_that_writes_a_line_nested_too_deep_still_ends_its_events(tmp_path):
    """Its reader passes the line over (into the tail), so the end of its output still comes:
    the schedule that waits for it does not wait for ever."""
    events: queue.Queue = queue.Queue()
    script = misbehaving(tmp_path, BOMB, json.dumps({"event": "ready"}))
    worker = worker_client.Worker(Path(sys.executable), script, 0, {"protocol": 1}, events)
    try:
        assert events.get(timeout=60) == (worker, {"event": "ready"})
        assert events.get(timeout=60) == (worker, None)
    finally:
        worker.kill()
    assert worker.tail().startswith("[[[")
