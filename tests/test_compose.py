"""The deployment files: compose.yaml (and its GPU layer) through a real compose
implementation's `config`, and checked for what the deployment needs; the Dockerfile
checked against them. tests/e2e/test_topology.py runs the same services as processes."""

from __future__ import annotations

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


def compose_config(*files: str, cwd=ROOT) -> subprocess.CompletedProcess:
    args = [COMPOSE]
    for f in files:
        args += ["-f", str(f)]
    return subprocess.run(args + ["config"], cwd=cwd, capture_output=True, text=True, timeout=120)


def resolved(*files: str) -> dict:
    out = compose_config(*files)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def flags(command: list[str]) -> dict[str, str]:
    """--name value pairs of a stage command line."""
    return {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}


@needs_compose
def test_compose_config_accepts_the_cpu_and_gpu_variants():
    cpu = resolved("compose.yaml")
    services = cpu["services"]
    assert set(services) == STAGES
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["healthcheck"]["test"][1:3] == ["pagedserve", "probe"], name
        assert svc["command"][:2] == ["stage", name]
        mounts = {v.split(":")[1] if isinstance(v, str) else v["target"] for v in svc["volumes"]}
        assert {"/models", "/cache"} <= mounts, name
        env = svc["environment"]
        assert env["PAGEDSERVE_HEALTH_FILE"] and env["PAGEDSERVE_SCHEDULER_IN"] == "tcp://scheduler:5554"
        assert env["PAGEDSERVE_CURVE_KEY_FILE"] == "/run/secrets/curve_key"  # tcp:// needs CURVE
        assert [s if isinstance(s, str) else s["source"] for s in svc["secrets"]] == ["curve_key"], name
    assert services["gateway"]["healthcheck"]["test"][-1] == "http://127.0.0.1:8000/health"
    assert set(services["gateway"]["depends_on"]) == STAGES - {"gateway"}  # so compose stops it first

    gpu = resolved("compose.yaml", "compose.gpu.yaml")["services"]
    device = gpu["executor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert flags(gpu["executor"]["command"])["--device"] == "cuda"
    assert gpu["executor"]["build"]["args"]["TORCH_INDEX"].endswith("/cu128")
    assert {gpu[s]["image"] for s in STAGES - {"executor"}} == {"pagedserve:cpu"}


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
