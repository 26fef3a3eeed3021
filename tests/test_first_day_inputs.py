"""Issue 25, items 9, 10, 32 and the rest of 31: input a first day on a real node gives.

- Every URL option (smoke --url, bench --url, a fleet replica's url, the URLs the router is
  given) goes through one parser (sm120kit.urls): a malformed URL is exit 2 naming the
  option and what is wrong, never an internal error, never a URL urllib silently repaired.
- `render` refuses what a unit, compose file or manifest would misread: a User= systemd
  refuses, a control character in any value (a newline starts a directive of its own in a
  unit), a Kubernetes name Kubernetes refuses, a ':' that splits docker's volume spec.
- `ps` lists a run record with a negative pid, an infinite or far-away time or an odd
  last_health as damaged; a target whose server_args module is garbage is a clear error
  naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.sites import install
from support.standin import PROFILES

from sm120kit.errors import UserError
from sm120kit.fleet.plan import plan
from sm120kit.profiles.loader import load_profile
from sm120kit.urls import BadUrl, http_url, parse_http_url

SM120KIT = Path(sys.executable).parent / "sm120kit"  # a real executable: systemd-analyze checks ExecStart's


@pytest.fixture(autouse=True)
def no_user_paths(monkeypatch):
    monkeypatch.delenv("SM120KIT_PROFILE_PATH", raising=False)
    monkeypatch.delenv("SM120KIT_PATCH_PATH", raising=False)


def refused(cli, *argv) -> str:
    """Exit 2, nothing on stdout, a clear message (no internal error): the message."""
    code, out, err = cli(*argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert "internal error" not in err and "Traceback" not in err, err
    return err


# -- item 9: one URL parser ------------------------------------------------------------------

# Each malformed URL, and the reason the one parser gives (what every option then says).
MALFORMED = {
    "http://[::1": "its IPv6 address has no closing ']'",
    "http://[::1]x:30000": "follows the IPv6 address",
    "http://::1:30000": "an IPv6 address goes in brackets",
    "http://[not-v6]:30000": "brackets go around an IPv6 address only",
    "http://127.0.0.1:30000/v1": "has no path",
    "http://127.0.0.1:30000?x=1": "no query or fragment",
    "http://user:pw@127.0.0.1:30000": "no user or password",
    "http://127.0.0.1:30000\n": "holds a newline",
    "http://127.0.0.1:\t30000": "holds a tab",
    "http://127.0.0.1 :30000": "holds a space",
    "http://127.0.0.1": "names no port",
    "http://127.0.0.1:99999": "is not a port",
    "http://127.0.0.1:0": "is not a port",
    "http://127.0.0.1:+1": "is not a port",
    "http://:30000": "names no host",
    "http://gpu_node!:30000": "is not a host name or an IP address",
    "ftp://127.0.0.1:30000": "does not start with http:// or https://",
    "127.0.0.1:30000": "does not start with http:// or https://",
    "": "it is empty",
}


@pytest.mark.parametrize("url", MALFORMED)
def test_the_parser_says_what_is_wrong(url):
    with pytest.raises(BadUrl) as caught:
        parse_http_url(url)
    assert MALFORMED[url] in str(caught.value)


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("HTTPS://gpu-node-1.example.com:443", "https://gpu-node-1.example.com:443"),
        ("http://[::1]:30000", "http://[::1]:30000"),
        ("http://sglang_replicas-0.sglang:30001", "http://sglang_replicas-0.sglang:30001"),
    ],
)
def test_a_good_url_is_read_as_its_origin(url, origin):
    assert parse_http_url(url).text == origin


@pytest.mark.parametrize("command", ["smoke", "bench"])
@pytest.mark.parametrize("url", MALFORMED)
def test_smoke_and_bench_refuse_a_malformed_url_naming_the_option(cli, command, url):
    """HEAD: `smoke --url 'http://[::1'` (and bench's) was `internal error: ValueError: Invalid
    IPv6 URL`, `smoke --url ''` an internal error (AttributeError), and a URL holding a newline
    or a path was taken (urllib drops the newline)."""
    err = refused(cli, command, "--url", url)
    assert f"--url {url!r} is not http://HOST:PORT: " in err and MALFORMED[url] in err
    assert "next: e.g. --url http://127.0.0.1:30000" in err


def fleet(*sets: str):
    return load_profile("standin-fleet", [str(PROFILES)], ["server.port=30000", *sets])


@pytest.mark.parametrize("url", [u for u in MALFORMED if u])  # an empty url is the model's min_length
def test_a_replicas_url_goes_through_the_same_parser(url):
    """HEAD read it with urlsplit: a path, a query, user info or a newline (which urlsplit
    drops, while the router got the text with it) passed."""
    with pytest.raises(UserError) as caught:
        fleet(f"fleet.replica=[{{url={json.dumps(url)}}}]", "fleet.replicas=1")
    assert "fleet.replica[0].url" in caught.value.message and "is not a worker URL" in caught.value.message
    assert MALFORMED[url] in caught.value.message  # the very reason smoke --url gives


def test_the_router_and_its_workers_are_given_urls_the_parser_takes():
    """An IPv6 bind: HEAD built http://::1:30001 for the router's --worker-urls (and its own
    URL), which no client reads as host ::1 port 30001."""
    layout = plan(fleet("server.host=::1", "fleet.replica_host=::1"))
    assert layout.router_url == "http://[::1]:30000"
    assert [r.url for r in layout.replicas] == [f"http://[::1]:{p}" for p in (30001, 30002, 30003)]
    for url in (layout.router_url, *(r.url for r in layout.replicas)):
        assert parse_http_url(url).host == "::1"
    other = plan(
        fleet(
            'fleet.replica=[{}, {node="fd00::7", port=30001}, {url="http://[fd00::9]:30001/"}]',
            "fleet.replicas=3",
            "fleet.replica_host=::",
            "server.api_key_env=KEY",
        )
    )
    assert [r.url for r in other.replicas] == ["http://[::1]:30001", "http://[fd00::7]:30001", "http://[fd00::9]:30001"]


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("server.host", "a b", "is not a host name or an IP address"),
        ("server.host", "[::1", "is not an IPv6 address"),
        ("fleet.replica_host", "10.0.0.1/24", "is not a host name or an IP address"),
    ],
)
def test_a_host_that_urls_are_built_from_is_a_host(key, value, said):
    with pytest.raises(UserError) as caught:
        fleet(f"{key}={value}", "server.api_key_env=KEY")
    assert key in caught.value.message and said in caught.value.message


def test_a_replicas_node_is_a_host():
    with pytest.raises(UserError) as caught:
        fleet('fleet.replica=[{node="10.0.0.7/x", port=30001}]', "fleet.replicas=1")
    assert "fleet.replica[0].node" in caught.value.message


def test_a_profiles_own_server_url_is_bracketed():
    from sm120kit.quality.client import Client
    from sm120kit.quality.options import options_for

    options = options_for(load_profile("standin", [str(PROFILES)], ["server.host=::1"]), api_key=None)
    assert options.url == "http://[::1]:30000" == http_url("::1", 30000)
    client = Client(options.url)
    assert (client.host, client.port) == ("::1", 30000)


# -- items 10 and 32: what render writes ------------------------------------------------------


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is not installed (Debian's systemd package): the units are proven with it")
    return found


def verify(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    unit = tmp_path / "sm120kit-test.service"
    unit.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    return subprocess.run([systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, env=env, timeout=60)


def unit(cli, *argv) -> str:
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--sm120kit", SM120KIT, *argv)
    assert code == 0, err
    return out


def test_unit_user_root_rm_rf_is_refused(cli):
    """HEAD rendered `User=root;rm -rf /` with exit 0; systemd refuses that unit."""
    err = refused(cli, "render", "systemd", "glm5-nvfp4", "--unit-user", "root;rm -rf /")
    assert "--unit-user 'root;rm -rf /' is not a user name systemd takes for User=" in err


# Names systemd refuses outright ("Invalid user/group name or numeric ID"), each refused here too.
SYSTEMD_REFUSES = ["root;rm -rf /", "65535", "4294967295", "0100", "a/b", "a:b", ".", ".."]
# Names systemd takes only with "does not match strict user/group name rules": refused here.
NOT_STRICT = ["-x", "1x", "a b", "a" * 32, "a$", "é"]


@pytest.mark.parametrize("name", ["sglang", "_svc", "svc-1", "svc.ai", "A" * 31, "1000", "0", "4294967294"])
def test_a_user_name_systemd_takes_renders_and_verifies(tmp_path, cli, name):
    text = unit(cli, "--unit-user", name)
    assert f"\nUser={name}\n" in text
    done = verify(tmp_path, text)
    assert done.returncode == 0 and "Invalid" not in done.stderr, done.stderr


@pytest.mark.parametrize("name", SYSTEMD_REFUSES + NOT_STRICT)
def test_a_user_name_systemd_would_refuse_or_warn_about_is_refused(tmp_path, cli, name):
    err = refused(cli, "render", "systemd", "glm5-nvfp4", f"--unit-user={name}")  # "-x" is a value, not an option
    assert f"--unit-user {name!r} is not a user name systemd takes" in err
    if name in SYSTEMD_REFUSES:  # the rule agrees with the real systemd: this is what the unit would hit
        done = verify(tmp_path, unit(cli, "--unit-user", "sglang").replace("\nUser=sglang\n", f"\nUser={name}\n"))
        assert done.returncode != 0 and "Invalid user/group name or numeric ID" in done.stderr


CONTROL = ["\n", "\r", "\x1b", "\u2028"]
# Every option render writes somewhere, per target (with what that target needs besides).
OPTIONS = [
    ("systemd", "--unit-user", "sglang{}ExecStartPre=/bin/sh", []),
    ("systemd", "--env-file", "/etc/k.env{}ExecStartPre=/bin/sh", []),
    ("systemd", "--state-dir", "/var/lib/s{}x", []),
    ("systemd", "--sm120kit", "/opt/bin/sm120kit{}x", []),
    ("systemd", "--python", "/opt/bin/python{}x", []),
    ("systemd", "--profile-dir", "/etc/p{}x", []),
    ("systemd", "--patch-dir", "/etc/q{}x", []),
    ("docker", "--image", "img{}x", []),
    ("docker", "--env-file", "/etc/k.env{}x", ["--image", "img"]),
    ("docker", "--state-dir", "/var/lib/s{}x", ["--image", "img"]),
    ("docker", "--image-python", "/opt/bin/python{}x", ["--image", "img"]),
    ("k8s", "--image", "img{}x", []),
    ("k8s", "--image-python", "python3{}x", ["--image", "img"]),
    ("k8s", "--hf-cache-host-path", "/models{}x", ["--image", "img"]),
    ("k8s", "--shm-size", "32Gi{}", ["--image", "img"]),
    ("k8s", "--namespace", "ns{}", ["--image", "img"]),
    ("k8s", "--secret", "key{}", ["--image", "img"]),
    ("k8s", "--hf-cache-claim", "cache{}", ["--image", "img"]),
]


@pytest.mark.parametrize("char", CONTROL, ids=["newline", "cr", "esc", "u2028"])
@pytest.mark.parametrize(("target", "option", "value", "more"), OPTIONS, ids=[f"{t}{o}" for t, o, *_ in OPTIONS])
def test_a_control_character_in_any_option_is_refused_naming_it(cli, char, target, option, value, more):
    """HEAD wrote `--unit-user $'sglang\\nExecStartPre=...'` and `--env-file` with a newline
    into the unit (a directive of its own), exit 0."""
    text = value.format(char)
    err = refused(cli, "render", target, "glm5-nvfp4", option, text, *more)
    assert f"{option} {text!r}" in err


def test_a_control_character_in_the_profile_name_is_refused(cli):
    err = refused(cli, "render", "systemd", "glm5-nvfp4\nExecStartPre=/bin/sh")
    assert "NAME 'glm5-nvfp4\\nExecStartPre=/bin/sh' holds a newline" in err


@pytest.mark.parametrize("target", ["systemd", "docker", "k8s"])
@pytest.mark.parametrize(
    "setting",
    ["model.served_name=a\rUser=root", "model.path=/models/x\ny", "env.HF_HOME=/x\n[Service]", "extra_args.--x=a\x1bb"],
)
def test_a_control_character_in_a_profile_value_is_refused_naming_the_key(cli, target, setting):
    """HEAD: `--set $'model.served_name=a\\rUser=root'` rendered a unit that systemd refuses
    ("Unbalanced quoting"): a carriage return ends a line for systemd."""
    more = ["--image", "img"] if target != "systemd" else []
    err = refused(cli, "render", target, "glm5-nvfp4", "--set", setting, *more)
    key, _, value = setting.partition("=")
    assert f"{key} = {value!r} holds" in err and "nothing was rendered" in err


def test_a_description_is_one_line_and_the_set_word_is_escaped_so_systemd_reads_it(tmp_path, cli):
    """The description is the one free text: written as one line in Description=, and the
    --set that carries it is quoted with C escapes in ExecStart (HEAD left a raw carriage
    return there, and systemd refused the unit)."""
    text = unit(cli, "--set", "description=fast\rUser=root")
    assert "\r" not in text and "Description=sm120kit serve glm5-nvfp4: fast User=root\n" in text
    assert '--set "description=fast\\x0dUser=root"' in text
    done = verify(tmp_path, text)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(("option", "value"), [("--secret", "My_Key"), ("--hf-cache-claim", "-cache")])
def test_kubernetes_names_are_checked_as_kubernetes_does(cli, option, value):
    err = refused(cli, "render", "k8s", "glm5-nvfp4", "--image", "img", f"{option}={value}")
    assert f"{option} {value!r} is not a Kubernetes object name" in err


def test_a_colon_in_a_directory_docker_mounts_is_refused(cli, tmp_path):
    err = refused(cli, "render", "docker", "glm5-nvfp4", "--image", "img", "--state-dir", str(tmp_path / "a:b"))
    assert "holds a ':', which would split docker's HOST:CONTAINER volume spec" in err


# -- item 31: ps over odd records, a garbage server_args -------------------------------------

GOOD = {"profile": "glm5-nvfp4", "status": "ready", "supervisor_pid": 1, "host": "127.0.0.1", "port": 30000}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"supervisor_pid": -5}, "supervisor_pid"),  # HEAD: ValueError: pid must be a positive integer
        ({"supervisor_pid": 2**40}, "supervisor_pid"),
        ({"server_pid": 0}, "server_pid"),
        ({"since": float("inf")}, "since: Input should be a finite number"),  # HEAD: OverflowError
        ({"since": float("nan")}, "since: Input should be a finite number"),
        ({"since": -1e18}, "since"),  # HEAD: OSError: Value too large for defined data type
        ({"since": 1e300}, "since"),
        ({"supervisor_started": float("nan")}, "supervisor_started"),
        ({"restarts": -1}, "restarts"),
        ({"port": 0}, "port"),
        ({"last_health": {"at": "yesterday", "ok": True}}, "last_health.at"),  # HEAD: TypeError
        ({"last_health": {"at": float("inf"), "ok": True}}, "last_health.at"),
        ({"last_health": {"ok": "yes"}}, "last_health.ok"),
        ({"last_health": {"ok": True, "detail": 5}}, "last_health.detail"),
        ({"last_health": {"ok": True, "seconds": -1}}, "last_health.seconds"),
        ({"last_health": [True]}, "last_health"),
    ],
)
def test_ps_lists_an_odd_record_as_damaged(tmp_path, cli, monkeypatch, fields, says):
    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({**GOOD, **fields}))  # json.dumps writes Infinity and NaN as Python reads them
    code, out, err = cli("ps")
    assert code == 2 and "internal error" not in err, err
    assert "glm5-nvfp4" in out and "damaged" in out
    assert f"damaged run record {state}: " in err and says in err
    code, doc = cli.json("ps")
    assert code == 2 and doc["runs"][0]["status"] == "damaged"


def test_ps_still_lists_a_record_the_supervisor_writes(tmp_path, cli, monkeypatch):
    import time

    monkeypatch.setenv("SM120KIT_STATE_DIR", str(tmp_path))
    state = tmp_path / "serve" / "glm5-nvfp4" / "state.json"
    state.parent.mkdir(parents=True)
    health = {"at": time.time() - 5, "ok": True, "detail": "200", "seconds": 0.012}
    state.write_text(json.dumps({**GOOD, "since": time.time() - 60, "server_pid": 4242, "last_health": health}))
    code, out, err = cli("ps", "--wide")
    assert code == 0, err
    assert "glm5-nvfp4" in out and "ok 200 (5s ago)" in out


@pytest.fixture(scope="module")
def vendor_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("vendor") / "site-packages"
    site.mkdir()
    install(site, "0.5.23", flashinfer=False)
    return site


GARBAGE = {
    "not Python": b"def (:\n",
    "NUL bytes": b"x = 1\x00\n",
    "not UTF-8": b'x = "\xff"\n',
    "nested too deep": b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "a binary": bytes(range(256)) * 4,
}


@pytest.mark.parametrize("kind", GARBAGE)
@pytest.mark.parametrize(
    "argv",
    [["serve", "glm5-nvfp4", "--dry-run"], ["profile", "check", "glm5-nvfp4"], ["render", "k8s", "glm5-nvfp4"]],
    ids=["serve", "profile-check", "render-k8s"],
)
def test_a_garbage_server_args_module_is_a_clear_error_naming_the_file(tmp_path, cli, vendor_site, kind, argv):
    """HEAD: `internal error: SyntaxError: invalid syntax (server_args.py, line 1)`."""
    site = tmp_path / "site-packages"
    shutil.copytree(vendor_site, site, symlinks=True)
    module = site / "sglang" / "srt" / "server_args.py"
    module.write_bytes(GARBAGE[kind])
    more = ["--image", "img"] if argv[0] == "render" else []
    err = refused(cli, *argv, "--site", site, *more)
    assert f"cannot read sglang 0.5.23's flags: {module} is not Python sm120kit can read" in err
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in err


def test_a_garbage_fields_module_is_named_too(tmp_path, cli, vendor_site):
    """0.5.20 on, the flags live in arg_groups/fields/: a damaged one is named, not server_args."""
    site = tmp_path / "site-packages"
    shutil.copytree(vendor_site, site, symlinks=True)
    fields = sorted((site / "sglang" / "srt" / "arg_groups" / "fields").glob("*.py"))
    victim = next(f for f in fields if f.name != "__init__.py")
    victim.write_bytes(b"class (:\n")
    err = refused(cli, "serve", "glm5-nvfp4", "--dry-run", "--site", site)
    assert f"{victim} is not Python sm120kit can read" in err


def test_a_garbage_router_args_module_is_a_clear_error_naming_the_file(tmp_path):
    from sm120kit.fleet.router import read_router_schema

    path = tmp_path / "router_args.py"
    path.write_bytes(b"x = (\n")
    dist = SimpleNamespace(version="0.3.2", file=lambda relpath: path)
    with pytest.raises(UserError) as caught:
        read_router_schema(SimpleNamespace(find=lambda name: dist))
    assert f"{path} is not Python sm120kit can read" in caught.value.message
    assert "sglang-router==0.3.2" in caught.value.hint
