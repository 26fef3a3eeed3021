"""sglang's own router (the `sglang-router` package: a Rust load balancer in a wheel) as
sm120kit drives it: its options read from the installed release, its command line, and a
client for its worker API.

What the code relies on, read from the releases and checked by running them
(tests/test_router.py runs the installed one in front of stand-in replicas):

- Options: `RouterArgs.add_cli_args` in `sglang_router/router_args.py` declares every flag
  with `add_argument(f"--{prefix}name", type=..., choices=[...], action=..., nargs=...)`
  (`prefix` is "router-" only when sglang's own launch_server embeds the router). They are
  read here with `ast`: importing the module loads the 90 MB Rust extension, and the
  target may be another python or a --site directory. Defaults that matter to a fleet:
  `--host 0.0.0.0` (so it is always passed), a Prometheus exporter on
  `--prometheus-host 0.0.0.0 --prometheus-port 29000` that the router starts whether or
  not it is asked to (a port in use there makes the router panic at start; the host is
  passed as the router's own), health checks of `--health-check-endpoint /health` every
  `--health-check-interval-secs 60` with `--health-failure-threshold 3` and
  `--health-success-threshold 2`, `--health-check-timeout-secs 5`.
- Endpoints: GET /liveness answers 200 "OK" while the process serves, workers or not
  (LIVENESS_PATH); GET /readiness 200 with at least one healthy worker, else 503. The
  worker API: POST /workers {"url": ...} answers 202 and registers the worker in the
  background (a job that probes the worker's /health, then reads /server_info and
  /model_info); GET /workers lists the registered workers, each with "id", "url" and
  "is_healthy" (a worker whose job is still running is not listed); DELETE
  /workers/{id} answers 202 and removes it in the background. The id is the URL itself
  in 0.2.4 and a UUID from 0.3.0 on (DELETE /workers/{url} answers 400 there), so a
  removal looks the id up first. The old /add_worker, /remove_worker and /list_workers
  are gone (404) from 0.2.4 on.
- With --api-key, every endpoint but /liveness, /readiness, /health, /health_generate
  and /v1/models wants `Authorization: Bearer KEY`, and the router sends the same header
  to the workers (so the replicas must have the same key).
"""

from __future__ import annotations

import ast
import difflib
import http.client
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sm120kit.endpoint import probe_host
from sm120kit.errors import UserError
from sm120kit.urls import http_url

if TYPE_CHECKING:
    from sm120kit.target import Target

# The releases whose worker API and options were read, and which pass tests/test_router.py
# (0.2.4, 0.3.0, 0.3.1 and 0.3.2: PYTHONPATH=<a site-packages holding one> pytest ...):
# 0.2.4 is the first with only the REST worker API above (0.2.0 still has /add_worker;
# 0.2.1-0.2.3 were not checked); 0.3.0 changed worker ids from URLs to UUIDs, which the
# client absorbs by looking ids up. The next minor release may change the API again, as
# 0.3.0 did, so it stays out until it is checked.
SUPPORTED = SpecifierSet(">=0.2.4,<0.4")

LIVENESS_PATH = "/liveness"  # 200 while the router serves, healthy workers or not
READINESS_PATH = "/readiness"  # 200 with at least one healthy worker, 503 without
ROUTER_ARGS = "sglang_router/router_args.py"
MODULE = "sglang_router.launch_router"
# What the fleet decides, not the profile's router table: the bind address and port come
# from the profile's [fleet] settings, the workers from its replicas.
RESERVED = {"host", "port", "worker_urls"}
# Secrets: never in a profile's text nor in argv that a profile writes (the key comes from
# server.api_key_env, the same for the router and the replicas).
SECRETS = {"api_key", "control_plane_api_keys"}


@dataclass(frozen=True)
class RouterOption:
    flag: str  # "--health-check-interval-secs"
    kind: str  # "switch" (store_true), "value", "list" (nargs), "append" (repeatable groups)
    type: str  # "int" | "float" | "str": of the value, or of each item of a list
    choices: tuple[str, ...] | None = None  # None: any value (or not knowable statically)


@dataclass(frozen=True)
class RouterSchema:
    version: str  # the installed sglang-router's version
    options: dict[str, RouterOption]  # TOML key ("policy", "health_check_interval_secs") -> its flag


def _flag(node: ast.AST) -> str | None:
    """`"--host"` or `f"--{prefix}policy"` -> the flag as launch_router spells it (no prefix)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # the formatted parts are the "router-" prefix
        return "".join(str(p.value) for p in node.values if isinstance(p, ast.Constant))
    return None


def schema_from_source(version: str, source: str) -> RouterSchema:
    """The options that `RouterArgs.add_cli_args` declares in router_args.py's text."""
    options: dict[str, RouterOption] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args):
            continue
        flag = _flag(node.args[0])
        if not flag or not flag.startswith("--"):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action_node, type_node, choices_node = kw.get("action"), kw.get("type"), kw.get("choices")
        action = action_node.value if isinstance(action_node, ast.Constant) else None
        type_ = type_node.id if isinstance(type_node, ast.Name) else "str"
        choices: tuple[str, ...] | None = None
        if isinstance(choices_node, (ast.List, ast.Tuple)):  # a name (a parser registry): any value
            choices = tuple(str(e.value) for e in choices_node.elts if isinstance(e, ast.Constant))
        if action in ("store_true", "store_false"):
            kind = "switch"
        elif action == "append":
            kind = "append"
        else:
            kind = "list" if "nargs" in kw else "value"
        key = flag[2:].replace("-", "_")
        options.setdefault(key, RouterOption(flag, kind, type_ if type_ in ("int", "float") else "str", choices))
    return RouterSchema(version, options)


