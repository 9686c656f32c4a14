"""What the rendered objects make a cluster do, beyond what each says: the QoS class of the whole
pod with the sidecar Istio injects, liveness kept apart from readiness, serving processes per pod
against the CPU limit, autoscaling on the app container's CPU and on per-pod metrics that the
shipped prometheus-adapter rules provide from series the services export, the mesh's rate limit
above the measured capacity of a pod, and gRPC reflection open to operators only.

Each check reads the rendered overlays (as applied); each is also shown to fire on a broken copy.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
from decimal import Decimal
from pathlib import Path

import deploy_checks as dc
import pytest
import yaml

PREFIX = dc.PREFIX
# grpc.health.v1 name each server keeps SERVING for as long as the process can answer at all,
# apart from the readiness names (services/*/server.py); test_deploy_startup.py asks the started
# servers for it.
LIVENESS = "liveness"
READINESS = {
    "inference": "mlpair.inference.v1.InferenceService",
    "prediction": "mlpair.prediction.v1.PredictionService",
    dc.RELAY: "relay",  # services/prediction/mlpair/prediction/relay_server.py: SERVING while the ledger answers
}
# What the startup probe waits for: InferenceService's own start-up (load and warm-up of every
# version) is its readiness; PredictionService has started once it answers, and its readiness
# follows the shared ledger, an outside dependency a starting pod must wait for unready, never be
# restarted over (docs/deployment.md, "Probes and graceful shutdown").
STARTUP = {"inference": READINESS["inference"], "prediction": LIVENESS, dc.RELAY: LIVENESS}
# Shortest startup window (s): load plus warm-up. InferenceService initialises CUDA and loads and
# warms every mounted version (1.06 s without CUDA, docs/performance.md; CUDA's initialisation
# alone can take tens of seconds); PredictionService checks the ledger schema and loads each
# family's configuration. docs/deployment.md, "Probes and graceful shutdown".
STARTUP_WINDOW_S = {"inference": 120, "prediction": 30, dc.RELAY: 30}
GPU = "nvidia.com/gpu"
OPERATOR = f"{dc.TRUST_DOMAIN}/ns/ops/sa/mlpair-operator"
REFLECTION = (
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
)
HEALTH = "/grpc.health.v1.Health/Check"
BUSINESS = {
    "inference": (
        "/mlpair.inference.v1.InferenceService/Infer",
        "/inference.GRPCInferenceService/ModelInfer",
    ),
    "prediction": (
        "/mlpair.prediction.v1.PredictionService/Predict",
        "/mlpair.prediction.v1.PredictionService/BatchPredict",
    ),
}
PERFORMANCE = dc.REPO_ROOT / "docs" / "performance.md"
DEPLOYMENT = dc.REPO_ROOT / "docs" / "deployment.md"
CAPACITY = re.compile(
    r"Measured capacity of one InferenceService process: \*\*([\d,]+) calls/s\*\*"
)


@pytest.fixture(params=dc.OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict) -> list[dict]:
    return rendered[request.param]


def app(workload: dict) -> str:
    return dc.app_of(workload)


def main_container(workload: dict) -> dict:
    return dc.pod_spec(workload)["containers"][0]


def workers(workload: dict, objects: list) -> int:
    return int(dc.settings_of(workload, objects)[f"{PREFIX[app(workload)]}_WORKERS"])


# --------------------------------------------------------------------------- QoS


def test_every_serving_pod_is_guaranteed_with_its_sidecar(objects: list) -> None:
    for workload in dc.workloads(objects):
        sidecars = dc.injected_sidecars(workload)
        assert sidecars, f"{dc.name_of(workload)}: no sidecar injected"
        # The four annotations set, so the mesh's defaults (Burstable) never apply.
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert set(dc.SIDECAR_RESOURCE_ANNOTATIONS.values()) <= set(annotations)
        assert dc.pod_qos_class(workload) == "Guaranteed", dc.name_of(workload)


def _pod(*resources: dict, annotations: dict | None = None) -> dict:
    return {
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "template": {
                "metadata": {"annotations": annotations or {}},
                "spec": {
                    "containers": [
                        {"name": f"c{i}", "resources": r} for i, r in enumerate(resources)
                    ]
                },
            }
        },
    }


EQUAL = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
NO_SIDECAR = {"sidecar.istio.io/inject": "false"}
SIDECAR = {
    "sidecar.istio.io/proxyCPU": "500m",
    "sidecar.istio.io/proxyCPULimit": "500m",
    "sidecar.istio.io/proxyMemory": "256Mi",
    "sidecar.istio.io/proxyMemoryLimit": "256Mi",
}


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (_pod(EQUAL, annotations=SIDECAR), "Guaranteed"),
        (_pod(EQUAL, annotations=NO_SIDECAR), "Guaranteed"),
        # The sidecar as these manifests had it: requests below limits.
        (_pod(EQUAL, annotations={**SIDECAR, "sidecar.istio.io/proxyCPU": "250m"}), "Burstable"),
        # No annotation: the mesh's default proxy resources (100m / 2 CPU).
        (_pod(EQUAL), "Burstable"),
        # A limit annotation alone: the proxy gets no request, defaulted to its limit.
        (_pod(EQUAL, annotations={"sidecar.istio.io/proxyCPULimit": "1",
                                  "sidecar.istio.io/proxyMemoryLimit": "256Mi"}), "Guaranteed"),
        # Only a request annotated: the proxy has no limits at all.
        (_pod(EQUAL, annotations={"sidecar.istio.io/proxyCPU": "1"}), "Burstable"),
        (_pod({"limits": {"cpu": "1", "memory": "1Gi"}}, annotations=NO_SIDECAR), "Guaranteed"),
        (_pod(EQUAL, {"limits": {"cpu": "1"}}, annotations=NO_SIDECAR), "Burstable"),
        (_pod({"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": EQUAL["limits"]},
              annotations=NO_SIDECAR), "Burstable"),
        # Extended resources do not count; CPU and memory alone decide.
        (_pod({"requests": {**EQUAL["requests"], GPU: "1"},
               "limits": {**EQUAL["limits"], GPU: "1"}}, annotations=NO_SIDECAR), "Guaranteed"),
        (_pod({}, annotations=NO_SIDECAR), "BestEffort"),
    ],
)
def test_qos_class_is_computed_as_kubernetes_does(pod: dict, expected: str) -> None:
    assert dc.pod_qos_class(pod) == expected


def test_qos_check_catches_the_former_sidecar_sizes(rendered: dict) -> None:
    for name, request in (("inference", "500m"), ("prediction-stable", "250m")):
        broken = copy.deepcopy(dc.by_name(rendered["prod"], "Deployment", name))
        broken["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/proxyCPU"] = request
        assert dc.pod_qos_class(broken) == "Burstable", name


# --------------------------------------------------------------------------- probes


def test_liveness_asks_a_name_apart_from_readiness(objects: list) -> None:
    for workload in dc.workloads(objects):
        where = dc.name_of(workload)
        container = main_container(workload)
        names = {probe: container[probe]["grpc"].get("service", "") for probe in
                 ("startupProbe", "readinessProbe", "livenessProbe")}
        # Readiness on the deep check (models warmed / ledger writable, not draining); liveness on
        # the name that stays SERVING while the process can answer at all, so an unready model or
        # a stalled ledger makes the pod unready, never restarted; startup as STARTUP says.
        assert names["readinessProbe"] == READINESS[app(workload)], where
        assert names["startupProbe"] == STARTUP[app(workload)], where
        assert names["livenessProbe"] == LIVENESS, where
        assert names["livenessProbe"] not in {names["readinessProbe"], ""}, where


def test_startup_covers_load_and_warm_up(objects: list) -> None:
    for workload in dc.workloads(objects):
        container = main_container(workload)
        startup = container["startupProbe"]
        window_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert window_s >= STARTUP_WINDOW_S[app(workload)], dc.name_of(workload)
        liveness = container["livenessProbe"]
        assert window_s > liveness["periodSeconds"] * liveness["failureThreshold"]


# --------------------------------------------------------------------------- serving processes


def test_serving_processes_match_the_cpu_limit(objects: list) -> None:
    for workload in dc.workloads(objects):
        where = dc.name_of(workload)
        container = main_container(workload)
        count = workers(workload, objects)
        limit = dc.cpu_limit(container)
        if app(workload) == "inference":
            # One serving process per GPU (it owns the device and its CUDA context); its event
            # loop is about one core, plus at most one core for the runtime's and gRPC's threads.
            assert count == int(container["resources"]["limits"][GPU]), where
            assert count <= limit <= count + 1, where
        else:
            # One process, one event loop, per core of the limit (at least one).
            assert count == max(1, int(limit)), where


# --------------------------------------------------------------------------- autoscaling


def markdown_tables(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(heading above, rows as {header: cell}) of every table of a Markdown text."""
    tables: list[tuple[str, list[dict[str, str]]]] = []
    heading, block = "", []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            block.append([cell.strip() for cell in stripped.strip("|").split("|")])
            continue
        if len(block) > 2:
            header = block[0]
            tables.append((heading, [dict(zip(header, row, strict=False)) for row in block[2:]]))
        block = []
        if stripped.startswith("#"):
            heading = stripped.lstrip("#").strip()
    return tables


