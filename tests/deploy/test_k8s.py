"""deploy/k8s: the kustomize base (CPU) and its GPU overlay, rendered here (`render` below: the
subset of kustomize that our kustomizations use, checked against `kubectl kustomize` where
kubectl is installed). Every built-in resource is valid against the Kubernetes schemas that
kubernetes-validate bundles (offline); KEDA's ScaledObject has no bundled schema, so it is
checked against SCALED_OBJECT_SCHEMA, a JSON schema of the fields we use. The containers run
exactly the command lines of splitserve.launch, drain within their grace period, probe
`splitserve health`, and the autoscalers query only metrics the services export."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.serving.metrics import SLO, DecodeMetrics, EngineStats, PrefillMetrics
from splitserve.launch import service_argv

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE, GPU = K8S / "base", K8S / "overlays" / "gpu"
NAMESPACE = "splitserve"
IN_CLUSTER = {"registry_url": "redis://redis:6379/0", "host": "0.0.0.0", "metrics_port": 9400}
PORTS = {"gateway": 50051, "prefill": 50061, "decode": 50071}
HTTP_PORTS = {"gateway": 8000}
MODEL_ROLES = ("prefill", "decode")
ROLES = ("gateway", *MODEL_ROLES)
# The flags the manifests add to launch's command lines, by rendering.
EXTRA = {
    BASE: {"gateway": ("--shutdown-grace-s", "30"),
           "prefill": ("--shutdown-grace-s", "30", "--cpu-kv-cache-gib", "2"),
           "decode": ("--shutdown-grace-s", "60", "--cpu-kv-cache-gib", "2")},
    GPU: {"gateway": ("--shutdown-grace-s", "30"),
          "prefill": ("--shutdown-grace-s", "30", "--device", "cuda"),
          "decode": ("--shutdown-grace-s", "60", "--device", "cuda")},
}
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # oldest we claim, newest
MARGIN_S = 10  # terminationGracePeriodSeconds >= preStop + --shutdown-grace-s + this
CLUSTER_SCOPED = {"Namespace"}

# --- rendering -------------------------------------------------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}


def strategic_merge(base, patch):
    """The strategic-merge-patch subset our overlay uses: mappings merge key by key; lists of
    mappings that all carry a `name` (containers, volumes, ports, env) merge by name; any
    other value, lists included (a command, tolerations), is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if isinstance(value, str) and value.startswith("$patch"):
                raise NotImplementedError("patch directives are not supported")
            out[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = list(base)
        index = {item["name"]: i for i, item in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = strategic_merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def render(directory: Path) -> dict[tuple[str, str], dict]:
    """kustomize build, for the keys KUSTOMIZATION_KEYS names (any other one fails)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= KUSTOMIZATION_KEYS, f"render() does not implement {set(k) - KUSTOMIZATION_KEYS}"
    docs: dict[tuple[str, str], dict] = {}
    for resource in k.get("resources", []):
        path = directory / resource
        found = (render(path).values() if path.is_dir()
                 else [d for d in yaml.safe_load_all(path.read_text()) if d])
        for doc in found:
            assert key(doc) not in docs, f"{key(doc)} twice"
            docs[key(doc)] = doc
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, "only patches by path, targeted by kind and name"
        p = yaml.safe_load((directory / patch["path"]).read_text())
        docs[key(p)] = strategic_merge(docs[key(p)], p)
    for spec in k.get("labels", []):
        assert set(spec) == {"pairs"}, "labels: pairs only (no selectors, no templates)"
        for doc in docs.values():
            doc["metadata"]["labels"] = {**doc["metadata"].get("labels", {}), **spec["pairs"]}
    if "namespace" in k:
        for doc in docs.values():
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = k["namespace"]
    return docs


@pytest.fixture(scope="module", params=[BASE, GPU], ids=["base", "gpu"])
def rendered(request) -> tuple[Path, dict]:
    return request.param, render(request.param)


@pytest.fixture(scope="module")
def base() -> dict:
    return render(BASE)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return render(GPU)


def pod(docs: dict, name: str) -> dict:
    return docs["Deployment", name]["spec"]["template"]


def container(docs: dict, name: str) -> dict:
    (c,) = pod(docs, name)["spec"]["containers"]
    assert c["name"] == name
    return c


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("directory", [BASE, GPU], ids=["base", "gpu"])
def test_render_is_what_kustomize_builds(directory):
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = {key(d): d for d in yaml.safe_load_all(result.stdout)}
    assert built == render(directory)


def test_render_merges_containers_by_name_and_replaces_lists():
    base = {"containers": [{"name": "a", "command": ["x", "y"], "resources": {"limits": {
        "memory": "1Gi"}}}, {"name": "b"}]}
    patch = {"containers": [{"name": "a", "command": ["z"], "resources": {"limits": {
        "nvidia.com/gpu": 1}}}]}
    assert strategic_merge(base, patch) == {"containers": [
        {"name": "a", "command": ["z"], "resources": {"limits": {"memory": "1Gi",
                                                                 "nvidia.com/gpu": 1}}},
        {"name": "b"}]}


# --- schemas ---------------------------------------------------------------------------------

# KEDA v2's ScaledObject, the fields we use (KEDA ships a CRD, kubernetes-validate no schema).
_PROMETHEUS_TRIGGER = {
    "type": "object", "additionalProperties": False,
    "required": ["type", "metricType", "metadata"],
    "properties": {
        "type": {"const": "prometheus"},
        "metricType": {"enum": ["Value", "AverageValue"]},
        "metadata": {
            "type": "object", "additionalProperties": False,
            "required": ["serverAddress", "query", "threshold"],
            "properties": {
                "serverAddress": {"type": "string", "pattern": "^https?://"},
                "query": {"type": "string"},
                "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                "ignoreNullValues": {"enum": ["true", "false"]},
            },
        },
    },
}
SCALED_OBJECT_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["scaleTargetRef", "minReplicaCount", "maxReplicaCount", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "additionalProperties": False,
                                   "required": ["name"],
                                   "properties": {"name": {"type": "string"}}},
                "minReplicaCount": {"type": "integer", "minimum": 1},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"behavior": {"type": "object"}}}},
                },
                "triggers": {"type": "array", "minItems": 1, "items": _PROMETHEUS_TRIGGER},
            },
        },
    },
}


def test_every_builtin_resource_is_valid_for_kubernetes(rendered):
    _, docs = rendered
    builtin = [d for d in docs.values() if d["kind"] != "ScaledObject"]
    assert {d["kind"] for d in builtin} == {"Namespace", "Deployment", "Service",
                                            "PodDisruptionBudget"}
    for doc in builtin:
        for version in KUBE_VERSIONS:  # strict: an unknown field is an error too
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_misspelt_field(base):
    broken = copy.deepcopy(base["Deployment", "decode"])
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 75
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)


def test_scaled_objects_match_their_schema(rendered):
    _, docs = rendered
    scaled = [d for d in docs.values() if d["kind"] == "ScaledObject"]
    assert {d["metadata"]["name"] for d in scaled} == set(MODEL_ROLES)
    for doc in scaled:
        jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        spec = doc["spec"]
        assert ("Deployment", spec["scaleTargetRef"]["name"]) in docs
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]


def test_every_resource_lives_in_the_namespace(rendered):
    _, docs = rendered
    assert docs["Namespace", NAMESPACE]
    for doc in docs.values():
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == NAMESPACE, key(doc)


# --- what the containers run -----------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
def test_commands_are_the_launch_command_lines(rendered, role):
    directory, docs = rendered
    assert container(docs, role)["command"] == service_argv(
        role, port=PORTS[role], http_port=HTTP_PORTS.get(role, 0),
        extra=EXTRA[directory][role], **IN_CLUSTER)


@pytest.mark.parametrize("role", ROLES)
def test_grace_period_covers_the_drain(rendered, role):
    _, docs = rendered
    c = container(docs, role)
    grace_s = float(flag(c["command"], "--shutdown-grace-s"))
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    pre_stop_s = float(pre_stop[1]) if pre_stop else 0.0
    if pre_stop:
        assert pre_stop[0] == "sleep"
    period = pod(docs, role)["spec"]["terminationGracePeriodSeconds"]
    assert period >= pre_stop_s + grace_s + MARGIN_S


def test_gateway_waits_for_its_endpoints_to_drop(base):
    # Clients reach the gateway through a Service: SIGTERM only after kube-proxy dropped it.
    assert container(base, "gateway")["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]


@pytest.mark.parametrize("role", ROLES)
def test_probes(rendered, role):
    _, docs = rendered
    c = container(docs, role)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == PORTS[role]
    assert ports["metrics"] == IN_CLUSTER["metrics_port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, probe
    if role == "gateway":
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
        assert ports["http"] == HTTP_PORTS["gateway"]
        return
    health = ["splitserve", "health", f"127.0.0.1:{PORTS[role]}", "--timeout-s", "3"]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"] == health
        assert c[probe]["timeoutSeconds"] > 3  # the command's own timeout fires first
    assert c["livenessProbe"]["tcpSocket"]["port"] in ports
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300


@pytest.mark.parametrize("role", ROLES)
def test_resources(rendered, role):
    directory, docs = rendered
    resources = container(docs, role)["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    gpus = resources["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if directory == GPU and role in MODEL_ROLES else None)


def test_only_the_overlay_mentions_gpus(base):
    text = yaml.safe_dump(list(base.values()))
    assert "nvidia.com/gpu" not in text and "cuda" not in text


def test_prefill_cpu_pool_fits_its_shm(base):
    c = container(base, "prefill")
    volumes = {v["name"]: v for v in pod(base, "prefill")["spec"]["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    shm = volumes[mount["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    pool_gib = float(flag(c["command"], "--cpu-kv-cache-gib"))
    assert pool_gib < float(shm["sizeLimit"].removesuffix("Gi"))
    assert float(shm["sizeLimit"].removesuffix("Gi")) < float(
        c["resources"]["limits"]["memory"].removesuffix("Gi"))


def test_redis_keeps_nothing_on_disk(base):
    spec = pod(base, "redis")["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert "volumes" not in spec and "volumeMounts" not in c
    assert base["Service", "redis"]["spec"]["ports"][0]["port"] == 6379


def test_services_select_their_pods(base):
    for name in ("redis", "gateway"):
        service = base["Service", name]["spec"]
        labels = pod(base, name)["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()
        names = {p["name"] for c in pod(base, name)["spec"]["containers"] for p in c["ports"]}
        for port in service["ports"]:
            assert port["targetPort"] in names
    assert {p["port"] for p in base["Service", "gateway"]["spec"]["ports"]} == {
        PORTS["gateway"], HTTP_PORTS["gateway"], IN_CLUSTER["metrics_port"]}
    # Prefill and decode are found through the registry: no Service of their own.
    assert ("Service", "prefill") not in base and ("Service", "decode") not in base


def test_disruption_budgets_cover_every_stage(base):
    for role in ROLES:
        budget = base["PodDisruptionBudget", role]["spec"]
        assert budget["maxUnavailable"] == 1  # a single replica can still be drained
        assert budget["selector"]["matchLabels"].items() <= pod(base, role)[
            "metadata"]["labels"].items()
    assert ("PodDisruptionBudget", "redis") not in base


# --- autoscaling signals ---------------------------------------------------------------------

def exported(metrics_class) -> set[str]:
    """The metric names a service's /metrics carries, series suffixes included."""
    stats = EngineStats(num_running=1, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_held_blocks=0)
    text = metrics_class("m", SLO(), lambda: stats).exposition().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


# What each stage scales on (docs/DEPLOY.md says why).
SIGNALS = {
    "prefill": {"splitserve_request_queue_time_seconds_bucket", "splitserve_num_requests_waiting"},
    "decode": {"splitserve_kv_cache_usage_perc", "splitserve_num_requests_running"},
}


@pytest.mark.parametrize(("role", "metrics_class"),
                         [("prefill", PrefillMetrics), ("decode", DecodeMetrics)])
def test_autoscalers_query_metrics_the_stage_exports(base, role, metrics_class):
    triggers = base["ScaledObject", role]["spec"]["triggers"]
    names = set()
    for trigger in triggers:
        query = trigger["metadata"]["query"]
        # The stage's own pods only: the gateway exports num_requests_running too.
        assert f'namespace="{NAMESPACE}",container="{role}"' in query
        names |= set(re.findall(r"splitserve_\w+", query))
    assert names == SIGNALS[role]
    assert names <= exported(metrics_class)
