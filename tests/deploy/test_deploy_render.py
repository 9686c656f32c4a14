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
    "PersistentVolumeClaim",
    "Service",
    "Deployment",
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
    assert REQUIRED_KINDS <= kinds, f"missing from {overlay}: {sorted(REQUIRED_KINDS - kinds)}"


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


def test_istio_folder_renders_on_its_own(rendered_istio: list) -> None:
    kinds = {obj["kind"] for obj in rendered_istio}
    assert kinds == {
        "PeerAuthentication",
        "AuthorizationPolicy",
        "DestinationRule",
        "VirtualService",
        "EnvoyFilter",
        "Telemetry",
    }
    assert all(obj["metadata"]["namespace"] == dc.NAMESPACE for obj in rendered_istio)


@pytest.mark.parametrize("version", ["1", "2"])
def test_model_version_folder_instantiates_the_template(kubectl: Path, version: str) -> None:
    objects = dc.render(kubectl, dc.K8S_DIR / "model-versions" / f"v{version}")
    assert sorted(dc.name_of(obj) for obj in objects) == [
        f"Deployment/inference-v{version}",
        f"HorizontalPodAutoscaler/inference-v{version}",
        f"PodDisruptionBudget/inference-v{version}",
    ]
    deployment = dc.by_name(objects, "Deployment", f"inference-v{version}")
    assert deployment["spec"]["selector"]["matchLabels"]["mlpair.io/model-version"] == version
    mount = dc.pod_spec(deployment)["containers"][0]["volumeMounts"][0]
    assert (mount["subPath"], mount["mountPath"]) == (
        f"credit-risk/{version}",
        f"/models/credit-risk/{version}",
    )


def test_broken_overlay_is_refused(kubectl: Path, fixtures_dir: Path) -> None:
    with pytest.raises(dc.RenderError) as excinfo:
        dc.render(kubectl, fixtures_dir / "broken" / "overlay-missing-resource")
    assert "does-not-exist.yaml" in str(excinfo.value)
