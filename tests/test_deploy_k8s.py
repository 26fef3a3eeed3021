"""`render k8s`: Kubernetes manifests from a launch profile (sm120kit/deploy/k8s.py).

Proof, against the real things:
- every manifest validates against the real schemas (tests/fixtures/k8s/README.md names
  them): the Kubernetes v1.32.2 "standalone-strict" JSON schemas of Deployment,
  StatefulSet and Service (yannh/kubernetes-json-schema, generated from the Kubernetes
  OpenAPI definitions; unknown fields are errors), and the LeaderWorkerSet CRD's own
  openAPIV3Schema from kubernetes-sigs/lws v0.10.0, made strict the way the API server
  treats a structural schema under `kubectl apply --validate=strict` (an unknown field
  is an error);
- the argv each pod runs is the one `sm120kit serve PROFILE --dry-run --json --node-rank N`
  prints for that node (in-process CLI, real sglang release files), LWS's $(VAR)
  references substituted as kubelet substitutes them;
- the container's entrypoint runs under /bin/sh and execs exactly what `serve` would run
  (the API key in a 0600 --config file, never in argv);
- the YAML of one one-node, one multi-node and one fleet profile equals its golden file.

The golden files are written by `python tests/test_deploy_k8s.py` (never by a test): run it
after a deliberate change to the output, and read the diff.
"""

from __future__ import annotations

import copy
import json
import lzma
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sm120kit.deploy.k8s import (  # noqa: E402
    KEY_FILE,
    LWS_LEADER_ADDRESS,
    LWS_WORKER_INDEX,
    LWS_WORKER_INDEX_LABEL,
    render_k8s,
    to_yaml,
)
from sm120kit.errors import UserError  # noqa: E402
from sm120kit.profiles.loader import load_profile  # noqa: E402
from sm120kit.target import resolve_target  # noqa: E402

VERSION = "0.5.23"
SCHEMAS = ROOT / "tests" / "fixtures" / "k8s"
GOLDEN = ROOT / "tests" / "golden" / "deploy" / "k8s"
IMAGE = "registry.example.com/sm120kit-sglang:0.5.23"
KEY = ["server.api_key_env=SGLANG_API_KEY"]
MULTI = ["parallel.nnodes=2", "parallel.tp=16", "parallel.dist_init_addr=10.0.0.1:5000", *KEY]
# (golden file, profile, --set, namespace)
CASES = {
    "one-node": ("qwen3-30b-a3b-nvfp4-1gpu", KEY, None),
    "multi-node": ("glm5-nvfp4", MULTI, "llm"),
    "fleet": ("qwen3-30b-a3b-nvfp4-x8", KEY, "llm"),
}


def render_case(name: str, target, python: str = "python3") -> list[dict]:
    profile_name, sets, namespace = CASES[name]
    return render_k8s(load_profile(profile_name, None, sets), target, str(python), IMAGE, namespace)


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    from support.standin import make_env_python

    return make_env_python(tmp_path_factory.mktemp("k8s-env"), VERSION)


@pytest.fixture(scope="module")
def target(env_python):
    return resolve_target(str(env_python))


# --- the real schemas ---------------------------------------------------------------------


