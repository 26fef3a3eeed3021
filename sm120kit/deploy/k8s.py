"""A launch profile as Kubernetes manifests: Kubernetes is the supervisor there (probes,
restarts), so each pod runs the sglang argv that `sm120kit serve PROFILE --dry-run
--node-rank N --set server.host=0.0.0.0` renders (the same render()), after
`sm120kit patch --verify` in the same container.

- One node: a Deployment of one pod, strategy Recreate (a rolling update would want a
  second set of GPUs while the first still holds them), and a Service.
- Several nodes (parallel.nnodes > 1): a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1)
  of size nnodes. The leader is rank 0; every worker runs rank 1's argv with --node-rank
  $(LWS_WORKER_INDEX); --dist-init-addr is $(LWS_LEADER_ADDRESS) at the profile's
  rendezvous port. LWS injects LWS_LEADER_ADDRESS, LWS_WORKER_INDEX and LWS_GROUP_SIZE into
  every container (api/leaderworkerset/v1/leaderworkerset_types.go, pkg/utils/pod/
  pod_utils.go AddLWSVariables) and kubelet expands $(NAME) in args. The Service selects
  the leader by LWS's own label leaderworkerset.sigs.k8s.io/worker-index = "0".
- A fleet: the replicas as one StatefulSet (one pod per replica, each with its GPUs; a
  headless Service gives each a stable DNS name for the router's --worker-urls, and a
  StatefulSet's rolling update deletes a pod before it starts its successor, so it never
  needs spare GPUs), and sglang's router as a Deployment and a Service, its argv the
  fleet's (router_argv) with the replicas' URLs and a registration window that covers
  their start.

Pods bind 0.0.0.0 (a loopback bind is unreachable from the Service and from kubelet's
probes), so the profile's guard for a public bind applies: a pod takes an API key, in the
variable server.api_key_env names (SGLANG_API_KEY when the profile names none), unless the
profile says allow_public_without_key.
The key comes from a Secret into that variable (secretKeyRef, never inline); the entrypoint
writes it to a private file on a memory volume and hands sglang `--config FILE`, as `serve`
does, so no process list shows it; sglang's own server_args log line carries it, so the
server runs under sm120kit.serve.scrub, which writes "$NAME" in its place in the pod's log.
GPUs are the device plugin's to assign: a replica's CUDA_VISIBLE_DEVICES from the node's
plan is not carried into its pod.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.profiles.render import EnvRef, Launch

if TYPE_CHECKING:
    from sm120kit.fleet.plan import FleetPlan
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Target

GPU = "nvidia.com/gpu"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"  # "<lws>-<group>.<subdomain>.<namespace>"
LEADER = "sm120kit-lws-leader-address"  # a stand-in for the leader's address while the argv renders
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"  # 0 for the leader, 1 .. size-1 for the workers
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
HEALTH_PATH = "/health_generate"  # sglang answers it without the API key (utils/auth.py: /health*)
ROUTER_LIVENESS, ROUTER_READINESS = "/liveness", "/readiness"
HF_CACHE = "/root/.cache/huggingface"  # the Hugging Face default for root (the sglang images' user)
KEY_DIR = "/run/sm120kit"
KEY_FILE = f"{KEY_DIR}/api-key.yaml"
SECRET_KEY = "api-key"  # the key inside the Secret
DEFAULT_KEY_ENV = "SGLANG_API_KEY"  # the variable a profile without server.api_key_env gets in a pod
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # what /dev/shm's sizeLimit takes
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123: a namespace's name
DEFAULT_SHM = "32Gi"  # sglang's own docker instructions: --shm-size 32g
DEFAULT_CLAIM = "hf-cache"
SERVER_CONTAINER = "sglang"


def render_k8s(
    profile: Profile,
    target: Target,
    python: str,
    image: str,
    namespace: str | None,
    *,
    secret: str | None = None,
    hf_cache_claim: str = DEFAULT_CLAIM,
    hf_cache_host_path: str | None = None,
    shm_size: str = DEFAULT_SHM,
) -> list[dict]:
    """The manifests, in apply order. python: the interpreter inside the image.
    secret: the Secret holding the API key under "api-key" (default: <profile>-api-key).
    The model volume: the PersistentVolumeClaim hf_cache_claim, or the node's directory
    hf_cache_host_path, mounted where the Hugging Face cache is looked for."""
    if not image:
        raise UserError("render k8s needs the image the pods run", "add --image IMAGE (sglang, sm120kit installed)")
    if not QUANTITY.fullmatch(shm_size):
        raise UserError(f"--shm-size {shm_size!r} is not a Kubernetes quantity", "give one such as 32Gi or 64Gi")
    if any(c.isspace() for c in image):
        raise UserError(f"--image {image!r} holds a space: not an image reference", "give REGISTRY/NAME:TAG")
    if namespace is not None and not DNS_LABEL.fullmatch(namespace):
        raise UserError(
            f"--namespace {namespace!r} is not a namespace name (lowercase letters, digits and '-', at most 63)",
            "give the namespace as kubectl lists it: kubectl get namespaces",
        )
    if hf_cache_host_path is not None and not hf_cache_host_path.startswith("/"):
        raise UserError(
            f"--hf-cache-host-path {hf_cache_host_path!r} is not an absolute path (a node's directory)",
            "give the directory's absolute path on the node",
        )
    from sm120kit.deploy import require_distinct_ports

    require_distinct_ports(profile)  # as serve's preflight: a UserError before anything is rendered
    profile = _in_a_pod(profile)
    if profile.parallel.nnodes > 1 and profile.fleet is None:
        rendezvous_port(profile)  # a UserError before anything is rendered
    k = _K8s(profile, image, namespace, secret, hf_cache_claim, hf_cache_host_path, shm_size)
    if profile.fleet is not None:
        return k.fleet(target, python)
    if profile.parallel.nnodes > 1:
        return k.multi_node(target, python)
    return k.one_node(_render(profile, target, python))


def to_yaml(docs: list[dict]) -> str:
    """The documents as one YAML stream: keys in the order written, block style."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # a dict used twice is written out twice, not as &id001
            return True

    def text(dumper, data: str):  # the entrypoint script as the lines it is
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000)


