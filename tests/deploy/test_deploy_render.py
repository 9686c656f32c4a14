"""Every overlay renders with kustomize, to the objects a platform team needs; broken ones don't."""

from __future__ import annotations

from pathlib import Path

import deploy_checks as dc
import pytest

# What `kubectl apply -k` must create for the two SLAs to operate (issue 7, "Deliver").
REQUIRED_KINDS = {
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "Service",
    "Deployment",
    "Job",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "PeerAuthentication",
    "AuthorizationPolicy",
    "DestinationRule",
    "VirtualService",
    "EnvoyFilter",
    "Telemetry",
}


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_overlay_renders_every_required_kind(rendered: dict, overlay: str) -> None:
    kinds = {obj["kind"] for obj in rendered[overlay]}
    assert kinds >= REQUIRED_KINDS, f"missing from {overlay}: {sorted(REQUIRED_KINDS - kinds)}"


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_object_names_are_unique(rendered: dict, overlay: str) -> None:
    # Two objects of one kind and name would make `kubectl apply` keep only the last one.
    names = [
        (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        for obj in rendered[overlay]
    ]
    duplicates = {name for name in names if names.count(name) > 1}
    assert not duplicates


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_everything_lands_in_the_mlpair_namespace(rendered: dict, overlay: str) -> None:
    # AuthorizationPolicy principals spell the namespace out (cluster.local/ns/mlpair/...), so
    # the objects must live exactly there.
    namespaces = {
        obj["metadata"].get("namespace") for obj in rendered[overlay] if obj["kind"] != "Namespace"
    }
    assert namespaces == {dc.NAMESPACE}
    (namespace,) = dc.of_kind(rendered[overlay], "Namespace")
    assert namespace["metadata"]["name"] == dc.NAMESPACE


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_everything_carries_the_ownership_label(rendered: dict, overlay: str) -> None:
    # `kubectl get all -l app.kubernetes.io/part-of=mlpair` must list every object and pod (a
    # track added outside the base and the migration Job's pods included).
    for obj in rendered[overlay]:
        labelled = [obj["metadata"]]
        if obj["kind"] in (*dc.WORKLOAD_KINDS, "Job"):
            labelled.append(obj["spec"]["template"]["metadata"])
        for metadata in labelled:
            assert metadata.get("labels", {}).get("app.kubernetes.io/part-of") == "mlpair", (
                dc.name_of(obj)
            )


def test_istio_folder_renders_on_its_own(rendered_istio: list) -> None:
    kinds = {obj["kind"] for obj in rendered_istio}
    assert kinds == {
        "PeerAuthentication",
        "AuthorizationPolicy",
        "DestinationRule",
        "Sidecar",
        "VirtualService",
        "EnvoyFilter",
        "Telemetry",
    }
    assert all(obj["metadata"]["namespace"] == dc.NAMESPACE for obj in rendered_istio)


@pytest.mark.parametrize("track", ["stable", "canary"])
def test_track_folder_instantiates_the_template(kubectl: Path, track: str) -> None:
    objects = dc.render(kubectl, dc.K8S_DIR / "tracks" / track)
    assert sorted(dc.name_of(obj) for obj in objects) == [
        f"Deployment/prediction-{track}",
        f"HorizontalPodAutoscaler/prediction-{track}",
        f"PodDisruptionBudget/prediction-{track}",
    ]
    workload = dc.by_name(objects, "Deployment", f"prediction-{track}")
    assert workload["spec"]["selector"]["matchLabels"]["mlpair.io/track"] == track
    assert dc.pod_labels(workload)["service.istio.io/canonical-revision"] == track
    budget = dc.by_name(objects, "PodDisruptionBudget", f"prediction-{track}")
    assert budget["spec"]["selector"]["matchLabels"]["mlpair.io/track"] == track
    hpa = dc.by_name(objects, "HorizontalPodAutoscaler", f"prediction-{track}")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"prediction-{track}"


def test_broken_overlay_is_refused(kubectl: Path, fixtures_dir: Path) -> None:
    with pytest.raises(dc.RenderError) as excinfo:
        dc.render(kubectl, fixtures_dir / "broken" / "overlay-missing-resource")
    assert "does-not-exist.yaml" in str(excinfo.value)
