"""`deploy/`: the Dockerfile, the Kubernetes examples and the gateway config are documents no
cluster runs here, so this checks them against the server they describe: every file parses,
each object has the fields its API requires, ports and probe paths are the server's, the
metrics the HPA and the endpoint picker read are ones the server exposes (rendered by the
real metrics registry), and the drain timings add up.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from switchyard import drain
from switchyard.app import create_app
from switchyard.cli import serve
from switchyard.models.config import RemoteEntry, read_config
from switchyard.routes import ops
from switchyard.settings import ServeSettings
from switchyard.telemetry.metrics import PICKER_METRICS, Metrics
from switchyard_spec import EngineStats

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DEFAULT_PORT = ServeSettings().port


def _documents() -> dict[str, list[dict]]:
    return {path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
            for path in sorted(K8S.glob("*.yaml"))}


DOCS = _documents()


def _one(kind: str) -> dict:
    found = [doc for docs in DOCS.values() for doc in docs if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _exposed_metrics() -> dict[str, set[str]]:
    """Every metric name the server's registry renders, with its label names, for one model
    whose engine reports its cache in blocks (as the xeon and gaudi engines do) and serves
    LoRA adapters (as the xeon engine does)."""
    model = SimpleNamespace(
        name="qwen2.5-0.5b", engine_spec=SimpleNamespace(name="xeon"), warmup=None,
        engine=SimpleNamespace(stats=lambda: EngineStats(
            running=1, waiting=2, batch_tokens=32, max_batch_total_tokens=1024,
            kv_block_size=16, kv_blocks_total=64, kv_blocks_used=2, max_lora=4,
            running_lora_adapters=("sql",), waiting_lora_adapters=("chat",))))
    text = Metrics(lambda: [model]).exposition().decode()
    names: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        if match and not line.startswith("#"):
            labels = set(re.findall(r'(\w+)="', match.group(2) or ""))
            names.setdefault(match.group(1), set()).update(labels)
    return names


def test_every_manifest_parses_and_names_its_api():
    assert set(DOCS) >= {"deployment.yaml", "service.yaml", "hpa.yaml", "inferencepool.yaml",
                         "epp-config.yaml", "prometheus-adapter-values.yaml"}
    for name, docs in DOCS.items():
        assert docs, name
        for doc in docs:
            if name == "prometheus-adapter-values.yaml":  # Helm values, not an object
                assert "rules" in doc
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(doc), (name, doc.get("kind"))
            assert doc["metadata"].get("name"), name


def _container() -> dict:
    spec = _one("Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def _env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container()["env"]}


def test_deployment_selects_its_pods_and_every_env_var_is_a_serve_flags():
    deployment = _one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Each variable is one `switchyard serve` reads (a typo would be silently ignored).
    envvars = set()
    for param in serve.params:
        envvar = getattr(param, "envvar", None)
        envvars.update([envvar] if isinstance(envvar, str) else envvar or ())
    assert set(_env()) <= envvars, set(_env()) - envvars
    # Kubernetes sets HOSTNAME to the pod's name: the manifest must say where to listen.
    assert _env()["HOSTNAME"] == "0.0.0.0"


def test_ports_are_the_servers():
    container = _container()
    (port,) = container["ports"]
    assert port["containerPort"] == DEFAULT_PORT == int(_env()["PORT"])
    named = port["name"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in (named, DEFAULT_PORT)
    service = _one("Service")
    assert service["spec"]["selector"].items() <= \
        _one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [named]
    pool = _one("InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": DEFAULT_PORT}]
    annotations = _one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == DEFAULT_PORT
    assert annotations["prometheus.io/path"] in ops.metrics.paths


def test_probe_paths_are_readiness_and_liveness():
    container = _container()
    readiness = container["readinessProbe"]["httpGet"]["path"]
    liveness = container["livenessProbe"]["httpGet"]["path"]
    assert readiness in ops.health.paths and liveness in ops.live.paths
    served = {route.path for route in create_app(ServeSettings()).routes}
    assert {readiness, liveness} <= served


def test_drain_timings_add_up():
    """The pod is killed only after preStop, the drain and uvicorn's close have all run."""
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_timeout = float(_env()["SWITCHYARD_DRAIN_TIMEOUT"])
    assert drain_timeout > 0
    needed = float(pre_stop[1]) + drain_timeout + drain.SHUTDOWN_GRACE_SECONDS
    assert pod["terminationGracePeriodSeconds"] > needed