def number(cell: str) -> float:
    return float(cell.replace(",", "").replace("**", ""))


def inference_rates() -> list[tuple[float, str]]:
    """Every rate of one InferenceService process that docs/performance.md reports: unary OIP
    ModelInfer calls (`make bench`, server `mlpair`) and the direct Infer calls PredictionService
    makes (`make bench-predict`, phase `direct Infer`), with where each comes from."""
    rates = []
    for heading, rows in markdown_tables(PERFORMANCE.read_text()):
        for row in rows:
            if row.get("server") == "mlpair" and "req/s" in row:
                rates.append((number(row["req/s"]), f"{heading}: {row['model']} c={row['conc']}"))
            if row.get("phase") == "direct Infer" and "calls/s" in row:
                where = f"{heading}: direct Infer c={row['in flight']}"
                rates.append((number(row["calls/s"]), where))
    assert rates, "docs/performance.md reports no InferenceService rate"
    return rates


def saturating_concurrency() -> int:
    """Fewest calls in flight at which one InferenceService process served within 5 % of its peak
    rate on the real model (`make bench`, server `mlpair`, credit-risk)."""
    points = [
        (int(row["conc"]), number(row["req/s"]))
        for _, rows in markdown_tables(PERFORMANCE.read_text())
        for row in rows
        if row.get("server") == "mlpair" and row.get("model") == "credit-risk"
    ]
    peak = max(rate for _, rate in points)
    return min(conc for conc, rate in points if rate >= 0.95 * peak)


