"""docker-compose.yml: accepted by `docker-compose config`, and its services run exactly the
command lines that splitserve.launch builds for `splitserve up` and the stack tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from splitserve.launch import ROLES, service_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# What differs inside compose: the Redis service's name, every interface, fixed container ports.
IN_COMPOSE = {"registry_url": "redis://redis:6379/0", "host": "0.0.0.0", "metrics_port": 9400}
PORTS = {"gateway": 50051, "prefill": 50061, "decode": 50071}
HTTP_PORTS = {"gateway": 8000}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


@pytest.mark.parametrize("role", ROLES)
def test_service_commands_are_the_launch_command_lines(services, role):
    assert services[role]["command"] == service_argv(
        role, port=PORTS[role], http_port=HTTP_PORTS.get(role, 0), **IN_COMPOSE)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_model_services_scale_and_reserve_a_gpu(services, role):
    service = services[role]
    assert "ports" not in service  # no fixed host port: --scale works
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1


def test_redis_and_public_port(services):
    assert set(services) == {"redis", "prometheus", *ROLES}
    # Published on the host's loopback only (issue 7: nothing listens beyond it by default).
    assert services["gateway"]["ports"] == ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]


def test_prometheus_scrapes_every_role(services):
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ROLES)
    assert jobs["gateway"]["static_configs"] == [{"targets": ["gateway:9400"]}]
    for role in ("prefill", "decode"):  # scaled: every container the service name resolves to
        (sd,) = jobs[role]["dns_sd_configs"]
        assert (sd["names"], sd["type"], sd["port"]) == ([role], "A", 9400)
    mount = "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_scrape_config():
    config = ROOT / "deploy" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_config_accepts_the_file():
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