def _strict(schema):
    """A structural CRD schema as the API server applies it with strict field validation:
    an object that lists its properties takes no others (unless it says it keeps unknown
    fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


def published(name: str) -> bytes:
    """A schema file as published (stored xz-compressed: 2.7 MB of JSON and YAML)."""
    return lzma.decompress((SCHEMAS / f"{name}.xz").read_bytes())


def _validators() -> dict:
    import jsonschema

    out = {}
    for kind, file in (
        ("Deployment", "deployment-apps-v1.json"),
        ("StatefulSet", "statefulset-apps-v1.json"),
        ("Service", "service-v1.json"),
    ):
        schema = json.loads(published(file))
        out[kind] = jsonschema.validators.validator_for(schema, jsonschema.Draft4Validator)(schema)
    crd = yaml.safe_load(published("leaderworkerset.x-k8s.io_leaderworkersets.yaml"))
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    out["LeaderWorkerSet"] = jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))
    return out


VALIDATORS = None


def validate(doc: dict) -> list[str]:
    global VALIDATORS
    VALIDATORS = VALIDATORS or _validators()
    return [
        f"{doc['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in VALIDATORS[doc["kind"]].iter_errors(doc)
    ]


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_validates_against_the_real_schema(case, target):
    docs = render_case(case, target)
    for doc in docs:
        assert validate(doc) == []
    # parsed back from the YAML text it is the same (no aliases, nothing lost)
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs


def _templates(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [spec["template"]] if "template" in spec else []


@pytest.mark.parametrize("case", CASES)
def test_what_the_api_server_checks_beyond_the_schema_holds(case, target):
    """Selectors match their pods' labels, every Service reaches a pod's named port, names
    are DNS labels and label values fit (apimachinery's validation, not the schema's)."""
    import re

    docs = render_case(case, target)
    label = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
    value = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
    pods = [t for d in docs for t in _templates(d)]
    for doc in docs:
        name = doc["metadata"]["name"]
        assert label.fullmatch(name) and len(name) <= 63, name
        for v in doc["metadata"]["labels"].values():
            assert value.fullmatch(v) and len(v) <= 63, v
        if "selector" in doc["spec"] and doc["kind"] != "Service":
            for t in _templates(doc):
                assert doc["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()
        if doc["kind"] == "Service":
            # LWS labels its pods with their worker index itself
            wanted = {k: v for k, v in doc["spec"]["selector"].items() if k != LWS_WORKER_INDEX_LABEL}
            reached = [t for t in pods if wanted.items() <= t["metadata"]["labels"].items()]
            assert reached, f"Service {name} selects no pod"
            for port in doc["spec"]["ports"]:
                assert any(
                    p["name"] == port["targetPort"]
                    for t in reached
                    for c in t["spec"]["containers"]
                    for p in c.get("ports", [])
                )


def test_the_schemas_are_strict_enough_to_catch_a_wrong_field(target):
    """The validation has teeth: an unknown field and a wrong type are errors, in the core
    schemas and in the LWS CRD's."""
    service, deployment = render_case("one-node", target)
    bad = copy.deepcopy(deployment)
    bad["spec"]["replica"] = 1
    assert any("replica" in e for e in validate(bad))
    bad = copy.deepcopy(service)
    bad["spec"]["ports"][0]["port"] = "http"
    assert validate(bad)
    lws = render_case("multi-node", target)[1]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    assert any("sizee" in e for e in validate(bad))
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagee"] = "x"
    assert any("imagee" in e for e in validate(bad))


def test_the_fixtures_are_the_files_named_in_their_readme():
    import hashlib

    readme = (SCHEMAS / "README.md").read_text()
    stored = sorted(SCHEMAS.glob("*.xz"))
    assert len(stored) == 4
    for path in stored:
        assert hashlib.sha256(published(path.stem)).hexdigest() in readme, path.name


# --- the argv each pod runs is serve's ----------------------------------------------------


def dry_run(cli, env_python, name: str, sets: list[str], rank: int | None = None) -> dict:
    argv = ["serve", name, "--dry-run", "--python", env_python, "--no-patch-check"]  # its patches: not the point
    argv += [w for s in [*sets, "server.host=0.0.0.0"] for w in ("--set", s)]
    argv += ["--node-rank", str(rank)] if rank is not None else []
    code, doc = cli.json(*argv)
    assert code == 0
    return doc