def read_router_schema(target: Target) -> RouterSchema | None:
    """The installed sglang-router's options, read from its router_args.py; None when
    sglang-router is not installed there."""
    dist = target.find("sglang-router")
    if dist is None:
        return None
    path = dist.file(ROUTER_ARGS)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path}: cannot read sglang-router {dist.version}'s options ({exc.__class__.__name__})",
            f"reinstall it: pip install --force-reinstall --no-deps sglang-router=={dist.version}",
        ) from None
    try:
        return schema_from_source(dist.version, source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # garbage, NUL bytes, nested too deep
        raise UserError(
            f"cannot read sglang-router {dist.version}'s options: {path} is not Python sm120kit can read "
            f"({exc.__class__.__name__})",
            f"reinstall it: pip install --force-reinstall --no-deps sglang-router=={dist.version}",
        ) from None


def _check(value: object, option: RouterOption) -> bool:
    if option.type == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif option.type == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    return ok and (option.choices is None or str(value) in option.choices)


def router_argv(
    python: str, schema: RouterSchema, options: dict, *, host: str, port: int, worker_urls: list[str], source: str
) -> list[str]:
    """The router's command line: [python, "-m", "sglang_router.launch_router", "--host", host,
    "--port", port, ...the profile's fleet.router options..., "--worker-urls", ...].
    options: TOML key -> value (a switch is true or false; a list option takes a list)."""
    helps = f"see the options with: {python} -m {MODULE} --help"
    if not SUPPORTED.contains(Version(schema.version), prereleases=True):
        raise UserError(
            f"{source}: [fleet]: the installed sglang-router {schema.version} is not a release sm120kit "
            f"drives (sglang-router{SUPPORTED})",
            f"install one: {python} -m pip install 'sglang-router{SUPPORTED}'",
        )
    argv = [python, "-m", MODULE, "--host", host, "--port", str(port)]
    for key, value in options.items():
        where = f"{source}: fleet.router.{key}"
        option = schema.options.get(key)
        if key in RESERVED:
            raise UserError(f"{where}: sm120kit sets --{key.replace('_', '-')} itself, from the fleet", "remove it")
        if key in SECRETS:
            raise UserError(
                f"{where}: a key does not belong in a profile (its text, and the router's argv, are readable)",
                "remove it and set server.api_key_env to the NAME of the variable that holds the key: sm120kit "
                "gives the router and the replicas that key",
            )
        if option is None:
            near = difflib.get_close_matches(key.replace("-", "_"), list(schema.options), n=1)
            also = f" (did you mean `{near[0]}`?)" if near else ""
            raise UserError(f"{where}: the installed sglang-router {schema.version} has no such option{also}", helps)
        if option.kind == "append":
            raise UserError(f"{where}: {option.flag} takes repeated groups, which a profile cannot give", helps)
        if option.kind == "switch":
            if not isinstance(value, bool):
                raise UserError(f"{where}: {option.flag} is a switch: true or false, not {value!r}", helps)
            argv += [option.flag] if value else []
            continue
        items = value if option.kind == "list" and isinstance(value, list) else [value]
        bad = next((v for v in items if not _check(v, option)), None) if items else None
        if bad is None and key.endswith("_port") and not all(1 <= v <= 65535 for v in items):
            raise UserError(f"{where} = {value!r} is not a port (1-65535)", f"fix fleet.router.{key}")
        if bad is not None or (option.kind == "value" and isinstance(value, list)):
            kind = {"int": "an integer", "float": "a number"}.get(option.type, "a string")
            wanted = f"one of {', '.join(option.choices)}" if option.choices else kind
            shown = bad if bad is not None else value
            raise UserError(
                f"{where}: {shown!r} is not {wanted} (sglang-router {schema.version}, {option.flag})", helps
            )
        argv += [option.flag, *map(str, items)] if items else []
    if "prometheus_host" in schema.options and "prometheus_host" not in options:
        # its metrics exporter binds 0.0.0.0 unless told: no wider than the router itself
        argv += ["--prometheus-host", host]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    return argv


# --- the worker API -----------------------------------------------------------------------


class RouterError(Exception):
    """The router could not do what it was asked (the message says why)."""


class RouterUnavailable(RouterError):
    """No answer: the router is not running, not listening yet, or too slow."""


class RouterRefused(RouterError):
    """The router answered with an error, or did not do the work it had accepted."""


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class RouterClient:
    """The router's worker API over plain http.client (a loopback or fleet address: no
    proxy settings apply). Adding and removing are jobs the router runs in the background:
    pass `wait` to return only once the change shows in workers()."""

    POLL_S = 0.1

    def __init__(self, host: str, port: int, api_key: str | None = None, timeout: float = 5.0) -> None:
        self.host = probe_host(host)  # a router bound to 0.0.0.0 is asked on the loopback
        self.port, self.api_key, self.timeout = port, api_key, timeout
        self.where = f"the router at {http_url(host, port)}"

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except TimeoutError:
            raise RouterUnavailable(f"{self.where} did not answer {method} {path} within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise RouterUnavailable(f"{self.where} does not answer ({exc.__class__.__name__}: {exc})") from None
        finally:
            conn.close()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = raw.decode("utf-8", "replace").strip()
        return response.status, doc

    def _expect(self, method: str, path: str, body: dict | None = None, ok: tuple[int, ...] = (200,)) -> object:
        status, doc = self._request(method, path, body)
        if status not in ok:
            self._fail(method, path, status, doc)
        return doc

    def _fail(self, method: str, path: str, status: int, doc: object) -> None:
        if status in (401, 403):
            raise RouterRefused(
                f"{self.where} refused {method} {path} ({status}): it wants the API key it was started with"
            )
        said = doc.get("error", doc) if isinstance(doc, dict) else doc
        said = said.get("message", said) if isinstance(said, dict) else said
        raise RouterRefused(f"{self.where} answered {method} {path} with {status}: {str(said)[:300] or 'no message'}")

    def _listed(self) -> list[dict]:
        doc = self._expect("GET", "/workers")
        if not isinstance(doc, dict) or not isinstance(doc.get("workers"), list):
            raise RouterRefused(f"{self.where} answered GET /workers with something else than a worker list")
        return [w for w in doc["workers"] if isinstance(w, dict) and isinstance(w.get("url"), str)]

    def workers(self) -> list[str]:
        """The URLs of the workers the router has registered (healthy or not: see health())."""
        return [w["url"] for w in self._listed()]

    def health(self) -> dict[str, bool]:
        """Each registered worker's URL -> whether the router's health checks pass it now
        (an unhealthy one stays registered and gets no requests until it passes again)."""
        return {w["url"]: bool(w.get("is_healthy")) for w in self._listed()}

    def ready(self) -> bool:
        """Whether the router has a healthy worker to send requests to (GET /readiness)."""
        return self._request("GET", READINESS_PATH)[0] == 200

    def add_worker(self, url: str, wait: float | None = None) -> None:
        """Register `url` (adding one already there changes nothing). The router checks it
        (/health, /server_info, /model_info) in a background job, retrying a worker that
        does not answer yet; with `wait`, return once it is listed as healthy, or raise
        RouterRefused after that many seconds, with the job's state."""
        doc = self._expect("POST", "/workers", {"url": url}, ok=(200, 201, 202))
        if wait is None:
            return
        job = doc.get("worker_id") if isinstance(doc, dict) else None
        deadline = time.monotonic() + wait
        # listed, then marked healthy a moment later: only then does it get requests
        while not any(_same(u, url) and healthy for u, healthy in self.health().items()):
            if time.monotonic() >= deadline:
                state = self._job_state(job) if job else ""
                raise RouterRefused(f"{self.where} did not register {url} as healthy within {wait:g} s{state}")
            time.sleep(self.POLL_S)

    def _job_state(self, worker_id: str) -> str:
        """What GET /workers/{id} says of a registration still in its job (0.3.x)."""
        try:
            status, doc = self._request("GET", f"/workers/{quote(worker_id, safe='')}")
        except RouterError:
            return ""
        job = doc.get("job_status") if status == 200 and isinstance(doc, dict) else None
        if not isinstance(job, dict):
            return ""
        return f" (its job: {job.get('status')}{': ' + str(job['message']) if job.get('message') else ''})"

    def remove_worker(self, url: str, wait: float | None = None) -> None:
        """Take `url` out of the router (one that is not there is not an error). Requests
        it is answering go on; new ones go elsewhere. With `wait`, return once it is no
        longer listed, or raise RouterRefused after that many seconds."""
        for worker in self._listed():
            if _same(worker["url"], url):
                # 0.2.4's id is the URL, 0.3.x's a UUID: either way one path segment
                path = f"/workers/{quote(str(worker.get('id', url)), safe='')}"
                status, doc = self._request("DELETE", path)
                if status not in (200, 202, 204, 404):  # 404: gone meanwhile
                    self._fail("DELETE", path, status, doc)
        if wait is None:
            return
        deadline = time.monotonic() + wait
        while any(_same(u, url) for u in self.workers()):
            if time.monotonic() >= deadline:
                raise RouterRefused(f"{self.where} still lists {url} {wait:g} s after removing it")
            time.sleep(self.POLL_S)
