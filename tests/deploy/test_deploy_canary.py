"""Every step of docs/canary-runbook.md renders to a valid, consistent production state.

Each step is simulated the way an operator performs it: prod's kustomization.yaml (which model
versions are deployed) and canary.yaml (subsets, weights, mirror, pinned routes) are edited, in a
copy of the overlay under tmp_path whose resources point back at the real deploy/ tree. The
result goes through the same checks as the committed overlays.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import deploy_checks as dc
import pytest
import yaml

PROD = dc.K8S_DIR / "overlays" / "prod"
HOST = dc.fqdn("inference")


def _destination(version: str) -> dict:
    return {"host": HOST, "subset": f"v{version}", "port": {"number": 8001}}


def canary_state(
    weights: dict[str, int], mirror_to: str | None = None, mirror_percent: float = 10.0
) -> list[dict]:
    """canary.yaml for the given weights, written the way the runbook says: pinned routes for
    every deployed version, then the weighted route (and optionally a mirror)."""
    documents = dc.load_file(PROD / "canary.yaml")
    rule = next(d for d in documents if d["kind"] == "DestinationRule")
    service = next(d for d in documents if d["kind"] == "VirtualService")
    template = copy.deepcopy(service["spec"]["http"][-1])  # keeps timeout and retries
    rule["spec"]["subsets"] = [
        {"name": f"v{version}", "labels": {"mlpair.io/model-version": version}}
        for version in weights
    ]
    http = []
    for version in weights:
        pinned = copy.deepcopy(template)
        pinned.pop("mirrors", None)
        pinned["name"] = f"pinned-v{version}"
        pinned["match"] = [{"headers": {"x-mlpair-model-version": {"exact": version}}}]
        pinned["route"] = [{"destination": _destination(version)}]
        http.append(pinned)
    weighted = copy.deepcopy(template)
    weighted["name"] = "weighted"
    weighted["route"] = [{"destination": _destination(v), "weight": w} for v, w in weights.items()]
    weighted.pop("mirrors", None)
    if mirror_to:
        weighted["mirrors"] = [
            {"destination": _destination(mirror_to), "percentage": {"value": mirror_percent}}
        ]
    http.append(weighted)
    service["spec"]["http"] = http
    return [rule, service]


def overlay(tmp_path: Path, versions: list[str], canary: list[dict]) -> Path:
    """A copy of the prod overlay deploying `versions`, with `canary` as its canary.yaml."""
    target = tmp_path / "prod"
    target.mkdir()
    kustomization = yaml.safe_load((PROD / "kustomization.yaml").read_text())
    resources = []
    for resource in kustomization["resources"]:
        absolute = (PROD / resource).resolve()
        if absolute.parent.name == "model-versions":
            continue
        resources.append(os.path.relpath(absolute, target))  # kustomize refuses absolute paths
    resources += [
        os.path.relpath(dc.K8S_DIR / "model-versions" / f"v{v}", target) for v in versions
    ]
    kustomization["resources"] = resources
    for patch in kustomization["patches"]:
        if patch["path"] != "canary.yaml":
            shutil.copy(PROD / patch["path"], target / patch["path"])
    (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    (target / "canary.yaml").write_text(yaml.safe_dump_all(canary, sort_keys=False))
    return target


def optional_istio_schemas(request: pytest.FixtureRequest) -> dc.IstioSchemas | None:
    """Istio's CRD schemas when ../shared is there; the other checks run either way."""
    try:
        return request.getfixturevalue("istio_schemas")
    except pytest.skip.Exception:
        return None


def problems_of(objects: list[dict], istio_schemas: dc.IstioSchemas | None) -> list[str]:
    """Everything the committed overlays are held to, in one list."""
    problems = dc.route_problems(objects)
    for obj in objects:
        if dc.is_istio(obj):
            if istio_schemas is not None:
                problems += istio_schemas.errors(obj)
        else:
            problems += dc.kubernetes_schema_errors(obj, dc.KUBERNETES_VERSIONS[-1])
        if obj["kind"] == "Deployment":
            problems += dc.lint_workload(obj)
    # Each subset selects exactly one deployed version, and each deployed version has a subset.
    rule = dc.by_name(objects, "DestinationRule", "inference")
    inference = [
        d
        for d in dc.of_kind(objects, "Deployment")
        if d["metadata"]["name"].startswith("inference-")
    ]
    deployed = {dc.pod_labels(d)["mlpair.io/model-version"] for d in inference}
    subset_versions = {s["labels"]["mlpair.io/model-version"] for s in rule["spec"]["subsets"]}
    if deployed != subset_versions:
        problems.append(
            f"deployed versions {sorted(deployed)} != subsets {sorted(subset_versions)}"
        )
    return problems


# Steps of the runbook: (deployed versions, weights, mirror target).
STEPS = {
    "tier-0-shadow": (["1", "2"], {"1": 100, "2": 0}, "2"),
    "tier-1": (["1", "2"], {"1": 99, "2": 1}, None),
    "tier-2": (["1", "2"], {"1": 70, "2": 30}, None),
    "tier-3": (["1", "2"], {"1": 0, "2": 100}, None),
    "finish": (["2"], {"2": 100}, None),
    "abort": (["1", "2"], {"1": 100, "2": 0}, None),
}


@pytest.mark.parametrize("step", STEPS)
def test_runbook_step_renders_a_valid_state(
    step: str,
    tmp_path: Path,
    kubectl: Path,
    kubernetes_validate_installed: None,
    request: pytest.FixtureRequest,
) -> None:
    versions, weights, mirror_to = STEPS[step]
    objects = dc.render(kubectl, overlay(tmp_path, versions, canary_state(weights, mirror_to)))
    assert problems_of(objects, optional_istio_schemas(request)) == []
    weighted = dc.by_name(objects, "VirtualService", "inference")["spec"]["http"][-1]
    assert {d["destination"]["subset"]: d["weight"] for d in weighted["route"]} == {
        f"v{v}": w for v, w in weights.items()
    }


def test_committed_prod_state_is_tier_0(rendered: dict) -> None:
    # The runbook starts from what canary.yaml holds now; keep the two in step.
    weighted = dc.by_name(rendered["prod"], "VirtualService", "inference")["spec"]["http"][-1]
    assert {d["destination"]["subset"]: d["weight"] for d in weighted["route"]} == {
        "v1": 100,
        "v2": 0,
    }
    assert [m["destination"]["subset"] for m in weighted["mirrors"]] == ["v2"]


def test_a_mistyped_step_is_caught(
    tmp_path: Path,
    kubectl: Path,
    kubernetes_validate_installed: None,
    request: pytest.FixtureRequest,
) -> None:
    # Weights not adding up, and a subset left in canary.yaml for a version removed from the
    # kustomization: both are refused before they reach a cluster.
    objects = dc.render(kubectl, overlay(tmp_path, ["2"], canary_state({"1": 90, "2": 5})))
    problems = "\n".join(problems_of(objects, optional_istio_schemas(request)))
    assert "do not add up to 100" in problems
    assert "deployed versions ['2'] != subsets ['1', '2']" in problems
