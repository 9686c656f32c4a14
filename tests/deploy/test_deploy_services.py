"""The manifests name what the services really have: health service names the probes ask for,
metrics the autoscaler scales on, gRPC paths the mesh admits, batch limits and runtimes the
settings pair up. A name that exists only in a manifest fails at run time (a probe that never
passes, an HPA without a metric, a denied call), so each is read from the services' code here.

Needs the mlpair package importable (as in `make test`); skipped otherwise."""

from __future__ import annotations

import re

import deploy_checks as dc
import pytest

pytest.importorskip("mlpair.prediction.server", reason="mlpair is not installed")

from mlpair.rpc.health import LIVENESS  # noqa: E402  (after the skip: needs mlpair)

# OIP model-repository RPCs that change what a server serves: never open to a caller.
REPOSITORY_CONTROL = {"RepositoryModelLoad", "RepositoryModelUnload"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.fixture(params=dc.OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict) -> list[dict]:
    return rendered[request.param]


def registered_health_names(service: str) -> set[str]:
    """grpc.health.v1 names each server publishes, built the way its server builds them."""
    if service == "inference":
        from mlpair.inference.server import OIP_SERVICE_NAME, SERVICE_NAME

        return {"", SERVICE_NAME, OIP_SERVICE_NAME}
    if service == dc.RELAY:
        from mlpair.prediction.relay_server import RelayHealth

        relay = RelayHealth()
        return {*relay.names, *(dep for dep in ("ledger", "crm"))}
    from mlpair.prediction.health import PredictionHealth
    from mlpair.prediction.server import SERVICE_NAME

    health = PredictionHealth(SERVICE_NAME)
    return set(health.names) | set(health.dependency_names.values())


def readiness_names(service: str) -> set[str]:
    """The names that mean "ready to serve" (per-dependency names mean something else)."""
    if service == "inference":
        return registered_health_names("inference")
    if service == dc.RELAY:
        from mlpair.prediction.relay_server import RelayHealth

        return set(RelayHealth().names)
    from mlpair.prediction.server import SERVICE_NAME

    return {"", SERVICE_NAME}


def test_probes_ask_for_health_names_the_servers_register(objects: list) -> None:
    for workload in dc.workloads(objects):
        service = dc.app_of(workload)
        container = dc.pod_spec(workload)["containers"][0]
        for probe in ("startupProbe", "readinessProbe"):
            name = container[probe]["grpc"].get("service", "")
            # An unknown name is answered NOT_FOUND: the probe would never pass.
            assert name in registered_health_names(service) | {LIVENESS}, (dc.name_of(workload), probe)
            # PredictionService/<dependency> turns NOT_SERVING when inference, the CRM or the cache
            # is down, while the service is still ready (degraded): never a probe's name. Startup
            # may ask `liveness` (test_deploy_production.py says which name each asks).
            allowed = readiness_names(service) | ({LIVENESS} if probe == "startupProbe" else set())
            assert name in allowed, (dc.name_of(workload), probe, name)
        # Liveness asks a name of its own, SERVING while the process lives, never a readiness
        # name (test_deploy_production.py); the started servers answer it in
        # test_deploy_startup.py.
        liveness = container["livenessProbe"]["grpc"].get("service", "")
        assert liveness not in readiness_names(service), dc.name_of(workload)


def inference_metrics() -> dict[str, str]:
    """Metric name -> type of every collector in mlpair.inference.metrics."""
    from prometheus_client.metrics import MetricWrapperBase

    from mlpair.inference import metrics

    found = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                found[family.name] = family.type
    return found


def hpa_pod_metrics(objects: list) -> list[tuple[dict, dict]]:
    return [
        (hpa, metric)
        for hpa in dc.of_kind(objects, "HorizontalPodAutoscaler")
        for metric in hpa["spec"]["metrics"]
        if metric["type"] == "Pods"
    ]


def test_autoscaler_metrics_exist(objects: list) -> None:
    exported = inference_metrics()
    assert exported.get("inference_queue_depth_rows") == "gauge"  # rows waiting in the batcher
    # The in-flight metric is the rate of the latency histogram's sum (Little's law).
    assert exported.get("inference_request_duration_seconds") == "histogram"
    pairs = hpa_pod_metrics(objects)
    assert pairs, "no HPA scales on a per-pod metric"
    for hpa, _ in pairs:
        assert hpa["spec"]["scaleTargetRef"]["name"] == "inference"
    # Each is provided by a prometheus-adapter rule shipped in deploy/observability, reading a
    # series the service exports: test_deploy_production.py.


def test_queue_depth_target_is_half_a_batch_of_rows(objects: list) -> None:
    (inference,) = dc.workloads(objects, "inference")
    settings = dc.settings_of(inference, objects)
    max_batch = int(settings["INFERENCE_MAX_BATCH_SIZE"])
    for _, metric in hpa_pod_metrics(objects):
        if metric["pods"]["metric"]["name"] == "inference_queue_depth_rows":
            target = float(dc.parse_quantity(metric["pods"]["target"]["averageValue"]))
            # Rows, like the gauge: scale before a pod has a whole batch of backlog, and long
            # before its queue is full (RESOURCE_EXHAUSTED).
            assert target == max_batch / 2
            assert target < int(settings["INFERENCE_MAX_QUEUE_ROWS"])


def test_prediction_packs_rows_into_whole_inference_batches(objects: list) -> None:
    (inference,) = dc.workloads(objects, "inference")
    max_batch = int(dc.settings_of(inference, objects)["INFERENCE_MAX_BATCH_SIZE"])
    for workload in dc.workloads(objects, "prediction"):
        rows = int(dc.settings_of(workload, objects)["PREDICTION_INFERENCE_MAX_BATCH_ROWS"])
        # Larger Infer calls would be split server-side into batches anyway (settings.py).
        assert rows <= max_batch, dc.name_of(workload)


def grpc_services() -> dict[str, dict[str, set[str]]]:
    """Service full name -> method names, of every gRPC service each server registers."""
    from grpc_health.v1 import health_pb2

    from mlpair.api.inference.v1 import inference_service_pb2
    from mlpair.api.oip import grpc_predict_v2_pb2
    from mlpair.api.prediction.v1 import prediction_service_pb2

    def methods(*descriptors) -> dict[str, set[str]]:
        return {
            service.full_name: {method.name for method in service.methods}
            for descriptor in descriptors
            for service in descriptor.services_by_name.values()
        }

    return {
        "inference": methods(
            inference_service_pb2.DESCRIPTOR, grpc_predict_v2_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR
        ),
        "prediction": methods(prediction_service_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR),
    }


@pytest.mark.parametrize("service", ["inference", "prediction"])
def test_authorization_admits_every_grpc_service_on_the_port(objects: list, service: str) -> None:
    # InferenceService, the Open Inference Protocol and grpc.health.v1 share one port: a path the
    # policy forgets is denied (403 -> UNAVAILABLE) for every named caller.
    services = grpc_services()[service]
    policy = dc.by_name(objects, "AuthorizationPolicy", f"{service}-callers")
    for rule in policy["spec"]["rules"]:
        for operation in rule["to"]:
            paths = set(operation["operation"]["paths"])
            assert paths == {f"/{name}/*" for name in services}, dc.name_of(policy)
            for path in operation["operation"].get("notPaths", ()):
                _, name, method = path.split("/")
                assert method in services.get(name, set()), f"{path} is no RPC of the server"


def test_repository_control_is_closed_to_every_caller(objects: list) -> None:
    (rule,) = dc.by_name(objects, "AuthorizationPolicy", "inference-callers")["spec"]["rules"]
    for operation in rule["to"]:
        closed = {p.rsplit("/", 1)[1] for p in operation["operation"].get("notPaths", ())}
        assert closed == REPOSITORY_CONTROL
    (inference,) = dc.workloads(objects, "inference")
    # The server refuses them as well (only model_control=explicit takes them): what it serves
    # changes by publishing to its model source, which it polls.
    assert dc.settings_of(inference, objects)["INFERENCE_MODEL_CONTROL"] == "poll"


def test_runtime_is_the_one_the_image_carries(objects: list) -> None:
    import tomllib

    extras = tomllib.loads((dc.REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    dockerfile = (dc.DEPLOY_DIR / "docker" / "inference.Dockerfile").read_text()
    (extra,) = re.findall(r"pip install --no-cache-dir '\.\[([\w-]+)\]'", dockerfile)
    image = " ".join(extras[extra])
    (inference,) = dc.workloads(objects, "inference")
    settings = dc.settings_of(inference, objects)
    if settings["INFERENCE_RUNTIME"] == "torch":
        assert "torch" in image, "INFERENCE_RUNTIME=torch needs an image with the torch extra"
    else:
        assert settings["INFERENCE_RUNTIME"] == "onnx"
        assert "onnxruntime-gpu" in image
    # The GPU pool: ONNX Runtime's CUDA execution provider (a CPU fallback is logged).
    assert settings["INFERENCE_EXECUTION_PROVIDER"] == "cuda"