def test_cpu_autoscaling_measures_the_app_container(objects: list) -> None:
    for workload in [w for w in dc.workloads(objects) if app(w) != dc.RELAY]:  # not autoscaled
        hpa = dc.autoscaler_of(workload, objects)
        where = dc.name_of(hpa)
        metrics = hpa["spec"]["metrics"]
        # A pod-level Resource metric sums every container: the sidecar's CPU would hide or fake
        # the app's load.
        assert not any(metric["type"] == "Resource" for metric in metrics), where
        cpu = [m["containerResource"] for m in metrics if m["type"] == "ContainerResource"]
        assert cpu, f"{where}: no ContainerResource CPU metric"
        container = main_container(workload)
        for metric in cpu:
            assert metric["name"] == "cpu" and metric["container"] == container["name"], where
            assert metric["target"]["type"] == "Utilization"
            # Scale before the event loops saturate: one core each.
            utilisation = Decimal(metric["target"]["averageUtilization"]) / 100
            target_cores = utilisation * dc.cpu_limit(container)
            assert target_cores < workers(workload, objects), where


def test_inference_scales_on_its_event_loops_not_on_gpu_utilisation(objects: list) -> None:
    (inference,) = dc.workloads(objects, "inference")
    metrics = dc.autoscaler_of(inference, objects)["spec"]["metrics"]
    pods = {
        m["pods"]["metric"]["name"]: m["pods"]["target"] for m in metrics if m["type"] == "Pods"
    }
    assert set(pods) == {"inference_requests_in_flight", "inference_queue_depth_rows"}
    assert {m["type"] for m in metrics} == {"ContainerResource", "Pods"}
    # In flight per pod: at most half of what one process needs in flight to reach its peak
    # rate, per process.
    target = dc.parse_quantity(pods["inference_requests_in_flight"]["averageValue"])
    assert 0 < target <= workers(inference, objects) * Decimal(saturating_concurrency()) / 2


def adapter_rules(rendered_adapter: list) -> list[dict]:
    (config_map,) = dc.of_kind(rendered_adapter, "ConfigMap")
    return dc.adapter_config(config_map)["rules"]


def test_every_hpa_metric_is_provided_by_a_shipped_adapter_rule(
    objects: list, rendered_adapter: list
) -> None:
    assert dc.adapter_problems(objects, adapter_rules(rendered_adapter)) == []


