"""What schemas cannot say: objects that must agree with each other, with the services' settings
and with the SLAs. Each test reads the rendered overlays (as applied), not the source files."""

from __future__ import annotations

import re
from pathlib import Path

import deploy_checks as dc
import pytest

# Exact health service names the servers register (grpc.health.v1, per service).
HEALTH_SERVICE = {
    "inference": "mlpair.inference.v1.InferenceService",
    "prediction": "mlpair.prediction.v1.PredictionService",
}
# Env prefix of each service's settings.
PREFIX = {"inference": "INFERENCE", "prediction": "PREDICTION"}
# gRPC paths each AuthorizationPolicy must let through to its service.
GRPC_PATHS = {
    "inference": {"/mlpair.inference.v1.InferenceService/*", "/inference.GRPCInferenceService/*"},
    "prediction": {"/mlpair.prediction.v1.PredictionService/*"},
}
PRINCIPAL = re.compile(
    r"^(?P<domain>[^/*]+)/ns/(?P<namespace>[a-z0-9-]+)/sa/(?P<account>[a-z0-9-]+)$"
)
GPU = "nvidia.com/gpu"


def app(workload: dict) -> str:
    return dc.pod_labels(workload)["app.kubernetes.io/name"]


def deployments(objects: list, name: str | None = None) -> list[dict]:
    found = dc.of_kind(objects, "Deployment")
    return [d for d in found if name is None or app(d) == name]


def model_version(workload: dict) -> str:
    return dc.pod_labels(workload)["mlpair.io/model-version"]


@pytest.fixture(params=dc.OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict) -> list[dict]:
    """The rendered objects of one overlay (each test runs once per overlay)."""
    return rendered[request.param]


# --------------------------------------------------------------------------- placement and drain


