"""What schemas cannot say: objects that must agree with each other, with the services' settings
and with the SLAs. Each test reads the rendered overlays (as applied), not the source files."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import deploy_checks as dc
import ledger_checks as lc
import pytest

# Exact health service names the probes ask for (grpc.health.v1, per service);
# test_deploy_services.py checks them against the names each server registers.
HEALTH_SERVICE = {
    "inference": "mlpair.inference.v1.InferenceService",
    "prediction": "mlpair.prediction.v1.PredictionService",
    dc.RELAY: "relay",
}
PREFIX = dc.PREFIX
# gRPC paths each AuthorizationPolicy must let through to its service.
GRPC_PATHS = {
    "inference": {"/mlpair.inference.v1.InferenceService/*", "/inference.GRPCInferenceService/*"},
    "prediction": {"/mlpair.prediction.v1.PredictionService/*"},
}
PRINCIPAL = re.compile(
    r"^(?P<domain>[^/*]+)/ns/(?P<namespace>[a-z0-9-]+)/sa/(?P<account>[a-z0-9-]+)$"
)
GPU = "nvidia.com/gpu"
CONFIG_FILES = ("feature-schema.toml", "policy.toml")


def app(workload: dict) -> str:
    return dc.app_of(workload)


def workloads(objects: list, name: str | None = None) -> list[dict]:
    return dc.workloads(objects, name)


def served_families() -> list[str]:
    """Model families with a serving configuration in config/ (training.toml is for training)."""
    return sorted(
        folder.name
        for folder in (dc.REPO_ROOT / "config").iterdir()
        if all((folder / name).exists() for name in CONFIG_FILES)
    )


@pytest.fixture(params=dc.OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict) -> list[dict]:
    """The rendered objects of one overlay (each test runs once per overlay)."""
    return rendered[request.param]


# --------------------------------------------------------------------------- placement and drain


def test_inference_runs_on_the_gpu_pool_with_one_gpu(objects: list) -> None:
    inference = workloads(objects, "inference")
    assert inference, "no inference workload rendered"
    for workload in inference:
        spec = dc.pod_spec(workload)
        assert spec["nodeSelector"] == {"mlpair.io/node-pool": "gpu"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        resources = spec["containers"][0]["resources"]
        # Extended resources cannot be overcommitted: request == limit == one whole GPU.
        assert resources["limits"][GPU] == resources["requests"][GPU] == "1"


def test_prediction_runs_on_the_cpu_pool_without_gpu(objects: list) -> None:
    prediction = workloads(objects, "prediction")
    assert prediction, "no prediction workload rendered"
    for workload in prediction:
        spec = dc.pod_spec(workload)
        assert spec["nodeSelector"] == {"mlpair.io/node-pool": "cpu"}
        assert not any(t.get("key") == GPU for t in spec.get("tolerations", ()))
        for container in dc.containers(workload):
            for section in ("requests", "limits"):
                assert GPU not in container["resources"].get(section, {})


def shutdown_budget_s(workload: dict, objects: list) -> float:
    """Seconds the app may take after SIGTERM: the drain of in-flight calls, and for
    PredictionService then the delivery of what it recorded in the ledger and not yet delivered
    (services/prediction/mlpair/prediction/server.py stops the relay after min(shutdown_grace_s,
    SHUTDOWN_DELIVERY_S))."""
    settings = dc.settings_of(workload, objects)
    drain_s = float(settings[f"{PREFIX[app(workload)]}_SHUTDOWN_GRACE_S"])
    if app(workload) != "prediction":  # the relay: its batches in flight within the grace
        return drain_s
    server = pytest.importorskip(
        "mlpair.prediction.server", reason="mlpair is not installed (pip install -e '.[dev]')"
    )
    return drain_s + min(drain_s, server.SHUTDOWN_DELIVERY_S)


def test_termination_grace_covers_prestop_drain_delivery_and_sidecar(objects: list) -> None:
    # Order on deletion: preStop sleep (endpoints converge) -> SIGTERM -> server drains for up to
    # *_SHUTDOWN_GRACE_S -> PredictionService's relay delivers its undelivered ledger rows -> app
    # exits -> native sidecar drains. SIGKILL must not come first: in-flight calls would fail, and
    # the rows being delivered would reach the CRM only when another replica's relay claims them.
    for workload in workloads(objects):
        where = dc.name_of(workload)
        budget_s = shutdown_budget_s(workload, objects)
        container = dc.pod_spec(workload)["containers"][0]
        # the relay has no Service, so no endpoint removal to sleep through
        pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace_s = dc.pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace_s >= pre_stop_s + budget_s + dc.SIDECAR_DRAIN_S, where
        # A stopping server reports NOT_SERVING; liveness must not kill it before it has finished.
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > budget_s, where


def test_ports_and_probes_agree_with_the_settings(objects: list) -> None:
    for workload in workloads(objects):
        settings = dc.settings_of(workload, objects)
        # `mlpair relay` serves health and metrics on ports of its own (PREDICTION_RELAY_*)
        prefix = PREFIX[app(workload)] + ("_RELAY" if app(workload) == dc.RELAY else "")
        container = dc.pod_spec(workload)["containers"][0]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports["grpc"] == int(settings[f"{prefix}_PORT"])
        assert ports["http-metrics"] == int(settings[f"{prefix}_METRICS_PORT"])
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == settings[f"{prefix}_METRICS_PORT"]
        assert container["readinessProbe"]["grpc"] == {
            "port": ports["grpc"],
            "service": HEALTH_SERVICE[app(workload)],
        }
        # Liveness asks the name that stays SERVING while the process lives, and so does
        # PredictionService's startup probe (test_deploy_production.py says which name each asks).
        assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"], "service": "liveness"}
        assert container["startupProbe"]["grpc"]["port"] == ports["grpc"]


def test_services_select_pods_on_their_grpc_port(objects: list) -> None:
    for service in dc.of_kind(objects, "Service"):
        selected = [
            d
            for d in workloads(objects)
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


def test_workload_selectors_match_their_own_pods(objects: list) -> None:
    for workload in workloads(objects):
        assert dc.selector_matches(workload["spec"]["selector"], dc.pod_labels(workload))


# --------------------------------------------------------------------------- scaling and disruption


def test_every_workload_has_one_autoscaler_and_leaves_replicas_to_it(objects: list) -> None:
    # The HPA scales the workload, or the Argo Rollout that runs its pods (prod's prediction
    # track): scaling the Deployment as well would fight the Rollout.
    autoscalers = dc.of_kind(objects, "HorizontalPodAutoscaler")
    for relay in workloads(objects, dc.RELAY):
        # Two relays whatever the load: delivery is bounded by the CRM database, not their CPU.
        assert relay["spec"]["replicas"] >= 2, dc.name_of(relay)
        with pytest.raises(LookupError, match="found 0"):
            dc.autoscaler_of(relay, objects)
    for workload in [w for w in workloads(objects) if app(w) != dc.RELAY]:
        spec = dc.autoscaler_of(workload, objects)["spec"]
        # With an HPA, spec.replicas in the manifest would reset the count on every apply.
        assert "replicas" not in workload["spec"], dc.name_of(workload)
        rollout = dc.rollout_of(workload, objects)
        assert rollout is None or "replicas" not in rollout["spec"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    assert len(autoscalers) == len(workloads(objects)) - len(workloads(objects, dc.RELAY))


def test_production_keeps_two_pods_of_everything(rendered: dict) -> None:
    # One pod per track would let a single node failure take a whole canary subset away.
    for hpa in dc.of_kind(rendered["prod"], "HorizontalPodAutoscaler"):
        assert hpa["spec"]["minReplicas"] >= 2, dc.name_of(hpa)


def test_autoscaling_signals(objects: list) -> None:
    for workload in workloads(objects, "prediction"):
        metrics = dc.autoscaler_of(workload, objects)["spec"]["metrics"]
        # The prediction container's CPU alone (the sidecar's is not in it).
        assert metrics == [
            {
                "type": "ContainerResource",
                "containerResource": {
                    "name": "cpu",
                    "container": "prediction",
                    "target": {"type": "Utilization", "averageUtilization": 60},
                },
            }
        ]
    for workload in workloads(objects, "inference"):
        metrics = dc.autoscaler_of(workload, objects)["spec"]["metrics"]
        names = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
        # Calls in flight and queue depth (rows), beside the inference container's CPU: one
        # Python event loop per process saturates first, not the GPU.
        assert names == {"inference_requests_in_flight", "inference_queue_depth_rows"}
        assert [m["containerResource"]["container"] for m in metrics
                if m["type"] == "ContainerResource"] == ["inference"]


def test_every_workload_has_a_budget_covering_only_its_pods(objects: list) -> None:
    budgets = dc.of_kind(objects, "PodDisruptionBudget")
    for workload in workloads(objects):
        own = [
            b
            for b in budgets
            if dc.selector_matches(b["spec"]["selector"], dc.pod_labels(workload))
        ]
        assert len(own) == 1, dc.name_of(workload)
        assert own[0]["spec"].get("maxUnavailable") == 1
        others = [d for d in workloads(objects) if d is not workload]
        assert not any(
            dc.selector_matches(own[0]["spec"]["selector"], dc.pod_labels(d)) for d in others
        )


# --------------------------------------------------------------------------- references and config


def test_references_resolve_inside_the_render(objects: list) -> None:
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    for workload in dc.pod_owners(objects):
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
            mounted = {mount["name"] for mount in container.get("volumeMounts", ())}
            declared = {v["name"] for v in spec.get("volumes", ())} | {
                t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", ())
            }
            assert mounted <= declared, dc.name_of(workload)
        for volume in spec.get("volumes", ()):
            for source in volume.get("projected", {}).get("sources", ()):
                assert ("ConfigMap", source["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                # The one shared claim is the model repository, which pods only read.
                assert (
                    "PersistentVolumeClaim",
                    volume["persistentVolumeClaim"]["claimName"],
                ) in names
                assert volume["persistentVolumeClaim"]["readOnly"] is True


SECRETS = {
    # setting: (Secret, key), provided by the platform (docs/deployment.md), never committed.
    **lc.SERVING_SECRETS,
    "PREDICTION_REDIS_URL": ("prediction-redis", "url"),
}


def test_no_manifest_holds_a_credential(rendered: dict) -> None:
    # Every overlay's render, and every YAML file under deploy/ (components, batch scoring,
    # observability): credentials are only ever named (secretKeyRef), never written.
    documents = [obj for objects in rendered.values() for obj in objects]
    for path in sorted(dc.DEPLOY_DIR.rglob("*.yaml")):
        documents += [d for d in dc.load_file(path) if isinstance(d, dict)]
    assert len(documents) > 100
    assert dc.credential_literals(documents) == []
    # The check sees a key written into an env value, a ConfigMap or a URL, and a Secret object.
    leaked = copy.deepcopy(rendered["prod"][:1]) + [
        {"kind": "Secret", "metadata": {"name": "mlpair-model-source"}, "stringData": {}},
        {"kind": "ConfigMap", "metadata": {"name": "s"}, "data": {"AWS_SECRET_ACCESS_KEY": "x"}},
        {"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"env": [
            {"name": "MLFLOW_TRACKING_PASSWORD", "value": "x"},
            {"name": "AWS_ENDPOINT_URL", "value": "https://AKIAABCDEFGHIJKLMNOP@minio"},
            {"name": "PREDICTION_REDIS_URL", "value": "redis://:hunter2@redis:6379/0"},
        ]}]}},
    ]
    assert sorted(dc.credential_literals(leaked)) == [
        "ConfigMap/s: ConfigMap key AWS_SECRET_ACCESS_KEY holds a credential",
        "Pod/p: MLFLOW_TRACKING_PASSWORD has a literal value",
        "Pod/p: a credential in 'https://AKIAABCDEFGHIJKLMNOP@minio'",
        "Pod/p: a credential in 'redis://:hunter2@redis:6379/0'",
        "Secret/mlpair-model-source: a Secret in the manifests",
    ]


def test_the_model_source_connection_comes_from_its_secret(objects: list) -> None:
    for workload in workloads(objects, "inference") + workloads(objects, "prediction"):
        env = {v["name"]: v for v in dc.pod_spec(workload)["containers"][0]["env"]}
        refs = {
            name: env[name]["valueFrom"]["secretKeyRef"] for name in dc.MODEL_SOURCE_ENV
        }
        assert {ref["name"] for ref in refs.values()} == {"mlpair-model-source"}
        assert [n for n, ref in refs.items() if ref.get("optional")] == ["AWS_REGION", "AWS_ENDPOINT_URL"]
    # The relay and the migration Job read no model: they get no bucket credentials.
    for owner in dc.workloads(objects, dc.RELAY) + dc.jobs(objects):
        assert "mlpair-model-source" not in lc.secret_refs(owner), dc.name_of(owner)


def test_urls_with_credentials_come_from_secrets_that_are_not_in_the_repository(
    objects: list,
) -> None:
    assert not dc.of_kind(objects, "Secret"), "secrets must not be committed"
    for workload in workloads(objects, "prediction"):
        env = {v["name"]: v for v in dc.pod_spec(workload)["containers"][0].get("env", ())}
        for setting, (secret, key) in SECRETS.items():
            assert env[setting] == {
                "name": setting,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }
    # Nor a plain copy of one in a ConfigMap.
    assert not any(
        setting in c.get("data", {})
        for c in dc.of_kind(objects, "ConfigMap")
        for setting in SECRETS
    )


def test_replicas_share_one_cache(objects: list) -> None:
    # An in-process cache per replica would miss on most repeats and serve each pod's own stale
    # entries; with more than one pod possible, the cache is the shared Redis.
    for workload in workloads(objects, "prediction"):
        hpa = dc.autoscaler_of(workload, objects)
        settings = dc.settings_of(workload, objects)
        if hpa["spec"]["maxReplicas"] > 1 or len(workloads(objects, "prediction")) > 1:
            assert settings["PREDICTION_CACHE_BACKEND"] == "redis", dc.name_of(workload)


def test_every_model_family_in_config_is_shipped_and_served(objects: list) -> None:
    families = served_families()
    assert {"credit-risk", "churn"} <= set(families)
    for workload in workloads(objects, "prediction"):
        settings = dc.settings_of(workload, objects)
        assert sorted(dc.json_setting(settings, "PREDICTION_MODELS", [])) == families
        assert settings["PREDICTION_MODEL_NAME"] in families
        container = dc.pod_spec(workload)["containers"][0]
        for family in families:
            # Mounted where the service reads it: $PREDICTION_CONFIG_DIR/<family>/<file>.
            mount_path = f"{settings['PREDICTION_CONFIG_DIR']}/{family}"
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
            assert mount.get("readOnly") is True
            (volume,) = [v for v in dc.pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
            keys = set()
            for source in volume["projected"]["sources"]:
                config_map = dc.by_name(objects, "ConfigMap", source["configMap"]["name"])
                keys |= set(config_map["data"])
                for name, text in config_map["data"].items():
                    # The content of config/<family>/, not another family's file.
                    assert text == (dc.REPO_ROOT / "config" / family / name).read_text()
            assert keys == set(CONFIG_FILES), (dc.name_of(workload), family)
    (inference,) = workloads(objects, "inference")
    served = dc.json_setting(dc.settings_of(inference, objects), "INFERENCE_MODELS", [])
    assert sorted(served) == families


@pytest.mark.parametrize("family", served_families())
@pytest.mark.parametrize("filename", CONFIG_FILES)
def test_configmap_copies_match_the_repository_config(
    rendered: dict, family: str, filename: str
) -> None:
    # kustomize can only read files below deploy/k8s/base, so the ConfigMaps are built from
    # copies; a stale copy would ship another schema or policy than the one the code was tested
    # with.
    source = dc.REPO_ROOT / "config" / family / filename
    copy_path = dc.K8S_DIR / "base" / "prediction" / "config" / family / filename
    fix = f"cp {source.relative_to(dc.REPO_ROOT)} {copy_path.relative_to(dc.REPO_ROOT)}"
    assert copy_path.exists(), f"config family {family} is not shipped: {fix}"
    assert copy_path.read_text() == source.read_text(), f"deploy copy is stale: {fix}"
    # Generated as prediction-<feature-schema|policy>-<family>-<content hash>.
    prefix = f"prediction-{filename.removesuffix('.toml')}-{family}-"
    for objects in rendered.values():
        in_render = [
            c["data"]
            for c in dc.of_kind(objects, "ConfigMap")
            if c["metadata"]["name"].startswith(prefix)
        ]
        assert in_render == [{filename: source.read_text()}]


def test_every_serving_config_file_is_shipped_and_nothing_else() -> None:
    # PredictionService reads the feature schema and the policy; training.toml is for training only.
    shipped_dir = dc.K8S_DIR / "base" / "prediction" / "config"
    assert sorted(p.name for p in shipped_dir.iterdir()) == served_families()
    for family in served_families():
        assert {p.name for p in (shipped_dir / family).glob("*")} == set(CONFIG_FILES)


def test_every_pod_reads_the_published_versions_through_its_own_cache(objects: list) -> None:
    assert dc.model_source_problems(objects) == []
    for workload in workloads(objects, "inference") + workloads(objects, "prediction"):
        prefix = dc.PREFIX[dc.app_of(workload)]
        settings = dc.settings_of(workload, objects)
        mount, volume = dc.mounts_by_path(workload)[settings[f"{prefix}_MODEL_CACHE_DIR"]]
        assert (mount.get("readOnly"), volume["emptyDir"]["sizeLimit"]) == (None, "6Gi")
        assert int(settings[f"{prefix}_MODEL_CACHE_MAX_BYTES"]) == 4 * 2**30
        assert settings[f"{prefix}_MODEL_SOURCE"].startswith("s3://mlpair-models/")
    # No claim and no version folder anywhere: the versions are the source's.
    assert not dc.of_kind(objects, "PersistentVolumeClaim")
    assert not (dc.K8S_DIR / "model-versions").exists()


def test_model_source_check_rejects_what_would_strand_a_version_or_leak_a_key(rendered: dict) -> None:
    objects = copy.deepcopy(rendered["prod"])
    inference = dc.by_name(objects, "Deployment", "inference")
    stable = dc.by_name(objects, "Deployment", "prediction-stable")
    # The cache's limit at the bound (a download past it evicts the pod), a literal key instead of
    # the Secret, another source for the prediction pods, a version named that cannot be one, and
    # a poll left off.
    next(v for v in dc.pod_spec(inference)["volumes"] if v["name"] == "model-cache")["emptyDir"][
        "sizeLimit"
    ] = "4Gi"
    env = dc.pod_spec(stable)["containers"][0]["env"]
    env[:] = [v for v in env if v["name"] != "AWS_SECRET_ACCESS_KEY"] + [
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}
    ]
    prediction_settings = dc.pod_spec(stable)["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    dc.by_name(objects, "ConfigMap", prediction_settings)["data"]["PREDICTION_MODEL_SOURCE"] = "s3://other/prod"
    next(v for v in env if v["name"] == "PREDICTION_ENSEMBLES")["value"] = json.dumps(
        {"credit-risk": ["latest"], "churn": ["1"]}
    )
    inference_settings = dc.pod_spec(inference)["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    dc.by_name(objects, "ConfigMap", inference_settings)["data"]["INFERENCE_MODEL_CONTROL"] = "none"
    problems = dc.model_source_problems(objects)
    assert problems == [
        (
            "Deployment/inference: the model cache's sizeLimit 4Gi is under INFERENCE_MODEL_CACHE_MAX_BYTES "
            f"({4 * 2**30}) plus room for one version in staging ({2**30})"
        ),
        (
            "Deployment/prediction-stable: AWS_SECRET_ACCESS_KEY is {'name': 'AWS_SECRET_ACCESS_KEY', 'value': 'x'}, "
            "not {'name': 'mlpair-model-source', 'key': 'AWS_SECRET_ACCESS_KEY'}"
        ),
        (
            "the services read different model sources: {'Deployment/inference': 's3://mlpair-models/prod', "
            "'Deployment/prediction-stable': 's3://other/prod'}"
        ),
        "INFERENCE_MODEL_CONTROL is not 'poll': a published version waits for a restart",
        "Deployment/prediction-stable: credit-risk version 'latest' is not a published version number",
    ]
    # The old shape: a claim holding the versions, the cache gone, no deciding version of churn.
    objects = copy.deepcopy(rendered["dev"])
    stable = dc.by_name(objects, "Deployment", "prediction-stable")
    spec = dc.pod_spec(stable)
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "model-cache"] + [
        {"name": "model-repository", "persistentVolumeClaim": {"claimName": "mlpair-model-repository"}}
    ]
    spec["containers"][0]["volumeMounts"] = [
        m for m in spec["containers"][0]["volumeMounts"] if m["name"] != "model-cache"
    ]
    env = spec["containers"][0]["env"]
    next(v for v in env if v["name"] == "PREDICTION_ENSEMBLES")["value"] = json.dumps({"credit-risk": ["1"]})
    assert dc.model_source_problems(objects) == [
        "Deployment/prediction-stable: mounts the claim mlpair-model-repository",
        "Deployment/prediction-stable: nothing is mounted at PREDICTION_MODEL_CACHE_DIR /var/cache/mlpair/models",
        "Deployment/prediction-stable: PREDICTION_ENSEMBLES names no deciding version of churn",
    ]


def test_images_are_release_references(objects: list) -> None:
    for workload in workloads(objects):
        image = dc.pod_spec(workload)["containers"][0]["image"]
        name = "prediction" if app(workload) == dc.RELAY else app(workload)  # the same image
        assert re.match(
            rf"^[a-z0-9.-]+(:[0-9]+)?/.+/{name}(:[\w.-]+|@sha256:[0-9a-f]{{64}})$", image
        ), image
        assert not image.endswith(":latest")


# --------------------------------------------------------------------------- Istio


def test_inference_is_one_pool_and_prediction_tracks_have_subsets(objects: list) -> None:
    # The version is named inside each Infer call and every inference pod serves the whole
    # release: an inference subset per version would send calls to pods without their version.
    (inference,) = workloads(objects, "inference")
    assert "subsets" not in dc.by_name(objects, "DestinationRule", "inference")["spec"]
    assert "mlpair.io/model-version" not in dc.pod_labels(inference)
    # Tracks of PredictionService: each has a subset selecting exactly its pods, and back. Under an
    # Argo Rollout the track's pods are two revisions: its stable and canary subsets both select
    # the track's pods (Argo adds each revision's rollouts-pod-template-hash to them).
    rule = dc.by_name(objects, "DestinationRule", "prediction")
    subsets = {subset["name"]: subset["labels"] for subset in rule["spec"].get("subsets", ())}
    tracks = {dc.pod_labels(w)["mlpair.io/track"]: w for w in workloads(objects, "prediction")}
    for workload in workloads(objects, "prediction"):
        rollout = dc.rollout_of(workload, objects)
        if rollout is not None:
            istio = rollout["spec"]["strategy"]["canary"]["trafficRouting"]["istio"]
            assert istio["destinationRule"]["name"] == "prediction"
            for role in ("stableSubsetName", "canarySubsetName"):
                tracks[istio["destinationRule"][role]] = workload
    if len(tracks) > 1:
        assert set(subsets) == set(tracks)
    assert set(subsets) <= set(tracks)
    for name, labels in subsets.items():
        selected = [d for d in workloads(objects) if dc.selector_matches(labels, dc.pod_labels(d))]
        assert selected == [tracks[name]], name


def test_routes_are_consistent(objects: list) -> None:
    assert dc.route_problems(objects) == []


def test_version_agnostic_istio_routes_are_consistent(rendered_istio: list, rendered: dict) -> None:
    # deploy/istio alone plus the Services it routes to.
    services = dc.of_kind(rendered["dev"], "Service")
    assert dc.route_problems(rendered_istio + services) == []


def test_route_checks_reject_the_broken_routing_fixture(rendered: dict, fixtures_dir: Path) -> None:
    (broken,) = dc.load_file(fixtures_dir / "broken" / "virtualservice-bad-routing.yaml")
    objects = [
        obj for obj in rendered["prod"] if dc.name_of(obj) != "VirtualService/prediction"
    ] + [broken]
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
    for prediction in workloads(objects, "prediction"):
        settings = dc.settings_of(prediction, objects)
        deadline_ms = int(settings["PREDICTION_INFERENCE_TIMEOUT_MS"])
        reserve_ms = int(settings["PREDICTION_CRM_RESERVE_MS"])
        # Above the inference p99 (else >1% of SLA-conforming calls time out), below the
        # prediction p95 together with the reserve kept back for recording the decision: a
        # Predict whose Infer call uses its whole allowance still records within the SLA.
        assert deadline_ms > dc.INFERENCE_P99_MS
        assert deadline_ms + reserve_ms < dc.PREDICTION_P95_MS
        assert reserve_ms > 0
        # The mesh timeout is a backstop: never shorter than the caller's deadline, so the
        # caller's DEADLINE_EXCEEDED (not a mesh 504 surfacing as UNAVAILABLE) decides.
        for route in dc.by_name(objects, "VirtualService", "inference")["spec"]["http"]:
            if route["name"] in ("inference-stream", "inference-validation"):
                continue  # not PredictionService's calls: test_streams_*, test_bulk_validation_*
            assert dc.duration_ms(route["timeout"]) >= deadline_ms, route["name"]
            assert dc.duration_ms(route["timeout"]) < dc.PREDICTION_P95_MS
        for route in dc.by_name(objects, "VirtualService", "prediction")["spec"]["http"]:
            assert dc.duration_ms(route["timeout"]) >= dc.PREDICTION_P95_MS, route["name"]
            assert dc.duration_ms(route["timeout"]) >= deadline_ms + reserve_ms


def test_bulk_validation_calls_are_not_cut_at_prediction_s_timeout(objects: list) -> None:
    # The internal validation caller sends up to max_request_rows rows a ModelInfer: the 250 ms
    # backstop meant for PredictionService's single rows would cut them (and count them against
    # the inference error SLO). Its own route, matched by its namespace only, comes first.
    routes = dc.by_name(objects, "VirtualService", "inference")["spec"]["http"]
    (validation,) = [r for r in routes if r["name"] == "inference-validation"]
    principals = [
        principal
        for rule in dc.by_name(objects, "AuthorizationPolicy", "inference-callers")["spec"]["rules"]
        for source in rule.get("from", ())
        for principal in source["source"].get("principals", ())
    ]
    validation_namespaces = {p.split("/ns/")[1].split("/")[0] for p in principals if p.endswith("/sa/model-validation")}
    assert validation["match"] == [{"sourceNamespace": ns} for ns in sorted(validation_namespaces)]
    assert "mlpair" not in validation_namespaces  # never PredictionService's calls
    assert dc.duration_ms(validation["timeout"]) >= 10_000
    assert validation["retries"]["retryOn"] == routes[-1]["retries"]["retryOn"]
    assert routes.index(validation) < len(routes) - 1 and not routes[-1].get("match")


def test_streams_are_not_cut_by_the_mesh(objects: list) -> None:
    # A route timeout bounds a whole HTTP/2 stream: ModelStreamInfer needs a route of its own with
    # a long one, ahead of the catch-all route whose 250 ms would end every stream.
    routes = dc.by_name(objects, "VirtualService", "inference")["spec"]["http"]
    (stream,) = [r for r in routes if r["name"] == "inference-stream"]
    assert stream["match"] == [{"uri": {"exact": "/inference.GRPCInferenceService/ModelStreamInfer"}}]
    assert dc.duration_ms(stream["timeout"]) >= 10 * 60_000  # streams live for minutes, not one deadline
    assert "perTryTimeout" not in stream["retries"]
    assert routes.index(stream) < len(routes) - 1 and not routes[-1].get("match")


# Envoy's grpcToHttpStatus (router.cc hands the outlier detector the HTTP code of a reply's
# grpc-status); outlier_detection_impl.cc counts 500-599 in consecutive_5xx, 502-504 also in
# consecutive_gateway_failure, and any code under 500 resets both.
GRPC_AS_HTTP = {"INTERNAL": 500, "UNKNOWN": 500, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
                "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429}


def ejected_after(detection: dict, answers: list[str]) -> bool:
    """Whether Envoy ejects a pod answering ``answers`` (gRPC code names, in order) under ``detection``
    (Istio's outlierDetection: a counter left out is Envoy's default, 5; 0 disables it)."""
    limits = {"5xx": detection.get("consecutive5xxErrors", 5), "gateway": detection.get("consecutiveGatewayErrors", 0)}
    counts = {"5xx": 0, "gateway": 0}
    for answer in answers:
        http = GRPC_AS_HTTP[answer]
        if http < 500:
            counts = dict.fromkeys(counts, 0)
            continue
        counts["5xx"] += 1
        counts["gateway"] = counts["gateway"] + 1 if http in (502, 503, 504) else 0
        if any(limits[k] and counts[k] >= limits[k] for k in counts):
            return True
    return False


def test_inference_ejects_pods_that_fail_every_call_never_for_a_callers_error_or_a_busy_queue(objects: list) -> None:
    # A model failing every batch answers INTERNAL MODEL_FAILURE, then UNAVAILABLE MODEL_UNHEALTHY:
    # the pod is ejected within a few calls. A caller's INVALID_ARGUMENT, a contract refusal and
    # load shedding never eject. A busy pod's DEADLINE_EXCEEDED comes after the caller's deadline,
    # when the stream is already reset (the comment in deploy/istio/destination-rules.yaml), and the
    # calls it answers in time reset the count.
    detection = dc.by_name(objects, "DestinationRule", "inference")["spec"]["trafficPolicy"]["outlierDetection"]
    assert detection["splitExternalLocalOriginErrors"] is True  # a sidecar timeout is never read as the pod's 504
    assert 1 <= detection["consecutiveLocalOriginFailures"] <= 10
    assert detection["consecutive5xxErrors"] == 5
    assert ejected_after(detection, ["INTERNAL"] * 5)
    assert ejected_after(detection, ["INTERNAL"] * 3 + ["UNAVAILABLE"] * 2)
    assert ejected_after(detection, ["UNAVAILABLE"] * 5)
    assert not ejected_after(detection, ["INTERNAL"] * 4)
    for refusal in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "RESOURCE_EXHAUSTED"):
        assert not ejected_after(detection, [refusal] * 100), refusal
        assert not ejected_after(detection, ["INTERNAL", "INTERNAL", refusal] * 10), refusal
    assert detection["maxEjectionPercent"] <= 50


def test_prediction_ejects_only_pods_that_stop_answering(objects: list) -> None:
    # PredictionService's answers say nothing of one pod: UNAVAILABLE comes from the shared ledger
    # being away on every pod at once, or a drain; DEADLINE_EXCEEDED from the caller's deadline.
    detection = dc.by_name(objects, "DestinationRule", "prediction")["spec"]["trafficPolicy"]["outlierDetection"]
    assert detection["splitExternalLocalOriginErrors"] is True
    assert 1 <= detection["consecutiveLocalOriginFailures"] <= 10
    # 0 disables; consecutive5xxErrors would count 5 when left out
    assert detection["consecutiveGatewayErrors"] == detection["consecutive5xxErrors"] == 0
    assert not ejected_after(detection, ["UNAVAILABLE"] * 100)
    assert detection["maxEjectionPercent"] <= 50


def test_prediction_leaves_balancing_over_inference_pods_to_the_mesh(objects: list) -> None:
    # The sidecar balances each call over the inference pods, ejects failing ones and retries on
    # another pod; PredictionService keeps one channel to the Service (pick_first). round_robin with
    # client-side health checking would judge the whole pool by the one pod behind each Watch.
    for prediction in workloads(objects, "prediction"):
        settings = dc.settings_of(prediction, objects)
        assert settings.get("PREDICTION_INFERENCE_LOAD_BALANCING", "pick_first") == "pick_first"
        assert settings["PREDICTION_INFERENCE_TARGET"] == "inference.mlpair.svc.cluster.local:8001"
    assert dc.by_name(objects, "Service", "inference")["spec"].get("clusterIP") != "None"


def test_retries_are_not_multiplied_across_layers(objects: list) -> None:
    # PredictionService retries UNAVAILABLE itself (inside its deadline budget); the mesh may add
    # at most one retry per attempt, so an outage costs inference at most 2 x its callers' load.
    for prediction in workloads(objects, "prediction"):
        attempts = int(dc.settings_of(prediction, objects)["PREDICTION_INFERENCE_MAX_ATTEMPTS"])
        for route in dc.by_name(objects, "VirtualService", "inference")["spec"]["http"]:
            mesh_tries = 1 + int(route["retries"]["attempts"])
            assert attempts * mesh_tries <= 4, route["name"]


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
        for d in workloads(objects)
        if dc.selector_matches(policy["spec"]["selector"], dc.pod_labels(d))
    ]
    assert targets == workloads(objects, service)
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
    # Every prediction track runs as the admitted account.
    for workload in workloads(objects, "prediction"):
        assert dc.pod_spec(workload)["serviceAccountName"] == "prediction"


def test_network_policies_admit_the_same_callers_as_authorization(objects: list) -> None:
    def ingress_namespaces(policy: dict) -> set[str]:
        found = set()
        for rule in policy["spec"].get("ingress", ()):
            for peer in rule.get("from", ()):
                for expression in peer.get("namespaceSelector", {}).get("matchExpressions", ()):
                    if expression["key"] == "kubernetes.io/metadata.name":
                        found |= set(expression["values"])
        return found

    def admitted_namespaces(*names: str) -> set[str]:
        # Namespaces of every caller the named AuthorizationPolicies admit (by principal or by
        # namespace), outside this one (in-namespace callers are admitted by pod selectors).
        found = set()
        for name in names:
            for rule in _policy(objects, name)["spec"]["rules"]:
                for source in (entry["source"] for entry in rule["from"]):
                    found |= {PRINCIPAL.match(p)["namespace"] for p in source.get("principals", ())}
                    found |= set(source.get("namespaces", ()))
        return found - {dc.NAMESPACE}

    inference_np = dc.by_name(objects, "NetworkPolicy", "inference")
    assert admitted_namespaces("inference-callers", "inference-operators") == ingress_namespaces(
        inference_np
    )
    for prediction in workloads(objects, "prediction"):
        assert any(
            dc.selector_matches(peer.get("podSelector"), dc.pod_labels(prediction))
            for rule in inference_np["spec"]["ingress"]
            for peer in rule["from"]
            if "podSelector" in peer
        )
    assert admitted_namespaces("prediction-callers", "prediction-operators") == ingress_namespaces(
        dc.by_name(objects, "NetworkPolicy", "prediction")
    )


def test_network_policies_deny_by_default_and_select_real_pods(objects: list) -> None:
    policies = dc.of_kind(objects, "NetworkPolicy")
    deny = dc.by_name(objects, "NetworkPolicy", "default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    for policy in policies:
        selected = [
            d
            for d in dc.pod_owners(objects)
            if dc.selector_matches(policy["spec"]["podSelector"], dc.pod_labels(d))
        ]
        assert selected, f"{dc.name_of(policy)} selects no pods"
    # Service ports opened by the per-service policies are the pods' gRPC ports.
    for name in ("inference", "prediction"):
        policy = dc.by_name(objects, "NetworkPolicy", name)
        ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert ports == {dc.grpc_port(dc.pod_spec(workloads(objects, name)[0])["containers"][0])}
    # Every prediction track may reach inference's gRPC port.
    egress = dc.by_name(objects, "NetworkPolicy", "prediction")["spec"]["egress"]
    inference = workloads(objects, "inference")[0]
    assert any(
        dc.selector_matches(peer.get("podSelector"), dc.pod_labels(inference))
        and {"protocol": "TCP", "port": dc.grpc_port(dc.pod_spec(inference)["containers"][0])}
        in rule["ports"]
        for rule in egress
        for peer in rule.get("to", ())
    )


def test_network_policies_let_each_pod_reach_what_its_settings_name(objects: list) -> None:
    # The ledger and CRM databases, the shared Redis and the trace collector: a URL in the settings
    # whose port the policies close would fail only at run time (the ledger: as a pod that never
    # turns ready).
    for workload in workloads(objects):
        settings = dc.settings_of(workload, objects)
        prefix = PREFIX[app(workload)]
        needed = {int(re.search(r":(\d+)$", settings[f"{prefix}_OTLP_ENDPOINT"])[1])}
        if app(workload) == "prediction":
            needed |= {5432, 6379}  # PostgreSQL (ledger, CRM) and Redis: URLs in Secrets
        if app(workload) != dc.RELAY and dc.model_source_of(workload, objects).startswith("s3://"):
            needed |= {443}  # the bucket, over HTTPS (its endpoint: the Secret's, or the cloud's)
        assert needed <= lc.egress_ports(objects, workload), dc.name_of(workload)
        if app(workload) == dc.RELAY:
            assert 443 not in lc.egress_ports(objects, workload)  # it reads no model: no bucket


def test_inference_rate_limit_is_local_enforced_and_not_retried(objects: list) -> None:
    (envoy_filter,) = dc.of_kind(objects, "EnvoyFilter")
    selector = envoy_filter["spec"]["workloadSelector"]["labels"]
    assert [
        d for d in workloads(objects) if dc.selector_matches(selector, dc.pod_labels(d))
    ] == workloads(objects, "inference")
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["match"]["context"] == "SIDECAR_INBOUND"
    # Right before the router: after authorization and stats (without a subFilter, INSERT_BEFORE
    # puts it first, where refused callers would spend the bucket and refusals go uncounted).
    connection_manager = patch["match"]["listener"]["filterChain"]["filter"]
    assert connection_manager["subFilter"] == {"name": "envoy.filters.http.router"}
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
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


def test_services_trace_and_log_for_production(objects: list) -> None:
    # JSON log lines (trace id, request id, layer) for the log pipeline; spans exported to the
    # collector; new traces sampled at the mesh's rate, so the services record neither far more
    # traces than the mesh (export volume) nor far fewer (traces without their app spans).
    (telemetry,) = dc.of_kind(objects, "Telemetry")
    mesh_ratio = telemetry["spec"]["tracing"][0]["randomSamplingPercentage"] / 100
    for workload in workloads(objects):
        settings = dc.settings_of(workload, objects)
        prefix = PREFIX[app(workload)]
        assert settings[f"{prefix}_LOG_FORMAT"] == "json", dc.name_of(workload)
        assert settings[f"{prefix}_TRACING"] == "true"
        assert re.fullmatch(r"https?://[a-z0-9.-]+:\d+", settings[f"{prefix}_OTLP_ENDPOINT"])
        assert float(settings[f"{prefix}_TRACE_SAMPLE_RATIO"]) == pytest.approx(mesh_ratio)


def test_no_template_placeholder_survives(objects: list) -> None:
    for workload in workloads(objects):
        assert "VERSION" not in repr(workload), dc.name_of(workload)
