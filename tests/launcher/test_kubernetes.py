"""The Kubernetes manifests (deploy/k8s): each overlay rendered by `kubectl kustomize`, the
built-in kinds validated offline against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field fails), the custom resources (ServiceMonitor, InferencePool)
checked here for the fields their CRDs require, and every container's command line parsed
by the `pagedserve` CLI's own parser. No cluster: nothing here runs a pod."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from shared.curve import is_exposed, keygen
from tests.helpers import ROOT

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed: `make test` installs Debian's kubernetes-client when run as root "
           "(apt-get install kubernetes-client)",
)
OVERLAYS = ("cpu", "gpu", "monitoring", "inference-extension")
K8S = ROOT / "deploy" / "k8s"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("inference.networking.k8s.io/v1", "InferencePool")}
WORKLOADS = {"Deployment", "StatefulSet"}


def kustomize(path) -> subprocess.CompletedProcess:
    return subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay's objects, rendered from a copy of deploy/k8s with a fresh CURVE key
    (the repository holds none: `pagedserve keygen deploy/k8s/base/secrets` makes it)."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    keygen(str(copy / "base" / "secrets"))
    out = {}
    for overlay in OVERLAYS:
        done = kustomize(copy / "overlays" / overlay)
        assert done.returncode == 0, (overlay, done.stderr)
        # kubectl's older kustomize renders no empty documents, but be lenient
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]):
    """(workload, pod spec, container) of every workload's containers."""
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            spec = doc["spec"]["template"]["spec"]
            for container in spec["containers"]:
                yield doc, spec, container


def env_of(container: dict, pod_name: str) -> dict[str, str]:
    """The container's environment, as kubelet would set it (the pod's name for metadata.name)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args from the container's env."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def parse(argv: list[str]):
    """argv through `pagedserve`'s own parser; an unknown flag or subcommand fails the test."""
    from services.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"pagedserve rejects {argv}: exit {exc.code}")


def stage_args(workload: dict, container: dict):
    """The parsed stage command line of a container, and its environment."""
    pod_name = f"{workload['metadata']['name']}-0"  # a StatefulSet's first pod
    env = env_of(container, pod_name)
    args = expand(container["args"], env)
    assert "command" not in container, "the image's entrypoint is pagedserve: give args"
    assert args[:2] == ["stage", container["name"]], args
    return parse(args), env


def address(args, env: dict[str, str], name: str) -> str | None:
    """Where the stage binds or connects for `name`: its flag, else $PAGEDSERVE_<NAME> (shared.config)."""
    return getattr(args, name, None) or env.get(f"PAGEDSERVE_{name.upper()}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_its_builtin_kinds_validate_strictly(rendered, overlay):
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions, latest_version

    docs = rendered[overlay]
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # no schema: checked field by field below
        oldest = min(all_versions(), key=lambda v: tuple(map(int, v.split("."))))
        for version in (oldest, latest_version()):  # the oldest and newest schemas it ships
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']} against {version}: "
                            f"{exc.message} at {list(exc.path)}")


def test_strict_validation_catches_a_misspelt_field(rendered):
    import kubernetes_validate

    deployment = by_kind(rendered["cpu"], "Deployment")["gateway"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_real_stage_command_and_probe(rendered, overlay):
    seen = set()
    for workload, _, container in containers(rendered[overlay]):
        args, env = stage_args(workload, container)
        seen.add(args.stage)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]
            if "exec" in probe:
                command = probe["exec"]["command"]
                assert command[:2] == ["pagedserve", "probe"], command
                parsed = parse(command[1:])
                if not parsed.url:  # a stage's heartbeat file: the stage must write one
                    assert env.get("PAGEDSERVE_HEALTH_FILE"), (container["name"], kind)
            else:  # the gateway's HTTP server, on a route that needs no key
                assert args.stage == "gateway" and probe["httpGet"]["path"] == "/openapi.json"
        if args.stage == "gateway":
            ready = container["readinessProbe"]["exec"]["command"]
            assert ready[-1] == f"http://127.0.0.1:{args.port}/health"
            assert {"name": "http", "containerPort": args.port} in container["ports"]
    assert seen == {"gateway", "tokenizer", "scheduler", "executor"}


