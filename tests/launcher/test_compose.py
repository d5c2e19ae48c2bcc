"""The deployment files: compose.yaml (and its GPU layer, and its monitoring profile) through
a real compose implementation's `config`, and checked for what the deployment needs; the
Dockerfile checked against them; the Grafana dashboard against the gateway's metrics.
tests/e2e/test_topology.py runs the same services as processes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.helpers import ROOT

COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="docker-compose is not installed: `make test` installs Debian's package when run as root "
           "(apt-get install docker-compose)",
)
STAGES = {"gateway", "tokenizer", "scheduler", "executor"}
MONITORING = {"prometheus", "grafana"}


def compose_config(*files: str, cwd=ROOT, profiles: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    args = [COMPOSE]
    for f in files:
        args += ["-f", str(f)]
    for p in profiles:
        args += ["--profile", p]
    return subprocess.run(args + ["config"], cwd=cwd, capture_output=True, text=True, timeout=120)


def resolved(*files: str, profiles: tuple[str, ...] = ()) -> dict:
    out = compose_config(*files, profiles=profiles)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def flags(command: list[str]) -> dict[str, str]:
    """--name value pairs of a stage command line."""
    return {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}


@needs_compose
def test_compose_config_accepts_the_cpu_and_gpu_variants():
    cpu = resolved("compose.yaml")
    services = {name: svc for name, svc in cpu["services"].items() if not svc.get("profiles")}
    assert set(services) == STAGES
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["healthcheck"]["test"][1:3] == ["pagedserve", "probe"], name
        assert svc["command"][:2] == ["stage", name]
        mounts = {v.split(":")[1] if isinstance(v, str) else v["target"] for v in svc["volumes"]}
        assert {"/models", "/cache"} <= mounts, name
        env = svc["environment"]
        assert env["PAGEDSERVE_HEALTH_FILE"]
        # only the gateway reaches the scheduler (the tokenizer replicas answer the gateway)
        assert env.get("PAGEDSERVE_SCHEDULER_IN") == ("tcp://scheduler:5554" if name == "gateway" else None), name
        assert env["PAGEDSERVE_CURVE_KEY_FILE"] == "/run/secrets/curve_key"  # tcp:// needs CURVE
        assert [s if isinstance(s, str) else s["source"] for s in svc["secrets"]] == ["curve_key"], name
    assert services["gateway"]["healthcheck"]["test"][-1] == "http://127.0.0.1:8000/health"
    # the gateway detokenizes: it loads the same model's tokenizer as the tokenizer replicas
    assert flags(services["gateway"]["command"])["--model"] == flags(services["tokenizer"]["command"])["--model"]
    assert "depends_on" not in services["tokenizer"]
    assert set(services["gateway"]["depends_on"]) == STAGES - {"gateway"}  # so compose stops it first

    gpu = resolved("compose.yaml", "compose.gpu.yaml")["services"]
    device = gpu["executor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert flags(gpu["executor"]["command"])["--device"] == "cuda"
    assert gpu["executor"]["build"]["args"]["TORCH_INDEX"].endswith("/cu128")
    assert {gpu[s]["image"] for s in STAGES - {"executor"}} == {"pagedserve:cpu"}


def engines_of(services: dict) -> list[tuple[dict, dict]]:
    """(scheduler, executor) of each engine, in engine order: compose.dp.yaml's numbered services."""
    out = [(services["scheduler"], services["executor"])]
    while f"scheduler-{len(out)}" in services:
        out.append((services[f"scheduler-{len(out)}"], services[f"executor-{len(out)}"]))
    return out


def check_engines(services: dict) -> None:
    """Each engine's stages name it, its scheduler binds the ports its executor and the gateway
    reach it on, and the gateway's list names every engine's scheduler in engine order (the
    tokenizer replicas reach no scheduler)."""
    engines = engines_of(services)
    assert len(engines) == 2
    gateway = services["gateway"]
    assert gateway["environment"]["PAGEDSERVE_SCHEDULER_IN"].split(",") == [
        f"tcp://{'scheduler' if i == 0 else f'scheduler-{i}'}:5554" for i in range(len(engines))]
    assert flags(gateway["command"])["--routing"] in ("${PAGEDSERVE_ROUTING:-prefix}", "prefix")  # raw, resolved
    tokenizer = services["tokenizer"]
    assert "PAGEDSERVE_SCHEDULER_IN" not in tokenizer["environment"] and "--routing" not in tokenizer["command"]
    assert "depends_on" not in tokenizer
    for i, (scheduler, executor) in enumerate(engines):
        name = "scheduler" if i == 0 else f"scheduler-{i}"
        named = [flags(stage["command"]).get("--engine", "engine-0") for stage in (scheduler, executor)]
        assert named == [f"engine-{i}"] * 2, (i, named)
        binds = flags(scheduler["command"])
        for flag, env in (("--executor-in", "PAGEDSERVE_EXECUTOR_IN"), ("--executor-out", "PAGEDSERVE_EXECUTOR_OUT")):
            assert executor["environment"][env] == binds[flag].replace("*", name), (i, env)
        assert binds["--scheduler-in"] == "tcp://*:5554"