def test_hpa_scales_the_deployment_on_an_exposed_queue_gauge():
    hpa, deployment = _one("HorizontalPodAutoscaler"), _one("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    exposed = _exposed_metrics()
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == PICKER_METRICS["queuedRequestsSpec"] and name in exposed
    selector = metric["pods"]["metric"]["selector"]["matchLabels"]
    assert set(selector) <= exposed[name]
    assert selector["model"] == _env()["SERVED_MODEL_NAME"]
    # The adapter's rule serves that same series under that same name.
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())[
        "rules"]["custom"]
    assert rule["name"]["as"] == name and name in rule["seriesQuery"]
    assert re.fullmatch(rule["name"]["matches"], name)


def test_picker_reads_metrics_the_server_exposes():
    (config_map,) = DOCS["epp-config.yaml"]
    (text,) = config_map["data"].values()
    config = yaml.safe_load(text)
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["name"]: p for p in config["plugins"]}
    extractor = next(p for p in config["plugins"] if p["type"] == "model-server-protocol-metrics")
    (engine,) = extractor["parameters"]["engineConfigs"]
    # The pods carry the label value the extractor maps.
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["parameters"]["engineLabelKey"]] == engine["name"]
    specs = {key: value for key, value in engine.items() if key.endswith("Spec") and value}
    assert specs == PICKER_METRICS
    exposed = _exposed_metrics()
    for spec in specs.values():
        assert spec in exposed, spec
    # The picker reads the cache config from these two label names, the adapters from these.
    assert {"block_size", "num_gpu_blocks"} <= exposed[PICKER_METRICS["cacheInfoSpec"]]
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= exposed[
        PICKER_METRICS["loraSpec"]]
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in plugins
    for source in config["data"]["sources"]:
        assert source["pluginRef"] in plugins
        assert all(e["pluginRef"] in plugins for e in source["extractors"])


def test_inference_pool_selects_the_pods_and_the_route_targets_it():
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] and ref["failureMode"] in ("FailOpen", "FailClose")
    route = _one("HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {(b["kind"], b["name"]) for b in backends} == {("InferencePool",
                                                           pool["metadata"]["name"])}
    # The routes it sends are OpenAI's, which the server serves.
    served = {route.path for route in create_app(ServeSettings()).routes}
    for rule in route["spec"]["rules"]:
        for match in rule["matches"]:
            prefix = match["path"]["value"]
            assert any(path.startswith(prefix) for path in served), prefix


def test_gateway_config_is_a_valid_config_of_remote_models():
    path = DEPLOY / "gateway-config.toml"
    tomllib.loads(path.read_text())
    entries = read_config(path, ServeSettings())
    assert entries and all(isinstance(e, RemoteEntry) for e in entries)
    for entry in entries:
        assert all(url.startswith("http://") for url in entry.upstreams)


def _dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_installs_what_the_makefile_installs_and_serves_on_the_port():
    steps = _dockerfile()
    assert steps[0][0] == "FROM"
    runs = [arg for op, arg in steps if op == "RUN"]
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    torch_step = next(i for i, r in enumerate(runs) if "torch==" in r)
    assert f"torch=={torch_pin}" in runs[torch_step]
    install = next(i for i, r in enumerate(runs) if "./plugins/xeon" in r)
    assert torch_step < install  # torch first, as the Makefile does
    for op, arg in steps:
        if op == "COPY" and not arg.startswith("--from="):  # a stage's files: not ours
            *sources, _ = shlex.split(arg)
            for source in sources:
                assert (ROOT / source).exists(), source
    (expose,) = [arg for op, arg in steps if op == "EXPOSE"]
    assert int(expose) == DEFAULT_PORT
    env = " ".join(arg for op, arg in steps if op == "ENV")
    assert f"PORT={DEFAULT_PORT}" in env
    (entrypoint,) = [arg for op, arg in steps if op == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == ["switchyard", "serve"]


@pytest.mark.parametrize("name", ["deploy.md"])
def test_deploy_doc_names_the_files_and_metrics(name):
    page = (ROOT / "docs" / name).read_text()
    for path in [*K8S.glob("*.yaml"), DEPLOY / "Dockerfile", DEPLOY / "gateway-config.toml"]:
        assert str(path.relative_to(ROOT)) in page, path
    for metric in PICKER_METRICS.values():
        assert f"`{metric}`" in page, metric