def container(pod: dict) -> dict:
    [c] = pod["spec"]["containers"]
    return c


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_one_node_runs_serves_argv_in_a_deployment_that_never_needs_two_gpu_sets(cli, env_python, target):
    profile = load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, KEY)
    service, deployment = render_k8s(profile, target, str(env_python), IMAGE, None)
    want = dry_run(cli, env_python, "qwen3-30b-a3b-nvfp4-1gpu", KEY)
    spec = deployment["spec"]
    assert (deployment["kind"], spec["replicas"], spec["strategy"]) == ("Deployment", 1, {"type": "Recreate"})
    c = container(spec["template"])
    assert c["args"] == want["argv"]  # the key as "$SGLANG_API_KEY", as serve prints it
    env = env_of(c)
    assert {k: env[k] for k in want["env"]} == want["env"]
    assert env["SGLANG_API_KEY"] == {"secretKeyRef": {"name": "qwen3-30b-a3b-nvfp4-1gpu-api-key", "key": "api-key"}}
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    h = profile.health  # startup 900 s, probes every 10 s with 30 s each, 3 failures
    assert c["startupProbe"]["httpGet"] == {"path": "/health_generate", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= h.startup_timeout_s
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health_generate"
        assert (c[probe]["periodSeconds"], c[probe]["timeoutSeconds"], c[probe]["failureThreshold"]) == (10, 30, 3)
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 60  # health.stop_timeout_s
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 30000
    labels = deployment["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "sm120kit"
    assert labels["app.kubernetes.io/instance"] == "qwen3-30b-a3b-nvfp4-1gpu"
    assert labels["app.kubernetes.io/version"] == VERSION


def test_a_host_path_and_another_secret_are_options(target):
    profile = load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, KEY)
    _, deployment = render_k8s(
        profile, target, "python3", IMAGE, "llm", secret="my-key", hf_cache_host_path="/srv/hf", shm_size="64Gi"
    )
    pod = deployment["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["hf-cache"] == {"name": "hf-cache", "hostPath": {"path": "/srv/hf", "type": "Directory"}}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "64Gi"
    assert env_of(container(pod))["SGLANG_API_KEY"]["secretKeyRef"]["name"] == "my-key"
    assert deployment["metadata"]["namespace"] == "llm"


@pytest.mark.parametrize("nnodes", [2, 3])
def test_multi_node_is_a_leader_worker_set_whose_pods_run_each_ranks_argv(cli, env_python, target, nnodes):
    sets = [f"parallel.nnodes={nnodes}", f"parallel.tp={8 * nnodes}", "parallel.dist_init_addr=10.0.0.1:5000", *KEY]
    profile = load_profile("glm5-nvfp4", None, sets)
    service, lws = render_k8s(profile, target, str(env_python), IMAGE, None)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == nnodes
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    # kubelet expands $(VAR) in args from the variables LWS injects into every container
    address = "glm5-nvfp4-0.glm5-nvfp4.default"  # what LWS puts in LWS_LEADER_ADDRESS
    at = [f"parallel.dist_init_addr={address}:5000"]
    expand = {f"$({LWS_LEADER_ADDRESS})": address}
    assert [_expand(a, expand) for a in leader["args"]] == dry_run(cli, env_python, "glm5-nvfp4", sets + at, 0)["argv"]
    for rank in range(1, nnodes):
        expand[f"$({LWS_WORKER_INDEX})"] = str(rank)
        want = dry_run(cli, env_python, "glm5-nvfp4", sets + at, rank)["argv"]
        assert [_expand(a, expand) for a in worker["args"]] == want
    assert "readinessProbe" in leader and "startupProbe" in leader
    assert "readinessProbe" not in worker and "ports" not in worker  # rank > 0 serves no HTTP
    assert leader["resources"] == worker["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert service["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    # LWS makes the headless Service behind LWS_LEADER_ADDRESS under its own name, only if none exists
    assert service["metadata"]["name"] != lws["metadata"]["name"]


def test_a_dollar_in_a_value_reaches_sglang_as_itself(target):
    """kubelet reads $(X) and $$ in args: a value's own "$" is written "$$" (kubelet gives "$")."""
    profile = load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, [*KEY, "model.served_name=q$(x)"])
    _, deployment = render_k8s(profile, target, "python3", IMAGE, None)
    args = container(deployment["spec"]["template"])["args"]
    assert args[args.index("--served-model-name") + 1] == "q$$(x)"


def _expand(word: str, values: dict) -> str:
    for ref, value in values.items():
        word = word.replace(ref, value)
    return word


def test_fleet_replicas_each_run_a_replicas_argv_and_the_router_routes_to_every_one(cli, env_python, target):
    from sm120kit.fleet.member import ROUTER_KEY_ENV, ROUTER_WITH_KEY
    from sm120kit.fleet.router import read_router_schema, router_argv

    profile = load_profile("qwen3-30b-a3b-nvfp4-x8", None, KEY)
    headless, replicas, router_service, router = render_k8s(profile, target, str(env_python), IMAGE, "llm")
    want = dry_run(cli, env_python, "qwen3-30b-a3b-nvfp4-x8", [*KEY, "fleet.replica_host=0.0.0.0"])
    assert replicas["kind"] == "StatefulSet" and replicas["spec"]["replicas"] == 8
    c = container(replicas["spec"]["template"])
    replica0 = want["replicas"][0]
    assert c["args"] == replica0["argv"]
    env = env_of(c)
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin gives each pod its GPU
    assert {k: env[k] for k in replica0["env"] if not k.startswith("CUDA_")} == {
        k: v for k, v in replica0["env"].items() if not k.startswith("CUDA_")
    }
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert headless["spec"]["clusterIP"] == "None" and replicas["spec"]["serviceName"] == headless["metadata"]["name"]
    urls = [f"http://qwen3-30b-a3b-nvfp4-x8-replicas-{i}.qwen3-30b-a3b-nvfp4-x8-replicas.llm:30001" for i in range(8)]
    [rc] = router["spec"]["template"]["spec"]["containers"]
    # the fleet's router argv, with the worker URLs and a registration window of two startup budgets
    window = ["--worker-startup-timeout-secs", str(2 * 900)]
    policy = want["router"]["argv"].index("--policy")
    wanted = want["router"]["argv"][: policy + 2] + window + want["router"]["argv"][policy + 2 :]
    # under the scrubber, its key from its environment (the Secret), as the fleet starts it: never in argv
    scrub = [str(env_python), "-m", "sm120kit.serve.scrub", ROUTER_KEY_ENV, "--"]
    run = [wanted[0], "-c", ROUTER_WITH_KEY, *wanted[3:], "--worker-urls", *urls]
    assert rc["command"] == [*scrub, *run]
    assert env_of(rc) == {
        ROUTER_KEY_ENV: {"secretKeyRef": {"name": "qwen3-30b-a3b-nvfp4-x8-api-key", "key": "api-key"}}
    }
    options = {"policy": "cache_aware", "worker_startup_timeout_secs": 1800}
    built = router_argv(
        str(env_python), read_router_schema(target), options, host="0.0.0.0", port=30000, worker_urls=urls, source=""
    )
    assert run == [built[0], "-c", ROUTER_WITH_KEY, *built[3:]]  # the router's own argv renderer, worker URLs included
    # every serving container declares the port its argv gives (its probes and Service go there)
    assert c["ports"][0]["containerPort"] == int(c["args"][c["args"].index("--port") + 1]) == 30001
    assert rc["ports"][0]["containerPort"] == 30000
    assert router_service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_a_routers_registration_window_from_the_profile_is_kept(target):
    sets = [*KEY, "fleet.router.worker_startup_timeout_secs=60"]
    router = render_k8s(load_profile("qwen3-30b-a3b-nvfp4-x8", None, sets), target, "python3", IMAGE, None)[-1]
    [rc] = router["spec"]["template"]["spec"]["containers"]
    i = rc["command"].index("--worker-startup-timeout-secs")
    assert rc["command"][i + 1] == "60" and rc["command"].count("--worker-startup-timeout-secs") == 1
    assert "http://qwen3-30b-a3b-nvfp4-x8-replicas-0.qwen3-30b-a3b-nvfp4-x8-replicas:30001" in rc["command"]


def test_names_are_dns_labels():
    from sm120kit.deploy.k8s import dns_name

    assert dns_name("glm5-nvfp4") == "glm5-nvfp4"
    assert dns_name("My_Profile.v2") == "my-profile-v2"
    assert dns_name("8x-gpus") == "p-8x-gpus"
    assert len(dns_name("a" * 80)) <= 40


# --- the entrypoint, run ------------------------------------------------------------------


def test_the_entrypoint_proves_the_patches_and_execs_what_serve_runs(tmp_path, env_python, target):
    """/bin/sh runs the container's command: `sm120kit patch --verify` (a recording stand-in
    on PATH), then exec of the args, with the key moved into a 0600 --config file exactly as
    serve's resolve_argv does it."""
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.render import render
    from sm120kit.serve.command import resolve_argv

    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.jsonl"
    recorder = (
        f"#!{sys.executable}\nimport json, os, sys\n"
        "if sys.argv[1:2] == ['-c'] or sys.argv[1:3] == ['-m', 'sm120kit.serve.scrub']:  # the script's own\n"
        f"    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "print('server_args=ServerArgs(api_key=' + repr(os.environ.get('SGLANG_API_KEY')) + ')')\n"
    )
    for name in ("sm120kit", "python3"):
        (bindir / name).write_text(recorder)
        (bindir / name).chmod(0o755)
    profile = load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, KEY)
    _, deployment = render_k8s(profile, target, str(bindir / "python3"), IMAGE, None)
    c = container(deployment["spec"]["template"])
    key_file = tmp_path / "api-key.yaml"
    assert "$(" not in c["command"][2]  # kubelet would read it as a variable reference
    command = [w.replace(KEY_FILE, str(key_file)) for w in c["command"]]
    secret = "k'e\"y $x \\ ok é"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SGLANG_API_KEY": secret}
    ran = subprocess.run([*command, *c["args"]], env=env, check=True, timeout=30, capture_output=True)
    patch, server = [json.loads(line) for line in calls.read_text().splitlines()]
    # what the server logs (sglang's server_args line, key included) reaches the pod's log scrubbed
    assert secret.encode() not in ran.stdout and b"server_args=ServerArgs(api_key=" in ran.stdout
    only = [w for p in profile.patches for w in ("--only", p)]
    assert patch == ["patch", "--verify", *only, "--python", str(bindir / "python3")]
    in_pod = load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, [*KEY, "server.host=0.0.0.0"])
    launch = render(in_pod, read_schema(target.find("sglang")), str(bindir / "python3"))
    serves, _, _ = resolve_argv(launch, {"SGLANG_API_KEY": secret}, tmp_path / "serve-key.yaml")
    assert [str(bindir / "python3"), *server] == [w.replace("serve-key.yaml", "api-key.yaml") for w in serves]
    assert secret not in server
    assert key_file.read_bytes() == (tmp_path / "serve-key.yaml").read_bytes()  # serve's own file, byte for byte
    assert yaml.safe_load(key_file.read_text()) == {"api-key": secret}
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600