def dns_name(text: str) -> str:
    """A DNS-1035 label from a profile name: lowercase letters, digits and '-'."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    if not out or not out[0].isalpha():
        out = f"p-{out}".rstrip("-")
    return out[:40].rstrip("-")  # room for "-router", "-replicas-N", LWS's "-G-W"


def rendezvous_port(profile: Profile) -> int:
    """The port of parallel.dist_init_addr (the host is the leader pod's on Kubernetes); a
    UserError when there is none (the check systemd and docker make: deploy.require_rendezvous)."""
    from sm120kit.deploy import require_rendezvous

    require_rendezvous(profile)
    return int((profile.parallel.dist_init_addr or "").rpartition(":")[2])


def _in_a_pod(profile: Profile) -> Profile:
    """The profile as a pod serves it: bound to 0.0.0.0 (replicas too), validated again so
    that a public bind without an API key is refused as `serve` refuses it."""
    from pydantic import ValidationError

    from sm120kit.profiles.model import Profile

    doc = profile.model_dump()
    doc["server"]["host"] = "0.0.0.0"
    if not doc["server"]["api_key_env"] and not doc["server"]["allow_public_without_key"]:
        doc["server"]["api_key_env"] = DEFAULT_KEY_ENV  # a public bind takes a key: the Secret's
    if doc.get("fleet") is not None:
        doc["fleet"]["replica_host"] = "0.0.0.0"
    try:
        return Profile.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise UserError(
            f"profile {profile.name} ({profile.source}): a pod binds 0.0.0.0 (its Service and probes reach it "
            f"there), and {problems}",
            "give the server an API key: --set server.api_key_env=SGLANG_API_KEY and a Secret with it "
            "(or --set server.allow_public_without_key=true)",
        ) from None


def _render(profile: Profile, target: Target, python: str) -> Launch:
    from sm120kit.profiles.flags import installed_schema
    from sm120kit.profiles.render import render

    hint = "render for the image's release: point sm120kit at an environment with that sglang (--python EXE)"
    return render(profile, installed_schema(target, hint), python)


def entrypoint(patches: list[str], key_env: str | None, config_flag: bool) -> str:
    """The container's script, run with the argv as its arguments: apply and prove the
    profile's patches (those an image lost to a pip upgrade come back; `--only ID` as the
    systemd and docker patch step), then exec the argv. The API key stands in the argv as
    "$NAME" (as `serve --dry-run --json` prints it): as `serve` does, it goes into a 0600
    YAML file that sglang reads with --config, written by the image's python with the very
    bytes serve writes; a release without --config takes it in argv. With a key, the argv
    runs under sm120kit.serve.scrub (the log is the pod's: no key in it). The script holds
    no "$(" (kubelet would take it for a variable reference)."""
    lines = ["set -eu"]
    if patches:  # the profile's patches, as serve's preflight checks them
        lines += ["sm120kit patch --verify \\", *(f"  --only {shlex.quote(p)} \\" for p in patches), '  --python "$1"']
    if key_env:
        if config_flag:
            write = f'import json, os; print("api-key: " + json.dumps(os.environ["{key_env}"]))'
            swap = ["    --api-key) arg=--config ;;"]
            value = [f"    '${key_env}')", f"      \"$python\" -c '{write}' > {KEY_FILE}", f"      arg={KEY_FILE} ;;"]
        else:
            swap, value = [], [f"    '${key_env}') arg=\"${key_env}\" ;;"]
        lines += ["umask 077", 'python="$1"', "for arg do", "  shift", "  case $arg in", *swap, *value, "  esac"]
        lines += ['  set -- "$@" "$arg"', "done"]
        # sglang logs its server_args, key included: the pod's log (kubectl logs) gets "$NAME" instead
        lines.append(f'exec "$python" -m sm120kit.serve.scrub {key_env} -- "$@"')
    else:
        lines.append('exec "$@"')
    return "\n".join(lines) + "\n"


def argv_words(argv: list[str | EnvRef]) -> list[str]:
    """A launch's argv as pod args: the key stays "$NAME" (the entrypoint replaces it); a
    value's own "$" is written "$$", which kubelet turns back into "$" (it would read
    "$(X)" as a variable)."""
    return [f"${a.name}" if isinstance(a, EnvRef) else a.replace("$", "$$") for a in argv]


STARTUP_WINDOW = "worker_startup_timeout_secs"


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


class _K8s:
    def __init__(
        self,
        profile: Profile,
        image: str,
        namespace: str | None,
        secret: str | None,
        claim: str,
        host_path: str | None,
        shm_size: str,
    ) -> None:
        self.p, self.image, self.namespace = profile, image, namespace
        self.base = dns_name(profile.name)
        self.secret = secret or f"{self.base}-api-key"
        self.claim, self.host_path, self.shm_size = claim, host_path, shm_size

    # --- metadata -------------------------------------------------------------------------

    def labels(self, instance: str, component: str, name: str = "sglang", version: str | None = None) -> dict:
        labels = {
            "app.kubernetes.io/name": name,
            "app.kubernetes.io/instance": instance,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": self.base,
            "app.kubernetes.io/managed-by": "sm120kit",
        }
        if version:  # a label value: [A-Za-z0-9._-], at most 63 (a local build's "0.5.23+cu128")
            labels["app.kubernetes.io/version"] = re.sub(r"[^A-Za-z0-9._-]", "-", version)[:63].strip("-._")
        return labels

    def meta(self, name: str, labels: dict) -> dict:
        meta: dict[str, object] = {"name": name}
        if self.namespace:
            meta["namespace"] = self.namespace
        meta["labels"] = labels
        return meta

    @staticmethod
    def selector(labels: dict) -> dict:
        return {k: labels[k] for k in ("app.kubernetes.io/instance", "app.kubernetes.io/component")}

    def service(self, name: str, labels: dict, selector: dict, port: int, headless: bool = False) -> dict:
        spec: dict = {}
        if headless:
            # every replica's DNS name resolves from its start: the router's health checks decide
            spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
        spec |= {
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        }
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(name, labels), "spec": spec}

    # --- the sglang pod -------------------------------------------------------------------

    def probes(self, path: str = HEALTH_PATH, startup: bool = True) -> dict:
        h = self.p.health
        period, timeout = _seconds(h.probe_interval_s), _seconds(h.probe_timeout_s)
        get = {"path": path, "port": "http"}
        common = {"periodSeconds": period, "timeoutSeconds": timeout}
        probes = {}
        if startup:  # kubelet gives a starting pod failureThreshold x periodSeconds
            probes["startupProbe"] = {
                "httpGet": get,
                **common,
                "failureThreshold": max(1, math.ceil(h.startup_timeout_s / period)),
            }
        probes["readinessProbe"] = {"httpGet": get, **common, "failureThreshold": h.failures_before_restart}
        probes["livenessProbe"] = {"httpGet": get, **common, "failureThreshold": h.failures_before_restart}
        return probes

    def env(self, launch: Launch, drop: tuple[str, ...] = ()) -> list[dict]:
        env: list[dict[str, object]] = [{"name": k, "value": v} for k, v in sorted(launch.env.items()) if k not in drop]
        key_env = self.p.server.api_key_env
        if key_env:
            env.append({"name": key_env, "valueFrom": {"secretKeyRef": {"name": self.secret, "key": SECRET_KEY}}})
        return env

    def server_pod(
        self, labels: dict, launch: Launch, argv: list[str], serves: bool, gpus: int, port: int | None = None
    ) -> dict:
        """The pod template of one sglang process (one node of it, with its GPUs): serves =
        it answers HTTP, on port (default server.port: a fleet's replica has its own)."""
        hf_home = self.p.env.get("HF_HOME", HF_CACHE)
        key_env = self.p.server.api_key_env
        container: dict[str, object] = {
            "name": SERVER_CONTAINER,
            "image": self.image,
            "command": [
                "/bin/sh",
                "-c",
                entrypoint(self.p.patches, key_env, launch.config_flag),
                "sm120kit-entrypoint",
            ],
            "args": argv,
            "env": self.env(launch, drop=("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")),
        }
        if serves:
            container["ports"] = [{"name": "http", "containerPort": port or self.p.server.port, "protocol": "TCP"}]
            container |= self.probes()
        container["resources"] = {"limits": {GPU: gpus}}
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "hf-cache", "mountPath": hf_home}]
        volumes = [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}},
            {"name": "hf-cache", **self.model_volume()},
        ]
        if key_env and launch.config_flag:
            mounts.append({"name": "api-key", "mountPath": KEY_DIR})
            volumes.append({"name": "api-key", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        container["volumeMounts"] = mounts
        return {
            "metadata": {"labels": labels},
            "spec": {
                # no SGLANG_*_PORT-style variables from the namespace's Services in sglang's environment
                "enableServiceLinks": False,
                "terminationGracePeriodSeconds": _seconds(self.p.health.stop_timeout_s),
                "containers": [container],
                "volumes": volumes,
            },
        }

    def model_volume(self) -> dict:
        if self.host_path:
            return {"hostPath": {"path": self.host_path, "type": "Directory"}}
        return {"persistentVolumeClaim": {"claimName": self.claim}}

    def router_argv(self, target: Target, python: str, plan: FleetPlan, urls: list[str]) -> list[str]:
        """The router's argv (sm120kit.fleet.router.router_argv, as the fleet renders it) with
        the replicas' URLs. The router drops a --worker-urls worker that is not healthy within
        --worker-startup-timeout-secs, for good (sglang-router 0.3.2, run: "Failed job:
        type=AddWorker"): unless the profile says, the window is two of the replicas' startup
        budgets (a first start, and the one after kubelet's startup probe gave up on it)."""
        from sm120kit.fleet.router import read_router_schema, router_argv

        schema = read_router_schema(target)
        assert schema is not None, "render_fleet refuses a target without sglang-router"
        options = dict(plan.router_options)
        if STARTUP_WINDOW in schema.options:
            options.setdefault(STARTUP_WINDOW, 2 * _seconds(self.p.health.startup_timeout_s))
        return router_argv(
            python,
            schema,
            options,
            host=plan.router_host,
            port=plan.router_port,
            worker_urls=urls,
            source=self.p.source,
        )

    # --- the three shapes -----------------------------------------------------------------

    def one_node(self, launch: Launch) -> list[dict]:
        labels = self.labels(self.base, "server", version=launch.sglang)
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(self.base, labels),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # the new pod needs the GPUs the old one holds
                "selector": {"matchLabels": self.selector(labels)},
                "template": self.server_pod(
                    labels, launch, argv_words(launch.argv), serves=True, gpus=self.p.node.gpus
                ),
            },
        }
        service = self.service(self.base, labels, self.selector(labels), self.p.server.port)
        return [service, deployment]

    def multi_node(self, target: Target, python: str) -> list[dict]:
        port = rendezvous_port(self.p)
        addr = f"{LEADER}:{port}"  # kubelet's $(LWS_LEADER_ADDRESS), put in after argv_words escapes "$"
        parallel = self.p.parallel.model_copy(update={"node_rank": 0, "dist_init_addr": addr})
        leader = _render(self.p.model_copy(update={"parallel": parallel}), target, python)
        worker = _render(
            self.p.model_copy(update={"parallel": parallel.model_copy(update={"node_rank": 1})}), target, python
        )
        leader_argv, worker_argv = (
            [w.replace(LEADER, f"$({LWS_LEADER_ADDRESS})") for w in argv_words(r.argv)] for r in (leader, worker)
        )
        worker_argv[worker_argv.index("--node-rank") + 1] = f"$({LWS_WORKER_INDEX})"
        labels = self.labels(self.base, "server", version=leader.sglang)
        lws = {
            "apiVersion": LWS_API,
            "kind": "LeaderWorkerSet",
            "metadata": self.meta(self.base, labels),
            "spec": {
                "replicas": 1,
                # the workers dial the leader's address while it starts: create them at once
                "startupPolicy": "LeaderCreated",
                "leaderWorkerTemplate": {
                    "size": self.p.parallel.nnodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",  # one rank lost: restart the server
                    "leaderTemplate": self.server_pod(labels, leader, leader_argv, True, self.p.node.gpus),
                    "workerTemplate": self.server_pod(labels, worker, worker_argv, False, self.p.node.gpus),
                },
            },
        }
        selector = {**self.selector(labels), LWS_WORKER_INDEX_LABEL: "0"}
        # not the LWS's own name: LWS makes a headless Service of that name (its pods' subdomain,
        # behind LWS_LEADER_ADDRESS) only when none exists
        return [self.service(f"{self.base}-leader", labels, selector, self.p.server.port), lws]

    def fleet(self, target: Target, python: str) -> list[dict]:
        from sm120kit.fleet.launch import render_fleet

        fleet = render_fleet(self.p, target, python)
        in_cluster = [r for r in fleet.plan.replicas if r.port is not None]  # not a url served elsewhere
        first = fleet.plan.here[0]
        assert first.port is not None, "a replica served here has its port"
        launch = fleet.replicas[first.name]
        name, router_name = f"{self.base}-replicas", f"{self.base}-router"
        labels = self.labels(name, "server", version=launch.sglang)
        where = f".{self.namespace}" if self.namespace else ""
        urls = [f"http://{name}-{i}.{name}{where}:{first.port}" for i in range(len(in_cluster))]
        urls += [r.url for r in fleet.plan.replicas if r.port is None]
        pod = self.server_pod(labels, launch, argv_words(launch.argv), True, len(first.gpus), port=first.port)
        replicas = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": self.meta(name, labels),
            "spec": {
                "serviceName": name,
                "replicas": len(in_cluster),
                "podManagementPolicy": "Parallel",  # independent servers: start them together
                "selector": {"matchLabels": self.selector(labels)},
                "template": pod,
            },
        }
        key_env = self.p.server.api_key_env
        router_argv = self.router_argv(target, python, fleet.plan, urls)
        if key_env:  # no config file for the router: the key from its environment, as the fleet starts it
            from sm120kit.fleet.member import ROUTER_KEY_ENV, router_with_key

            router_argv = [python, "-m", "sm120kit.serve.scrub", ROUTER_KEY_ENV, "--", *router_with_key(router_argv)]
        rlabels = self.labels(router_name, "router", name="sglang-router", version=fleet.router_version)
        router_container: dict[str, object] = {
            "name": "router",
            "image": self.image,
            "command": router_argv,
            "ports": [{"name": "http", "containerPort": fleet.plan.router_port, "protocol": "TCP"}],
        }
        if key_env:
            router_container["env"] = [
                {"name": ROUTER_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": self.secret, "key": SECRET_KEY}}}
            ]
        h = self.p.health
        common = {"periodSeconds": _seconds(h.probe_interval_s), "timeoutSeconds": _seconds(h.probe_timeout_s)}
        router_container["readinessProbe"] = {
            "httpGet": {"path": ROUTER_READINESS, "port": "http"},
            **common,
            "failureThreshold": h.failures_before_restart,
        }
        router_container["livenessProbe"] = {
            "httpGet": {"path": ROUTER_LIVENESS, "port": "http"},
            **common,
            "failureThreshold": h.failures_before_restart,
        }
        router = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(router_name, rlabels),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": self.selector(rlabels)},
                "template": {
                    "metadata": {"labels": rlabels},
                    "spec": {"enableServiceLinks": False, "containers": [router_container]},
                },
            },
        }
        return [
            self.service(name, labels, self.selector(labels), first.port, headless=True),
            replicas,
            self.service(router_name, rlabels, self.selector(rlabels), fleet.plan.router_port),
            router,
        ]
