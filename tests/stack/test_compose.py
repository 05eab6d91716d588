"""docker-compose.yml (CPU) and docker-compose.gpu.yml (its GPU override): accepted by
`docker-compose config`, their services run exactly the command lines that splitserve.launch
builds for `splitserve up` and the stack tests, every service has a healthcheck and starts after
what it needs is healthy, and only the override reserves GPUs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from splitserve.launch import ROLES, service_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_FILE = ROOT / "docker-compose.gpu.yml"
# What differs inside compose: the Redis service's name, every interface, fixed container ports.
IN_COMPOSE = {"registry_url": "redis://redis:6379/0", "host": "0.0.0.0", "metrics_port": 9400}
PORTS = {"gateway": 50051, "prefill": 50061, "decode": 50071}
HTTP_PORTS = {"gateway": 8000}
MODEL_ROLES = ("prefill", "decode")
# The engine flags the GPU override adds (docker-compose.gpu.yml says why).
GPU_FLAGS = ("--device", "cuda", "--kv-cache-memory-fraction", "0.45")
HAVE_COMPOSE = shutil.which("docker-compose") is not None


def launch_argv(role: str, extra: tuple[str, ...] = ()) -> list[str]:
    return service_argv(role, port=PORTS[role], http_port=HTTP_PORTS.get(role, 0), extra=extra,
                        **IN_COMPOSE)


def merge(base: dict, override: dict) -> dict:
    """Compose's merge of an override file, for what ours holds: mappings merge key by key,
    anything else (a command, a list) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


@pytest.fixture(scope="module")
def gpu_services(services) -> dict:
    override = yaml.safe_load(GPU_FILE.read_text())["services"]
    assert set(override) == set(MODEL_ROLES)  # the override touches the model services only
    return merge(services, override)


def gpu_devices(service: dict) -> list:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get(
        "devices", [])


@pytest.mark.parametrize("role", ROLES)
def test_service_commands_are_the_launch_command_lines(services, role):
    assert services[role]["command"] == launch_argv(role)


@pytest.mark.parametrize("role", ROLES)
def test_gpu_commands_are_the_launch_command_lines_with_gpu_flags(gpu_services, role):
    extra = GPU_FLAGS if role in MODEL_ROLES else ()
    assert gpu_services[role]["command"] == launch_argv(role, extra)


@pytest.mark.parametrize("role", MODEL_ROLES)
def test_model_services_scale(services, role):
    service = services[role]
    assert "ports" not in service and "container_name" not in service  # --scale works


def test_default_file_reserves_no_gpu(services):
    for name, service in services.items():
        assert not gpu_devices(service), name
    assert "cuda" not in COMPOSE_FILE.read_text().replace("docker-compose.gpu.yml", "")


@pytest.mark.parametrize("role", MODEL_ROLES)
def test_gpu_override_reserves_one_gpu_per_container(gpu_services, role):
    (device,) = gpu_devices(gpu_services[role])
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert "ports" not in gpu_services[role]  # still scales


def test_healthchecks(services):
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for role in ROLES:  # the image has python and splitserve, not curl
        check = services[role]["healthcheck"]
        assert check["test"] == ["CMD", "splitserve", "health", f"127.0.0.1:{PORTS[role]}",
                                 "--timeout-s", "3"]
        assert 0 < float(check["timeout"].rstrip("s")) < float(check["interval"].rstrip("s"))
    for role in MODEL_ROLES:  # loading (first: converting) the model is not a failure
        assert services[role]["healthcheck"]["start_period"] == "300s"


def test_start_order(services):
    for role in ROLES:  # every splitserve service needs the registry at start-up
        assert services[role]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["prometheus"]["depends_on"] == {
        role: {"condition": "service_started"} for role in ROLES}
    assert "depends_on" not in services["redis"]


def test_redis_and_public_port(services):
    assert set(services) == {"redis", "prometheus", "grafana", *ROLES}
    assert services["redis"]["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    # Published on the host's loopback only (issue 7: nothing listens beyond it by default).
    assert services["gateway"]["ports"] == ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]


def test_prometheus_scrapes_every_role(services):
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ROLES)
    assert jobs["gateway"]["static_configs"] == [{"targets": ["gateway:9400"]}]
    for role in MODEL_ROLES:  # scaled: every container the service name resolves to
        (sd,) = jobs[role]["dns_sd_configs"]
        assert (sd["names"], sd["type"], sd["port"]) == ([role], "A", 9400)
    mount = "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]


def test_grafana_is_provisioned_with_the_dashboard(services):
    """Grafana mounts the provisioning (the Prometheus data source the dashboard names) and the
    dashboard folder; tests/stack/test_observability.py checks its queries against the metrics."""
    grafana = services["grafana"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_started"}}
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in grafana["volumes"]}
    provisioning, dashboards = mounts["/etc/grafana/provisioning"], mounts["/var/lib/grafana/dashboards"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "splitserve.yml").read_text())[
        "providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((dashboards / "splitserve.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10 and len({p["id"] for p in dashboard["panels"]}) == len(
        dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == source["uid"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_scrape_config():
    config = ROOT / "deploy" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def compose_config(*files: Path) -> dict:
    args = [arg for f in files for arg in ("-f", str(f))]
    result = subprocess.run(["docker-compose", *args, "config"], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@pytest.mark.skipif(not HAVE_COMPOSE, reason="docker-compose not installed")
def test_docker_compose_config_accepts_the_file():
    merged = compose_config(COMPOSE_FILE)
    for role in ROLES:
        assert merged[role]["command"] == launch_argv(role)
        assert not gpu_devices(merged[role])


@pytest.mark.skipif(not HAVE_COMPOSE, reason="docker-compose not installed")
def test_docker_compose_config_merges_the_gpu_override():
    merged = compose_config(COMPOSE_FILE, GPU_FILE)
    for role in MODEL_ROLES:
        assert merged[role]["command"] == launch_argv(role, GPU_FLAGS)
        (device,) = gpu_devices(merged[role])
        assert device["capabilities"] == ["gpu"] and int(device["count"]) == 1
        assert merged[role]["healthcheck"]["test"][:3] == ["CMD", "splitserve", "health"]
    assert not gpu_devices(merged["gateway"])