def test_adapter_check_rejects_missing_duplicate_and_unusable_rules(
    rendered: dict, rendered_adapter: list
) -> None:
    objects = copy.deepcopy(rendered["prod"])
    hpa = dc.by_name(objects, "HorizontalPodAutoscaler", "inference")
    hpa["spec"]["metrics"].append(
        {"type": "Pods", "pods": {"metric": {"name": "DCGM_FI_DEV_GPU_UTIL"},
                                  "target": {"type": "AverageValue", "averageValue": "70"}}}
    )
    rules = copy.deepcopy(adapter_rules(rendered_adapter))
    rules.append(copy.deepcopy(rules[0]))
    del rules[1]["resources"]
    rules[1]["metricsQuery"] = "sum(<<.Series>>) by (<<.GroupBy>>)"
    problems = "\n".join(dc.adapter_problems(objects, rules))
    for expected in (
        "metric DCGM_FI_DEV_GPU_UTIL is provided by 0 adapter rules",
        "metric inference_queue_depth_rows is provided by 2 adapter rules",
        "its series are not mapped to namespace and pod",
        "metricsQuery lacks <<.LabelMatchers>>",
    ):
        assert expected in problems, f"adapter check missed: {expected}\n{problems}"


def exported_series() -> dict[str, str]:
    """Every series name the services' metrics modules export -> the metric's type."""
    pytest.importorskip("mlpair.prediction.metrics", reason="mlpair is not installed")
    from prometheus_client.metrics import MetricWrapperBase

    from mlpair.inference import metrics as inference_metrics
    from mlpair.prediction import metrics as prediction_metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    found = {}
    for module in (inference_metrics, prediction_metrics):
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                for family in value.describe():
                    for suffix in suffixes.get(family.type, ("",)):
                        found[family.name + suffix] = family.type
    return found


def test_adapter_rules_read_series_the_services_export(rendered_adapter: list) -> None:
    exported = exported_series()
    for rule in adapter_rules(rendered_adapter):
        series, name = dc.adapter_rule_metric(rule)
        assert series in exported, f"{name}: {series} is not a series the services export"
        if exported[series] == "gauge":
            # A level, summed per pod as it is.
            assert "rate(" not in rule["metricsQuery"], name
        else:
            # A counter or a histogram's running sum: only its rate means anything per pod.
            assert "rate(<<.Series>>" in rule["metricsQuery"], name