def test_inference_runs_on_the_gpu_pool_with_one_gpu(objects: list) -> None:
    inference = deployments(objects, "inference")
    assert inference, "no inference Deployment rendered"
    for workload in inference:
        spec = dc.pod_spec(workload)
        assert spec["nodeSelector"] == {"mlpair.io/node-pool": "gpu"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        resources = spec["containers"][0]["resources"]
        # Extended resources cannot be overcommitted: request == limit == one whole GPU.
        assert resources["limits"][GPU] == resources["requests"][GPU] == "1"


def test_prediction_runs_on_the_cpu_pool_without_gpu(objects: list) -> None:
    (workload,) = deployments(objects, "prediction")
    spec = dc.pod_spec(workload)
    assert spec["nodeSelector"] == {"mlpair.io/node-pool": "cpu"}
    assert not any(t.get("key") == GPU for t in spec.get("tolerations", ()))
    for container in dc.containers(workload):
        for section in ("requests", "limits"):
            assert GPU not in container["resources"].get(section, {})


def test_termination_grace_covers_prestop_drain_and_sidecar(objects: list) -> None:
    # Order on deletion: preStop sleep (endpoints converge) -> SIGTERM -> server drains for up to
    # *_SHUTDOWN_GRACE_S -> app exits -> native sidecar drains. SIGKILL must not come first.
    for workload in deployments(objects):
        where = dc.name_of(workload)
        settings = dc.settings_of(workload, objects)
        drain_s = float(settings[f"{PREFIX[app(workload)]}_SHUTDOWN_GRACE_S"])
        container = dc.pod_spec(workload)["containers"][0]
        pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace_s = dc.pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace_s >= pre_stop_s + drain_s + dc.SIDECAR_DRAIN_S, where
        # A draining server reports NOT_SERVING; liveness must not kill it before the drain ends.
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_s, where


def test_ports_and_probes_agree_with_the_settings(objects: list) -> None:
    for workload in deployments(objects):
        settings = dc.settings_of(workload, objects)
        prefix = PREFIX[app(workload)]
        container = dc.pod_spec(workload)["containers"][0]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports["grpc"] == int(settings[f"{prefix}_PORT"])
        assert ports["http-metrics"] == int(settings[f"{prefix}_METRICS_PORT"])
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == settings[f"{prefix}_METRICS_PORT"]
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {
                "port": ports["grpc"],
                "service": HEALTH_SERVICE[app(workload)],
            }
        # Liveness asks the overall server status ("").
        assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"]}


def test_services_select_pods_on_their_grpc_port(objects: list) -> None:
    for service in dc.of_kind(objects, "Service"):
        selected = [
            d
            for d in deployments(objects)
            if dc.selector_matches(service["spec"]["selector"], dc.pod_labels(d))
        ]
        assert selected, f"{dc.name_of(service)} selects no pods"
        for port in service["spec"]["ports"]:
            for workload in selected:
                container_ports = {
                    p["name"]: p["containerPort"]
                    for p in dc.pod_spec(workload)["containers"][0]["ports"]
                }
                assert port["targetPort"] in container_ports
                # Istio AuthorizationPolicy ports are container ports; keep both numbers equal.
                assert port["port"] == container_ports[port["targetPort"]]
            assert port.get("appProtocol") == "grpc"


def test_deployment_selectors_match_their_own_pods(objects: list) -> None:
    for workload in deployments(objects):
        assert dc.selector_matches(workload["spec"]["selector"], dc.pod_labels(workload))


# --------------------------------------------------------------------------- scaling and disruption


def test_every_deployment_has_one_autoscaler_and_leaves_replicas_to_it(objects: list) -> None:
    autoscalers = dc.of_kind(objects, "HorizontalPodAutoscaler")
    for workload in deployments(objects):
        targeting = [
            hpa
            for hpa in autoscalers
            if hpa["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
        ]
        assert len(targeting) == 1, dc.name_of(workload)
        # With an HPA, spec.replicas in the manifest would reset the count on every apply.
        assert "replicas" not in workload["spec"], dc.name_of(workload)
        spec = targeting[0]["spec"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    assert len(autoscalers) == len(deployments(objects))


def test_production_keeps_two_pods_of_everything(rendered: dict) -> None:
    # One pod per version would let a single node failure take a whole canary subset away.
    for hpa in dc.of_kind(rendered["prod"], "HorizontalPodAutoscaler"):
        assert hpa["spec"]["minReplicas"] >= 2, dc.name_of(hpa)


def test_autoscaling_signals(objects: list) -> None:
    autoscalers = {
        hpa["spec"]["scaleTargetRef"]["name"]: hpa
        for hpa in dc.of_kind(objects, "HorizontalPodAutoscaler")
    }
    (prediction,) = deployments(objects, "prediction")
    metrics = autoscalers[prediction["metadata"]["name"]]["spec"]["metrics"]
    assert {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}},
    } in metrics
    for workload in deployments(objects, "inference"):
        metrics = autoscalers[workload["metadata"]["name"]]["spec"]["metrics"]
        names = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
        # Queue depth or a GPU metric; CPU says nothing about a GPU-bound server.
        assert "inference_queue_depth" in names and "DCGM_FI_DEV_GPU_UTIL" in names
        assert not any(m["type"] == "Resource" for m in metrics)


def test_every_deployment_has_a_budget_covering_only_its_pods(objects: list) -> None:
    budgets = dc.of_kind(objects, "PodDisruptionBudget")
    for workload in deployments(objects):
        own = [
            b
            for b in budgets
            if dc.selector_matches(b["spec"]["selector"], dc.pod_labels(workload))
        ]
        assert len(own) == 1, dc.name_of(workload)
        assert own[0]["spec"].get("maxUnavailable") == 1
        others = [d for d in deployments(objects) if d is not workload]
        assert not any(
            dc.selector_matches(own[0]["spec"]["selector"], dc.pod_labels(d)) for d in others
        )


# --------------------------------------------------------------------------- references and config


def test_references_resolve_inside_the_render(objects: list) -> None:
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    for workload in deployments(objects):
        spec = dc.pod_spec(workload)
        account = spec["serviceAccountName"]
        assert ("ServiceAccount", account) in names
        assert (
            dc.by_name(objects, "ServiceAccount", account).get("automountServiceAccountToken")
            is False
        )
        for container in dc.containers(workload):
            for source in container.get("envFrom", ()):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
        for volume in spec.get("volumes", ()):
            for source in volume.get("projected", {}).get("sources", ()):
                assert ("ConfigMap", source["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                assert (
                    "PersistentVolumeClaim",
                    volume["persistentVolumeClaim"]["claimName"],
                ) in names
                assert volume["persistentVolumeClaim"]["readOnly"] is True


def test_crm_url_comes_from_a_secret_that_is_not_in_the_repository(objects: list) -> None:
    assert not dc.of_kind(objects, "Secret"), "secrets must not be committed"
    (workload,) = deployments(objects, "prediction")
    env = {v["name"]: v for v in dc.pod_spec(workload)["containers"][0].get("env", ())}
    assert env["PREDICTION_CRM_URL"] == {
        "name": "PREDICTION_CRM_URL",
        "valueFrom": {"secretKeyRef": {"name": "prediction-crm", "key": "url"}},
    }
    # Nor a plain copy of it in a ConfigMap.
    assert not any(
        "PREDICTION_CRM_URL" in c.get("data", {}) for c in dc.of_kind(objects, "ConfigMap")
    )


def test_prediction_config_is_mounted_where_the_service_reads_it(objects: list) -> None:
    (workload,) = deployments(objects, "prediction")
    settings = dc.settings_of(workload, objects)
    model_dir = f"{settings['PREDICTION_CONFIG_DIR']}/{settings['PREDICTION_MODEL_NAME']}"
    container = dc.pod_spec(workload)["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == model_dir]
    (volume,) = [v for v in dc.pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    keys = set()
    for source in volume["projected"]["sources"]:
        keys |= set(dc.by_name(objects, "ConfigMap", source["configMap"]["name"])["data"])
    assert {"feature-schema.toml", "policy.toml"} <= keys


@pytest.mark.parametrize("filename", ["feature-schema.toml", "policy.toml"])
def test_configmap_copies_match_the_repository_config(rendered: dict, filename: str) -> None:
    # kustomize can only read files below deploy/k8s/base, so the ConfigMaps are built from
    # copies; this keeps them identical to the files the services and training read.
    source = dc.REPO_ROOT / "config" / "credit-risk" / filename
    copy_path = dc.K8S_DIR / "base" / "prediction" / "config" / "credit-risk" / filename
    if not source.exists():
        pytest.skip(f"{source.relative_to(dc.REPO_ROOT)} does not exist yet")
    fix = f"cp {source.relative_to(dc.REPO_ROOT)} {copy_path.relative_to(dc.REPO_ROOT)}"
    assert copy_path.read_text() == source.read_text(), f"deploy copy is stale: {fix}"
    for objects in rendered.values():
        in_render = [
            c["data"][filename]
            for c in dc.of_kind(objects, "ConfigMap")
            if filename in c.get("data", {})
        ]
        assert in_render == [source.read_text()]


def test_every_serving_config_file_is_shipped() -> None:
    # PredictionService reads the feature schema and the policy; training.toml is for training only.
    shipped = {
        p.name
        for p in (dc.K8S_DIR / "base" / "prediction" / "config" / "credit-risk").glob("*.toml")
    }
    assert shipped == {"feature-schema.toml", "policy.toml"}


def test_inference_pods_see_only_their_model_version(objects: list) -> None:
    model = "credit-risk"
    for workload in deployments(objects, "inference"):
        version = model_version(workload)
        assert version.isdigit()
        settings = dc.settings_of(workload, objects)
        (mount,) = [
            m
            for m in dc.pod_spec(workload)["containers"][0]["volumeMounts"]
            if m["name"] == "model-repository"
        ]
        assert mount == {
            "name": "model-repository",
            "subPath": f"{model}/{version}",
            "mountPath": f"{settings['INFERENCE_MODEL_REPOSITORY']}/{model}/{version}",
            "readOnly": True,
        }
        assert workload["metadata"]["name"] == f"inference-v{version}"
    (prediction,) = deployments(objects, "prediction")
    assert dc.settings_of(prediction, objects)["PREDICTION_MODEL_NAME"] == model


def test_images_are_release_references(objects: list) -> None:
    for workload in deployments(objects):
        image = dc.pod_spec(workload)["containers"][0]["image"]
        assert re.match(
            rf"^[a-z0-9.-]+(:[0-9]+)?/.+/{app(workload)}(:[\w.-]+|@sha256:[0-9a-f]{{64}})$", image
        ), image
        assert not image.endswith(":latest")


# --------------------------------------------------------------------------- Istio


def test_every_inference_version_has_a_subset_and_every_subset_has_pods(objects: list) -> None:
    rule = dc.by_name(objects, "DestinationRule", "inference")
    subsets = {subset["name"]: subset["labels"] for subset in rule["spec"]["subsets"]}
    versions = {model_version(d): d for d in deployments(objects, "inference")}
    assert set(subsets) == {f"v{version}" for version in versions}
    for name, labels in subsets.items():
        selected = [
            d for d in deployments(objects) if dc.selector_matches(labels, dc.pod_labels(d))
        ]
        assert selected == [versions[name[1:]]], name


def test_routes_are_consistent(objects: list) -> None:
    assert dc.route_problems(objects) == []


def test_version_agnostic_istio_routes_are_consistent(rendered_istio: list, rendered: dict) -> None:
    # deploy/istio alone plus the Services it routes to.
    services = dc.of_kind(rendered["dev"], "Service")
    assert dc.route_problems(rendered_istio + services) == []


def test_route_checks_reject_the_broken_routing_fixture(rendered: dict, fixtures_dir: Path) -> None:
    (broken,) = dc.load_file(fixtures_dir / "broken" / "virtualservice-bad-routing.yaml")
    objects = [obj for obj in rendered["prod"] if dc.name_of(obj) != "VirtualService/inference"] + [
        broken
    ]
    problems = "\n".join(dc.route_problems(objects))
    for expected in (
        "weights [80, 10] do not add up to 100",
        "subset 'v9' is not defined",
        "route weighted: no timeout",
        "retryOn has ['5xx', 'reset']",
        "route fallback: no retries block",
        "last route has a match",
    ):
        assert expected in problems, f"route check missed: {expected}"


def test_deadline_budget_is_aligned(objects: list) -> None:
    (prediction,) = deployments(objects, "prediction")
    deadline_ms = int(dc.settings_of(prediction, objects)["PREDICTION_INFERENCE_TIMEOUT_MS"])
    # Above the inference p99 (else >1% of SLA-conforming calls time out), below the prediction
    # p95 with room for everything else a Predict does.
    assert dc.INFERENCE_P99_MS < deadline_ms < dc.PREDICTION_P95_MS
    # The mesh timeout is a backstop: never shorter than the caller's deadline, so the caller's
    # DEADLINE_EXCEEDED (not a mesh 504 surfacing as UNAVAILABLE) decides.
    for route in dc.by_name(objects, "VirtualService", "inference")["spec"]["http"]:
        assert dc.duration_ms(route["timeout"]) >= deadline_ms, route["name"]
        assert dc.duration_ms(route["timeout"]) < dc.PREDICTION_P95_MS
    for route in dc.by_name(objects, "VirtualService", "prediction")["spec"]["http"]:
        assert dc.duration_ms(route["timeout"]) >= dc.PREDICTION_P95_MS, route["name"]


def test_mtls_is_strict_for_the_whole_namespace(objects: list) -> None:
    (policy,) = dc.of_kind(objects, "PeerAuthentication")
    assert policy["spec"] == {"mtls": {"mode": "STRICT"}}  # no selector, no port exceptions


def test_namespace_injects_sidecars(objects: list) -> None:
    (namespace,) = dc.of_kind(objects, "Namespace")
    assert namespace["metadata"]["labels"]["istio-injection"] == "enabled"


def _policy(objects: list, name: str) -> dict:
    return dc.by_name(objects, "AuthorizationPolicy", name)


def test_authorization_denies_by_default(objects: list) -> None:
    assert _policy(objects, "allow-nothing")["spec"] == {}
    for policy in dc.of_kind(objects, "AuthorizationPolicy"):
        assert policy["spec"].get("action", "ALLOW") == "ALLOW"
        for rule in policy["spec"].get("rules", ()):
            for source in rule.get("from", ()):
                values = [v for field in source["source"].values() for v in field]
                assert "*" not in values, f"{dc.name_of(policy)} admits everyone"


@pytest.mark.parametrize("service", ["inference", "prediction"])
def test_each_service_admits_only_its_callers_on_its_port(objects: list, service: str) -> None:
    policy = _policy(objects, f"{service}-callers")
    targets = [
        d
        for d in deployments(objects)
        if dc.selector_matches(policy["spec"]["selector"], dc.pod_labels(d))
    ]
    assert targets == deployments(objects, service)
    port = str(dc.grpc_port(dc.pod_spec(targets[0])["containers"][0]))
    for rule in policy["spec"]["rules"]:
        for operation in rule["to"]:
            assert operation["operation"]["ports"] == [port]
            assert GRPC_PATHS[service] <= set(operation["operation"]["paths"])


def test_inference_callers_are_the_prediction_account_and_named_internal_callers(
    objects: list,
) -> None:
    (rule,) = _policy(objects, "inference-callers")["spec"]["rules"]
    principals = [p for source in rule["from"] for p in source["source"]["principals"]]
    assert f"{dc.TRUST_DOMAIN}/ns/{dc.NAMESPACE}/sa/prediction" in principals
    accounts = {sa["metadata"]["name"] for sa in dc.of_kind(objects, "ServiceAccount")}
    for principal in principals:
        match = PRINCIPAL.match(principal)
        assert match and match["domain"] == dc.TRUST_DOMAIN, principal
        if match["namespace"] == dc.NAMESPACE:
            # In-namespace callers must be accounts that exist, and never inference itself.
            assert match["account"] in accounts and match["account"] != "inference", principal


def test_network_policies_admit_the_same_callers_as_authorization(objects: list) -> None:
    def ingress_namespaces(policy: dict) -> set[str]:
        found = set()
        for rule in policy["spec"].get("ingress", ()):
            for peer in rule.get("from", ()):
                for expression in peer.get("namespaceSelector", {}).get("matchExpressions", ()):
                    if expression["key"] == "kubernetes.io/metadata.name":
                        found |= set(expression["values"])
        return found

    (inference_rule,) = _policy(objects, "inference-callers")["spec"]["rules"]
    principal_namespaces = {
        PRINCIPAL.match(p)["namespace"]
        for source in inference_rule["from"]
        for p in source["source"]["principals"]
    }
    inference_np = dc.by_name(objects, "NetworkPolicy", "inference")
    assert principal_namespaces - {dc.NAMESPACE} == ingress_namespaces(inference_np)
    (prediction,) = deployments(objects, "prediction")
    assert any(
        dc.selector_matches(peer.get("podSelector"), dc.pod_labels(prediction))
        for rule in inference_np["spec"]["ingress"]
        for peer in rule["from"]
        if "podSelector" in peer
    )
    (prediction_rule,) = _policy(objects, "prediction-callers")["spec"]["rules"]
    caller_namespaces = {
        n for source in prediction_rule["from"] for n in source["source"]["namespaces"]
    }
    assert caller_namespaces == ingress_namespaces(
        dc.by_name(objects, "NetworkPolicy", "prediction")
    )


def test_network_policies_deny_by_default_and_select_real_pods(objects: list) -> None:
    policies = dc.of_kind(objects, "NetworkPolicy")
    deny = dc.by_name(objects, "NetworkPolicy", "default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    for policy in policies:
        selected = [
            d
            for d in deployments(objects)
            if dc.selector_matches(policy["spec"]["podSelector"], dc.pod_labels(d))
        ]
        assert selected, f"{dc.name_of(policy)} selects no pods"
    # Service ports opened by the per-service policies are the pods' gRPC ports.
    for name in ("inference", "prediction"):
        policy = dc.by_name(objects, "NetworkPolicy", name)
        ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert ports == {dc.grpc_port(dc.pod_spec(deployments(objects, name)[0])["containers"][0])}
    # Prediction may reach inference's gRPC port.
    egress = dc.by_name(objects, "NetworkPolicy", "prediction")["spec"]["egress"]
    inference = deployments(objects, "inference")[0]
    assert any(
        dc.selector_matches(peer.get("podSelector"), dc.pod_labels(inference))
        and {"protocol": "TCP", "port": dc.grpc_port(dc.pod_spec(inference)["containers"][0])}
        in rule["ports"]
        for rule in egress
        for peer in rule.get("to", ())
    )


def test_inference_rate_limit_is_local_enforced_and_not_retried(objects: list) -> None:
    (envoy_filter,) = dc.of_kind(objects, "EnvoyFilter")
    selector = envoy_filter["spec"]["workloadSelector"]["labels"]
    assert [
        d for d in deployments(objects) if dc.selector_matches(selector, dc.pod_labels(d))
    ] == deployments(objects, "inference")
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["match"]["context"] == "SIDECAR_INBOUND"
    value = patch["patch"]["value"]
    assert value["name"] == "envoy.filters.http.local_ratelimit"
    config = value["typed_config"]
    assert (
        config["@type"]
        == "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
    )
    # RESOURCE_EXHAUSTED, not Envoy's default UNAVAILABLE, so the mesh never retries a refusal.
    assert config["rate_limited_as_resource_exhausted"] is True
    for switch in ("filter_enabled", "filter_enforced"):
        assert config[switch]["default_value"] == {"numerator": 100, "denominator": "HUNDRED"}
    bucket = config["token_bucket"]
    assert 0 < bucket["tokens_per_fill"] <= bucket["max_tokens"]
    assert dc.duration_ms(bucket["fill_interval"]) >= 50  # Envoy's minimum refill interval


def test_telemetry_exports_mesh_metrics(objects: list) -> None:
    (telemetry,) = dc.of_kind(objects, "Telemetry")
    assert {"name": "prometheus"} in telemetry["spec"]["metrics"][0]["providers"]
    assert 0 < telemetry["spec"]["tracing"][0]["randomSamplingPercentage"] <= 100


def test_no_template_placeholder_survives(objects: list) -> None:
    # ../inference-version mounts credit-risk/VERSION until a model-versions/vN folder fills it in.
    for workload in deployments(objects):
        assert "VERSION" not in repr(workload), dc.name_of(workload)
