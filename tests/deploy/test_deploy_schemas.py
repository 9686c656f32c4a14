"""Every rendered object validates: Kubernetes kinds against the official OpenAPI schemas (strict),
Istio kinds against Istio's CRD schemas with unknown fields forbidden and CEL rules evaluated."""

from __future__ import annotations

from pathlib import Path

import deploy_checks as dc
import pytest


@pytest.mark.parametrize("version", dc.KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_kubernetes_objects_match_the_official_schemas(
    rendered: dict, kubernetes_validate_installed: None, overlay: str, version: str
) -> None:
    objects = [obj for obj in rendered[overlay] if not dc.is_istio(obj) and not dc.is_argo(obj)]
    assert len(objects) >= 20, "the render lost most of its Kubernetes objects"
    problems = [problem for obj in objects for problem in dc.kubernetes_schema_errors(obj, version)]
    assert problems == []


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_istio_objects_match_istio_crd_schemas(
    rendered: dict, istio_schemas: dc.IstioSchemas, overlay: str
) -> None:
    objects = [obj for obj in rendered[overlay] if dc.is_istio(obj)]
    assert {obj["kind"] for obj in objects} >= {
        "VirtualService",
        "DestinationRule",
        "AuthorizationPolicy",
    }
    problems = [problem for obj in objects for problem in istio_schemas.errors(obj)]
    assert problems == []


def test_istio_folder_matches_istio_crd_schemas(
    rendered_istio: list, istio_schemas: dc.IstioSchemas
) -> None:
    problems = [problem for obj in rendered_istio for problem in istio_schemas.errors(obj)]
    assert problems == []


def test_istio_objects_use_v1_apis_where_istio_has_them(
    rendered: dict, istio_schemas: dc.IstioSchemas
) -> None:
    # v1 where Istio offers it (v1beta1/v1alpha3 are kept for compatibility only); EnvoyFilter
    # has no v1 yet.
    for obj in (obj for objects in rendered.values() for obj in objects if dc.is_istio(obj)):
        expected = "v1alpha3" if obj["kind"] == "EnvoyFilter" else "v1"
        assert obj["apiVersion"].endswith("/" + expected), dc.name_of(obj)
        assert (obj["apiVersion"], obj["kind"]) in istio_schemas.kinds()


@pytest.mark.parametrize(
    ("repair", "defect"),
    [
        # Each defect of the fixture is rejected on its own (the validator reports the first).
        ({"terminationGracePeriodSeconds": 30}, "'imagePulPolicy' was unexpected"),
        ({"imagePullPolicy": "IfNotPresent"}, "'30' is not of type 'integer'"),
    ],
)
def test_kubernetes_schema_rejects_the_broken_deployment(
    kubernetes_validate_installed: None, fixtures_dir: Path, repair: dict, defect: str
) -> None:
    (deployment,) = dc.load_file(fixtures_dir / "broken" / "deployment-typo.yaml")
    pod = deployment["spec"]["template"]["spec"]
    if "imagePullPolicy" in repair:
        pod["containers"][0]["imagePullPolicy"] = pod["containers"][0].pop("imagePulPolicy")
    else:
        pod.update(repair)
    for version in dc.KUBERNETES_VERSIONS:
        (problem,) = dc.kubernetes_schema_errors(deployment, version)
        assert defect in problem


def test_istio_schema_rejects_unknown_fields_and_wrong_types(
    istio_schemas: dc.IstioSchemas, fixtures_dir: Path
) -> None:
    (virtual_service,) = dc.load_file(fixtures_dir / "broken" / "virtualservice-unknown-field.yaml")
    problems = "\n".join(istio_schemas.errors(virtual_service))
    assert "'retry' was unexpected" in problems
    assert "spec/http/0/timeout: 250 is not of type 'string'" in problems
    assert "spec/http/0/route/0/weight: '100' is not of type 'integer'" in problems


def test_istio_cel_rules_reject_bad_durations(
    istio_schemas: dc.IstioSchemas, fixtures_dir: Path
) -> None:
    (destination_rule,) = dc.load_file(
        fixtures_dir / "broken" / "destinationrule-bad-durations.yaml"
    )
    problems = istio_schemas.errors(destination_rule)
    assert any("outlierDetection/interval" in problem for problem in problems), problems
    assert any("outlierDetection/baseEjectionTime" in problem for problem in problems), problems
    assert len(problems) == 2


def test_istio_schema_rejects_a_kind_it_does_not_serve(istio_schemas: dc.IstioSchemas) -> None:
    obj = {
        "apiVersion": "networking.istio.io/v2",
        "kind": "VirtualService",
        "metadata": {"name": "x"},
        "spec": {},
    }
    (problem,) = istio_schemas.errors(obj)
    assert "no Istio CRD" in problem