def test_adapter_queries_are_valid_promql(
    rendered_adapter: list, promtool: Path, tmp_path: Path
) -> None:
    """Each rule's query as the adapter sends it (its template filled in), parsed by promtool."""
    queries = [
        dc.expand_adapter_query(rule, dc.NAMESPACE, ["inference-7c9d-abcde", "inference-7c9d-x"])
        for rule in adapter_rules(rendered_adapter)
    ]
    rules_file = tmp_path / "adapter-queries.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
        {"record": f"adapter:query_{i}", "expr": query} for i, query in enumerate(queries)]}]}))
    out = subprocess.run([str(promtool), "check", "rules", str(rules_file)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", dc.KUBERNETES_VERSIONS)
def test_adapter_config_map_matches_the_kubernetes_schema(
    rendered_adapter: list, kubernetes_validate_installed: None, version: str
) -> None:
    (config_map,) = rendered_adapter
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert dc.kubernetes_schema_errors(config_map, version) == []


# --------------------------------------------------------------------------- mesh rate limit


def test_documented_capacity_is_the_highest_measured_rate() -> None:
    found = CAPACITY.search(DEPLOYMENT.read_text())
    assert found, "docs/deployment.md states no measured capacity of an InferenceService process"
    rate, source = max(inference_rates())
    assert number(found[1]) == rate, f"docs/performance.md's highest rate is {rate:,.0f} ({source})"


def test_rate_limit_is_a_safety_valve_above_measured_capacity(objects: list) -> None:
    capacity = number(CAPACITY.search(DEPLOYMENT.read_text())[1])
    (inference,) = dc.workloads(objects, "inference")
    (envoy_filter,) = dc.of_kind(objects, "EnvoyFilter")
    (patch,) = envoy_filter["spec"]["configPatches"]
    bucket = patch["patch"]["value"]["typed_config"]["token_bucket"]
    per_s = bucket["tokens_per_fill"] * 1000 / dc.duration_ms(bucket["fill_interval"])
    # Never below what the pod's serving processes can answer: shedding is the server's (its
    # bounded queue), which the autoscaler sees; refusals here it would not.
    assert per_s >= workers(inference, objects) * capacity
    assert bucket["max_tokens"] >= bucket["tokens_per_fill"]
    assert f"{per_s:,.0f} calls/s per pod" in DEPLOYMENT.read_text(), "docs/deployment.md is stale"


def test_rate_limit_refusals_are_never_breaker_failures() -> None:
    """The mesh's refusal (RESOURCE_EXHAUSTED with its header) is load shed for PredictionService:
    InferenceOverloaded, which its circuit breaker does not count."""
    pytest.importorskip("mlpair.prediction.scoring.client", reason="mlpair is not installed")
    import grpc

    from mlpair.prediction.errors import InferenceOverloaded
    from mlpair.prediction.scoring.client import RATE_LIMITED_HEADER, classify

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "local_rate_limited"

        def initial_metadata(self):
            return ((RATE_LIMITED_HEADER, "true"),)

        def trailing_metadata(self):
            return ()

    cause, error = classify(Refused())
    assert cause == "rate_limited" and isinstance(error, InferenceOverloaded)
    (envoy_filter,) = dc.load_file(dc.ISTIO_DIR / "inference-rate-limit.yaml")
    headers = envoy_filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"][
        "response_headers_to_add"]
    assert {h["header"]["key"] for h in headers} == {RATE_LIMITED_HEADER}


# --------------------------------------------------------------------------- reflection


def business_callers(objects: list, service: str) -> list[str]:
    """One principal of each caller the service's business policy admits (an account of each
    admitted namespace)."""
    principals = []
    for rule in dc.by_name(objects, "AuthorizationPolicy", f"{service}-callers")["spec"]["rules"]:
        for source in (entry["source"] for entry in rule["from"]):
            principals += source.get("principals", [])
            principals += [
                f"{dc.TRUST_DOMAIN}/ns/{ns}/sa/default" for ns in source.get("namespaces", [])
            ]
    return principals


def reflection_problems(objects: list) -> list[str]:
    """Who may use gRPC reflection and what operators may call, per the AuthorizationPolicies:
    operators reflection and health only, business callers no reflection."""
    problems = []
    for service in ("inference", "prediction"):
        for workload in dc.workloads(objects, service):
            port = dc.grpc_port(main_container(workload))
            where = dc.name_of(workload)

            # this workload and port, bound now (not looked up when called, after the loop moved on)
            allows = functools.partial(dc.authorization_allows, objects, workload, port=port)

            for path in REFLECTION:
                if not allows(OPERATOR, path):
                    problems.append(f"{where}: operators may not call {path}")
                problems += [
                    f"{where}: {caller} may call {path}"
                    for caller in business_callers(objects, service)
                    if allows(caller, path)
                ]
            if not allows(OPERATOR, HEALTH):
                problems.append(f"{where}: operators may not call {HEALTH}")
            problems += [f"{where}: operators may call {path}" for path in BUSINESS[service]
                         if allows(OPERATOR, path)]
            # The evaluator sees the business callers through: their own calls pass.
            problems += [f"{where}: {caller} may not call {path}"
                         for caller in business_callers(objects, service)
                         for path in BUSINESS[service] if not allows(caller, path)]
    return problems


def test_reflection_is_for_operators_only(objects: list) -> None:
    assert reflection_problems(objects) == []


def test_reflection_check_rejects_a_policy_that_opens_it(rendered: dict) -> None:
    objects = copy.deepcopy(rendered["prod"])
    callers = dc.by_name(objects, "AuthorizationPolicy", "prediction-callers")
    callers["spec"]["rules"][0]["to"][0]["operation"]["paths"].append("/grpc.reflection.*")
    operators = dc.by_name(objects, "AuthorizationPolicy", "inference-operators")
    operators["spec"]["rules"][0]["to"][0]["operation"]["paths"] = ["/*"]
    problems = "\n".join(reflection_problems(objects))
    for expected in (
        "Deployment/prediction-stable: cluster.local/ns/lending/sa/default may call "
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "Deployment/inference: operators may call /mlpair.inference.v1.InferenceService/Infer",
    ):
        assert expected in problems, f"reflection check missed: {expected}\n{problems}"
    # allow-nothing alone (no other ALLOW policy) admits nobody.
    only_deny = [p for p in objects if dc.name_of(p) != "AuthorizationPolicy/inference-operators"]
    (inference,) = dc.workloads(objects, "inference")
    assert not dc.authorization_allows(only_deny, inference, OPERATOR, REFLECTION[0], 8001)