@needs_compose
def test_compose_dp_yaml_adds_a_second_engine_as_numbered_services():
    services = {name: svc for name, svc in resolved("compose.yaml", "compose.dp.yaml")["services"].items()
                if not svc.get("profiles")}
    assert set(services) == STAGES | {"scheduler-1", "executor-1"}
    check_engines(services)
    for name in ("scheduler-1", "executor-1"):  # all else as the base service (extends)
        base = services[name.removesuffix("-1")]
        for key in ("image", "restart", "healthcheck", "volumes", "secrets", "init"):
            assert services[name][key] == base[key], (name, key)
        assert services[name]["command"][:2] == ["stage", name.removesuffix("-1")]
    assert set(services["gateway"]["depends_on"]) == set(services) - {"gateway"}  # stopped first
    tokenizer = services["tokenizer"]
    assert "container_name" not in tokenizer and "ports" not in tokenizer  # still --scale tokenizer=N
    gpu = resolved("compose.yaml", "compose.gpu.yaml", "compose.dp.yaml")["services"]
    assert set(services) <= set(gpu) and flags(gpu["executor"]["command"])["--device"] == "cuda"


def test_compose_dp_yaml_wires_each_engine_to_its_own_scheduler():
    from tests.e2e.topology import merged

    services = merged("compose.dp.yaml")["services"]
    check_engines(services)
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["gateway"]["command"]
    assert services["gateway"]["command"] == [*base, "--routing", "${PAGEDSERVE_ROUTING:-prefix}"]  # nothing else


@needs_compose
def test_the_monitoring_profile_runs_prometheus_and_grafana_with_the_dashboard():
    plain, monitoring = resolved("compose.yaml")["services"], resolved("compose.yaml", profiles=("monitoring",))["services"]
    assert set(monitoring) == STAGES | MONITORING
    for name in MONITORING:  # started only with --profile monitoring, on loopback ports
        assert plain[name]["profiles"] == monitoring[name]["profiles"] == ["monitoring"]
        assert all(p.startswith("127.0.0.1:") for p in monitoring[name]["ports"]), name
    assert not any(plain[name].get("profiles") for name in STAGES)
    prom, grafana = monitoring["prometheus"], monitoring["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"] + grafana["volumes"]}
    for target, source in mounts.items():
        if source.startswith("/"):  # bind mounts of the repository's files
            assert (ROOT / source.removeprefix(str(ROOT) + "/")).exists(), (target, source)
    assert mounts["/etc/prometheus/prometheus.yml"].endswith("deploy/prometheus/prometheus.yml")
    assert mounts["/etc/grafana/dashboards/pagedserve.json"].endswith("deploy/grafana/pagedserve.json")
    assert mounts["/etc/grafana/provisioning"].endswith("deploy/grafana/provisioning")
    assert "/tmp/pagedserve_api_key" in prom["entrypoint"][-1]  # the API key, for a gateway that has one

    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["gateway:8000"] and scrape["metrics_path"] == "/metrics"
    assert scrape["authorization"]["credentials_file"] == "/tmp/pagedserve_api_key"
    provisioning = ROOT / "deploy/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards/pagedserve.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    dashboard = json.loads((ROOT / "deploy/grafana/pagedserve.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == source["uid"] for p in panels)


def exported_metric_names() -> set[str]:
    """Every series name the gateway's /metrics can show (labelled ones too, before any sample)."""
    from services.gateway.metrics import Metrics
    from services.gateway.supervision import SupervisionState

    names = set()
    for family in Metrics(SupervisionState("/nonexistent")).registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


def test_the_grafana_dashboard_queries_only_metrics_the_gateway_exports():
    dashboard = json.loads((ROOT / "deploy/grafana/pagedserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"pagedserve_[a-z0-9_]+", e)}
    exported = exported_metric_names()
    assert used - exported == set()
    # the paged-KV metrics all have a panel
    assert {"pagedserve_kv_slots", "pagedserve_kv_blocks_cached", "pagedserve_prefix_cache_hits_total",
            "pagedserve_time_to_first_token_seconds_bucket", "pagedserve_inter_token_latency_seconds_bucket",
            "pagedserve_num_preemptions_total"} <= used
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@needs_compose
def test_compose_config_rejects_an_invalid_file(tmp_path):
    (tmp_path / "compose.yaml").write_text("services:\n  gateway:\n    image: x\n    restart: [always]\n")
    out = compose_config("compose.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "restart" in out.stderr


def test_tokenizers_scale_and_binders_listen_on_the_compose_network():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    tokenizer = services["tokenizer"]
    # --scale tokenizer=N: nothing that two containers of one service could not share
    assert "container_name" not in tokenizer and "ports" not in tokenizer and "hostname" not in tokenizer
    gateway = flags(services["gateway"]["command"])
    scheduler = flags(services["scheduler"]["command"])
    assert {gateway[f] for f in ("--tokenizer-in", "--gateway-in", "--status")} == {
        "tcp://*:5551", "tcp://*:5552", "tcp://*:5553"}
    assert {scheduler[f] for f in ("--scheduler-in", "--executor-in", "--executor-out")} == {
        "tcp://*:5554", "tcp://*:5555", "tcp://*:5556"}
    assert services["gateway"]["ports"] == ["127.0.0.1:${PAGEDSERVE_PORT:-8000}:8000"]
    stage = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert stage["x-stage"]["secrets"] == ["curve_key"]
    assert stage["x-stage"]["environment"]["PAGEDSERVE_CURVE_KEY_FILE"] == "/run/secrets/curve_key"
    assert stage["secrets"]["curve_key"]["file"] == "${PAGEDSERVE_KEYS_DIR:-./secrets}/pagedserve.key_secret"


def test_dockerfile_matches_the_compose_files():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    assert re.search(r"^ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu$", dockerfile, re.M)
    assert "--index-url ${TORCH_INDEX}" in dockerfile
    assert 'ENTRYPOINT ["pagedserve"]' in dockerfile
    assert 'pagedserve = "services.cli:main"' in (ROOT / "pyproject.toml").read_text()
    stage = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-stage"]
    assert stage["build"]["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert stage["environment"]["PAGEDSERVE_CACHE"] == "/cache"