def test_without_config_the_entrypoint_passes_the_key_in_argv(tmp_path):
    """A release without --config (none in the proven window) takes the key in argv, as
    serve gives it to such a release."""
    from sm120kit.deploy.k8s import entrypoint

    out = tmp_path / "argv.json"
    show = f"import json, sys; open({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))"
    script = entrypoint([], "SGLANG_API_KEY", config_flag=False)
    argv = [sys.executable, "-c", show, "--api-key", "$SGLANG_API_KEY", "--port", "1"]
    env = {"PATH": "/usr/bin:/bin", "SGLANG_API_KEY": "s e'c\"r"}
    subprocess.run(["/bin/sh", "-c", script, "sm120kit-entrypoint", *argv], env=env, check=True, timeout=30)
    assert json.loads(out.read_text()) == ["--api-key", "s e'c\"r", "--port", "1"]


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-nvfp4-1gpu", "qwen3-30b-a3b-nvfp4-x8"])
def test_a_profile_without_a_key_takes_one_from_the_secret_in_a_pod(target, name):
    """A pod binds 0.0.0.0: public, so keyed — SGLANG_API_KEY from the Secret, as with the key set."""
    assert render_k8s(load_profile(name, None, []), target, "python3", IMAGE, None) == render_k8s(
        load_profile(name, None, KEY), target, "python3", IMAGE, None
    )
    loose = render_k8s(
        load_profile(name, None, ["server.allow_public_without_key=true"]), target, "python3", IMAGE, None
    )
    assert "secretKeyRef" not in json.dumps(loose)