def services_and_ports(docs: list[dict]) -> dict[str, set[int]]:
    return {name: {p["port"] for p in svc["spec"]["ports"]} for name, svc in by_kind(docs, "Service").items()}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_address_is_reachable_and_exposed_sockets_have_the_curve_key(rendered, overlay):
    """Each stage has the addresses it needs; a connector's host is a Service with that port
    (engine-i.engine: a pod of the headless Service's StatefulSet), or loopback bound in the
    same pod; a stage with any address off loopback reads the key from the generated Secret."""
    docs = rendered[overlay]
    services = services_and_ports(docs)
    secrets = by_kind(docs, "Secret")
    needs = {"gateway": ("tokenizer_in", "gateway_in", "scheduler_in", "status"),
             "tokenizer": ("tokenizer_in", "gateway_in", "status"),
             "scheduler": ("scheduler_in", "executor_in", "executor_out", "status"),
             "executor": ("executor_in", "executor_out", "status")}
    for workload, pod, container in containers(docs):
        args, env = stage_args(workload, container)
        pod_binds = set()
        for _, other_pod, other in containers(docs):
            if other_pod is pod:
                other_args, other_env = stage_args(workload, other)
                binders = {"gateway": ("tokenizer_in", "gateway_in", "status"),
                           "scheduler": ("scheduler_in", "executor_in", "executor_out")}
                for name in binders.get(other_args.stage, ()):
                    pod_binds.add(address(other_args, other_env, name).rsplit(":", 1)[1])
        for name in needs[args.stage]:
            value = address(args, env, name)
            assert value, (overlay, container["name"], name)
            for endpoint in value.split(","):
                host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
                if host in ("*", "127.0.0.1"):
                    assert port in pod_binds, (overlay, container["name"], endpoint)
                elif host in services:
                    assert int(port) in services[host], (overlay, endpoint)
                else:
                    pod_name, service = host.split(".")
                    statefulset = by_kind(docs, "StatefulSet")[service]
                    assert statefulset["spec"]["serviceName"] == service
                    assert int(pod_name.removeprefix(f"{service}-")) < statefulset["spec"]["replicas"], endpoint
                    assert int(port) in services[service], endpoint
        exposed = any(is_exposed(address(args, env, name)) for name in needs[args.stage])
        assert exposed == (overlay != "inference-extension"), (overlay, container["name"])
        if exposed:  # a stage without a key would refuse to start
            key_file = env["PAGEDSERVE_CURVE_KEY_FILE"]
            mount = next(m for m in container["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert key_file.rsplit("/", 1)[1] in secrets[volume["secret"]["secretName"]]["data"]


def test_engines_are_a_statefulset_whose_pod_names_are_the_engine_names(rendered):
    docs = rendered["cpu"]
    engine = by_kind(docs, "StatefulSet")["engine"]  # the name gives the pods engine-0, engine-1, ...
    headless = by_kind(docs, "Service")["engine"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert engine["spec"]["serviceName"] == "engine"
    gateway = by_kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    schedulers = env_of(gateway, "gateway")["PAGEDSERVE_SCHEDULER_IN"].split(",")
    assert schedulers == [f"tcp://engine-{i}.engine:5554" for i in range(engine["spec"]["replicas"])]
    for container in engine["spec"]["template"]["spec"]["containers"]:
        args, env = stage_args(engine, container)
        assert args.engine == "engine-0"  # --engine $(POD_NAME), the first pod's
    assert by_kind(docs, "Deployment")["gateway"]["spec"]["strategy"]["type"] == "Recreate"


def compose_flags(command: list[str]) -> dict[str, str]:
    """compose's --name value pairs with ${VAR:-default} resolved to the default."""
    resolved = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in command]
    return {a: b for a, b in zip(resolved, resolved[1:], strict=False) if a.startswith("--")}


def test_stage_commands_match_compose_and_the_gpu_overlay_matches_compose_gpu(rendered):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    compose_gpu = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())["services"]
    for overlay, executor_compose in (("cpu", compose["executor"]), ("gpu", compose_gpu["executor"])):
        images = {}
        for _, pod, container in containers(rendered[overlay]):
            images[container["name"]] = container["image"]
            k8s = {k: v for k, v in compose_flags(container["args"]).items() if k != "--engine"}
            if container["name"] in ("tokenizer", "executor"):
                source = executor_compose if container["name"] == "executor" else compose["tokenizer"]
                assert k8s == compose_flags(source["command"]), (overlay, container["name"])
            if container["name"] == "executor" and overlay == "gpu":
                assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
                assert executor_compose["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
                assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        expected = {"gateway": "pagedserve:cpu", "tokenizer": "pagedserve:cpu", "scheduler": "pagedserve:cpu",
                    "executor": executor_compose["image"]}
        assert images == expected, overlay
    gateway = by_kind(rendered["cpu"], "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    ours = compose_flags(gateway["args"])
    theirs = compose_flags(compose["gateway"]["command"])
    assert ours == {k: v for k, v in theirs.items() if k != "--allowed-hosts"}  # k8s comes by pod IP


def test_tokenizers_autoscale_and_disruption_budgets_select_workloads(rendered):
    docs = rendered["cpu"]
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = by_kind(docs, hpa["spec"]["scaleTargetRef"]["kind"])[hpa["spec"]["scaleTargetRef"]["name"]]
    assert target["metadata"]["name"] == "tokenizer" and hpa["spec"]["minReplicas"] >= 1
    # CPU utilization is measured against the request
    assert all(c["resources"]["requests"]["cpu"] for c in target["spec"]["template"]["spec"]["containers"])
    for overlay in OVERLAYS:
        workloads = [d for d in rendered[overlay] if d["kind"] in WORKLOADS]
        budgets = by_kind(rendered[overlay], "PodDisruptionBudget")
        assert budgets, overlay
        for name, pdb in budgets.items():
            labels = pdb["spec"]["selector"]["matchLabels"]
            matched = [w for w in workloads if labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            assert len(matched) == 1, (overlay, name)


def test_monitoring_adds_a_servicemonitor_like_the_compose_prometheus_scrape(rendered):
    docs = rendered["monitoring"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    # the CRD requires spec.selector (and each endpoint is one port of the selected Service)
    selected = [s for s in by_kind(docs, "Service").values()
                if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["gateway"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["path"] == scrape["scrape_configs"][0]["metrics_path"]
    assert endpoint["interval"] == scrape["global"]["scrape_interval"]
    gateway = by_kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert parse(gateway["args"]).metrics_public  # scraped without the API key
    assert not parse(by_kind(rendered["cpu"], "Deployment")["gateway"]["spec"]["template"]["spec"]
                     ["containers"][0]["args"]).metrics_public


def test_the_inference_pool_selects_whole_model_server_pods_on_the_openai_port(rendered):
    docs = rendered["inference-extension"]
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    # the CRD's required fields and bounds
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    ports = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports)
    picker = spec["endpointPickerRef"]
    assert picker["name"] and picker.get("kind", "Service") == "Service" and 1 <= picker["port"]["number"] <= 65535
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    (server,) = [d for d in docs if d["kind"] in WORKLOADS and labels.items() <= d["spec"]["template"]["metadata"]
                 ["labels"].items()]
    stages = {}
    for container in server["spec"]["template"]["spec"]["containers"]:
        args, _ = stage_args(server, container)
        stages[args.stage] = args
    assert set(stages) == {"gateway", "tokenizer", "scheduler", "executor"}  # each pod one model server
    assert ports == [stages["gateway"].port]
    assert stages["gateway"].metrics_public  # the endpoint picker scrapes /metrics without the key
    assert "Secret" not in {d["kind"] for d in docs}  # all on loopback: no CURVE key needed


def test_the_base_does_not_render_without_a_key(tmp_path):
    """No key ships in the repository: rendering without `pagedserve keygen` fails."""
    shutil.copytree(K8S, tmp_path / "k8s")
    for key in (tmp_path / "k8s" / "base" / "secrets").glob("pagedserve.key*"):
        key.unlink()
    done = kustomize(tmp_path / "k8s" / "overlays" / "cpu")
    assert done.returncode != 0 and "pagedserve.key_secret" in done.stderr