@pytest.mark.parametrize(
    ("name", "sets", "image", "expected"),
    [
        ("qwen3-30b-a3b-nvfp4-1gpu", KEY, "", "needs the image"),
        ("glm5-nvfp4", ["parallel.nnodes=2", "parallel.tp=16", *KEY], IMAGE, "no rendezvous port"),
        (
            "glm5-nvfp4",
            ["parallel.nnodes=2", "parallel.tp=16", "parallel.dist_init_addr=10.0.0.1", *KEY],
            IMAGE,
            "port",
        ),
        ("sm120-base", KEY, IMAGE, "cannot serve"),
        ("qwen3-30b-a3b-nvfp4-1gpu", KEY, "registry/img: 1", "holds a space"),
    ],
)
def test_bad_input_is_a_user_error(target, name, sets, image, expected):
    with pytest.raises(UserError) as err:
        render_k8s(load_profile(name, None, sets), target, "python3", image, None)
    assert expected in str(err.value)


# --- golden files -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_yaml_matches_the_golden_file(case, target):
    path = GOLDEN / f"{case}.yaml"
    assert path.exists(), f"{path} is missing: write it with `python tests/test_deploy_k8s.py`"
    assert to_yaml(render_case(case, target)) == path.read_text(), (
        f"{path.name} differs: if the change is meant, rewrite it with `python tests/test_deploy_k8s.py` "
        "and read the diff"
    )


def test_the_cli_prints_the_same_manifests(cli, env_python, target):
    """Through `sm120kit render k8s`: --python picks the environment whose sglang's flags are
    read here, --image-python the interpreter the pods run."""
    name, sets, namespace = CASES["fleet"]
    given = ["--python", env_python, *[w for s in sets for w in ("--set", s)]]
    image = ["--image", IMAGE, "--image-python", "/opt/venv/bin/python"]
    code, out, err = cli("render", "k8s", name, *image, "--namespace", namespace, *given)
    assert code == 0, err
    printed = [d for d in yaml.safe_load_all(out) if d is not None]
    assert printed == render_case("fleet", target, "/opt/venv/bin/python")
    code, out, err = cli("render", "k8s", name, *given)
    assert code == 2 and "--image" in err and not out


def regenerate() -> None:
    """Write the golden files (run by hand: `python tests/test_deploy_k8s.py`)."""
    import tempfile

    from support.standin import make_env_python

    with tempfile.TemporaryDirectory() as tmp:
        target = resolve_target(str(make_env_python(Path(tmp), VERSION)))
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            (GOLDEN / f"{case}.yaml").write_text(to_yaml(render_case(case, target)))
            print(f"wrote {GOLDEN / f'{case}.yaml'}")


if __name__ == "__main__":
    regenerate()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"namespace": "Bad_NS"}, "is not a namespace name"),
        ({"hf_cache_host_path": "rel/dir"}, "is not an absolute path"),
        ({"shm_size": "64GB"}, "is not a Kubernetes quantity"),
    ],
)
def test_options_kubectl_would_refuse_are_refused_here(target, options, expected):
    namespace = options.pop("namespace", None)
    with pytest.raises(UserError) as err:
        render_k8s(load_profile("qwen3-30b-a3b-nvfp4-1gpu", None, KEY), target, "python3", IMAGE, namespace, **options)
    assert expected in str(err.value)
