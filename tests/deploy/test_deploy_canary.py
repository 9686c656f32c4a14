"""Every step of docs/canary-runbook.md renders to a valid, consistent production state.

Each step is simulated the way an operator performs it: the four files of the prod overlay that the
runbook edits are rewritten for the step, in a copy of the overlay under tmp_path whose resources
point back at the real deploy/ tree:

* kustomization.yaml: which model versions are mounted (components: the release) and whether
  the canary track runs (resources);
* track-stable.yaml, track-canary.yaml: the version that decides for each family on each track,
  and the shadow;
* canary.yaml: the Istio subsets of the tracks and the traffic weights between them.

The result goes through the same checks as the committed overlays.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import deploy_checks as dc
import ledger_checks as lc
import pytest
import yaml

PROD = dc.K8S_DIR / "overlays" / "prod"
HOST = dc.fqdn("prediction")
TRACK_FILES = {"stable": "track-stable.yaml", "canary": "track-canary.yaml"}


@dataclass(frozen=True)
class State:
    """What the runbook's files say at one step (credit-risk version 2 replacing version 1)."""

    release: tuple[str, ...]  # model-version components, "<family>/<N>"
    weights: dict[str, int]  # track -> percent of live traffic; the tracks that run
    deciding: dict[str, dict[str, str]]  # track -> family -> the version that decides
    shadows: dict[str, str] = field(default_factory=dict)  # stable track: family -> shadow version


TIER_0 = State(
    release=("credit-risk/1", "churn/1", "credit-risk/2"),
    weights={"stable": 100, "canary": 0},
    deciding={
        "stable": {"credit-risk": "1", "churn": "1"},
        "canary": {"credit-risk": "2", "churn": "1"},
    },
    shadows={"credit-risk": "2"},
)
PROMOTED = {"stable": {"credit-risk": "2", "churn": "1"}, "canary": TIER_0.deciding["canary"]}
STEPS = {
    "tier-0-shadow": TIER_0,
    "tier-1": replace(TIER_0, weights={"stable": 99, "canary": 1}),
    "tier-2": replace(TIER_0, weights={"stable": 70, "canary": 30}),
    "tier-3": replace(TIER_0, weights={"stable": 0, "canary": 100}),
    # Finish: the stable track adopts version 2 while it has no traffic, takes the traffic back,
    # then version 1 and the canary track retire.
    "finish-1-promote": replace(
        TIER_0, weights={"stable": 0, "canary": 100}, deciding=PROMOTED, shadows={}
    ),
    "finish-2-return": replace(TIER_0, deciding=PROMOTED, shadows={}),
    "finish-3-retire": State(
        release=("churn/1", "credit-risk/2"),
        weights={"stable": 100},
        deciding={"stable": PROMOTED["stable"]},
    ),
    # Abort: all traffic back to the stable track at once, then version 2 retires.
    "abort": TIER_0,
    "abort-retire": State(
        release=("credit-risk/1", "churn/1"),
        weights={"stable": 100},
        deciding={"stable": TIER_0.deciding["stable"]},
    ),
}


def _destination(track: str) -> dict:
    return {"host": HOST, "subset": track, "port": {"number": 9001}}


def canary_state(weights: dict[str, int]) -> list[dict]:
    """canary.yaml for the given weights, written the way the runbook says: a subset and a pinned
    route for every running track, then the weighted route."""
    rule, service = dc.load_file(PROD / "canary.yaml")
    template = copy.deepcopy(service["spec"]["http"][-1])  # keeps timeout and retries
    rule["spec"]["subsets"] = [
        {"name": track, "labels": {"mlpair.io/track": track}} for track in weights
    ]
    http = []
    for track in weights:
        pinned = copy.deepcopy(template)
        pinned["name"] = f"pinned-{track}"
        pinned["match"] = [{"headers": {"x-mlpair-track": {"exact": track}}}]
        pinned["route"] = [{"destination": _destination(track)}]
        http.append(pinned)
    weighted = copy.deepcopy(template)
    weighted["name"] = "weighted"
    weighted["route"] = [{"destination": _destination(t), "weight": w} for t, w in weights.items()]
    http.append(weighted)
    service["spec"]["http"] = http
    return [rule, service]


def track_state(track: str, deciding: dict[str, str], shadows: dict[str, str]) -> dict:
    """track-<track>.yaml: the deciding version of every family (and the shadows)."""
    (patch,) = dc.load_file(PROD / TRACK_FILES[track])
    env = [
        {
            "name": "PREDICTION_ENSEMBLES",
            "value": json.dumps({family: [version] for family, version in deciding.items()}),
        }
    ]
    if shadows:
        env.append({"name": "PREDICTION_SHADOWS", "value": json.dumps(shadows)})
    patch["spec"]["template"]["spec"]["containers"][0]["env"] = env
    return patch


def overlay(tmp_path: Path, state: State, canary: list[dict] | None = None) -> Path:
    """A copy of the prod overlay in `state` (canary.yaml from `canary` when given)."""
    target = tmp_path / "prod"
    target.mkdir()
    kustomization = yaml.safe_load((PROD / "kustomization.yaml").read_text())

    def relative(path: Path) -> str:
        return os.path.relpath(path, target)  # kustomize refuses absolute paths

    resources = [
        relative((PROD / r).resolve())
        for r in kustomization["resources"]
        if (PROD / r).resolve() != dc.K8S_DIR / "tracks" / "canary"
    ]
    if "canary" in state.weights:
        resources.append(relative(dc.K8S_DIR / "tracks" / "canary"))
    kustomization["resources"] = resources
    kustomization["components"] = [
        relative(dc.K8S_DIR / "model-versions" / version) for version in state.release
    ]
    patches = []
    for patch in kustomization["patches"]:
        name = patch.get("path")
        if name == TRACK_FILES["canary"] and "canary" not in state.weights:
            continue
        if name is not None and name not in TRACK_FILES.values() and name != "canary.yaml":
            shutil.copy(PROD / name, target / name)
        patches.append(patch)
    kustomization["patches"] = patches
    (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    for track in state.weights:
        shadows = state.shadows if track == "stable" else {}
        (target / TRACK_FILES[track]).write_text(
            yaml.safe_dump(track_state(track, state.deciding[track], shadows), sort_keys=False)
        )
    canary = canary if canary is not None else canary_state(state.weights)
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
    problems = dc.route_problems(objects) + dc.release_problems(objects)
    for obj in objects:
        if dc.is_istio(obj):
            if istio_schemas is not None:
                problems += istio_schemas.errors(obj)
        else:
            problems += dc.kubernetes_schema_errors(obj, dc.KUBERNETES_VERSIONS[-1])
        if obj["kind"] in dc.WORKLOAD_KINDS:
            problems += dc.lint_workload(obj)
            if dc.app_of(obj) == "prediction":
                problems += lc.ledger_problems(obj, objects) + lc.rollout_problems(obj, objects)
    problems += lc.migrate_job_problems(objects) + lc.migrate_order_problems(objects)
    # Each subset selects exactly one running track, and each running track has a subset.
    rule = dc.by_name(objects, "DestinationRule", "prediction")
    tracks = {dc.pod_labels(w)["mlpair.io/track"] for w in dc.workloads(objects, "prediction")}
    for subset in rule["spec"].get("subsets", ()):
        selected = [
            w
            for w in dc.workloads(objects)
            if dc.selector_matches(subset["labels"], dc.pod_labels(w))
        ]
        if len(selected) != 1:
            problems.append(f"subset {subset['name']} selects {len(selected)} workloads")
    subset_tracks = {s["labels"]["mlpair.io/track"] for s in rule["spec"].get("subsets", ())}
    if tracks != subset_tracks:
        problems.append(f"running tracks {sorted(tracks)} != subsets {sorted(subset_tracks)}")
    return problems


def deciding_versions(objects: list[dict]) -> dict[str, dict[str, list[str]]]:
    return {
        dc.pod_labels(w)["mlpair.io/track"]: dc.json_setting(
            dc.settings_of(w, objects), "PREDICTION_ENSEMBLES", {}
        )
        for w in dc.workloads(objects, "prediction")
    }


@pytest.mark.parametrize("step", STEPS)
def test_runbook_step_renders_a_valid_state(
    step: str,
    tmp_path: Path,
    kubectl: Path,
    kubernetes_validate_installed: None,
    request: pytest.FixtureRequest,
) -> None:
    state = STEPS[step]
    objects = dc.render(kubectl, overlay(tmp_path, state))
    assert problems_of(objects, optional_istio_schemas(request)) == []
    weighted = dc.by_name(objects, "VirtualService", "prediction")["spec"]["http"][-1]
    assert {d["destination"]["subset"]: d["weight"] for d in weighted["route"]} == state.weights
    assert deciding_versions(objects) == {
        track: {family: [version] for family, version in deciding.items()}
        for track, deciding in state.deciding.items()
    }


def test_committed_prod_state_is_tier_0(rendered: dict, kubectl: Path, tmp_path: Path) -> None:
    # The runbook starts from what the prod overlay holds now: the committed files and the
    # runbook's tier 0, written from scratch, render to the same objects.
    simulated = dc.render(kubectl, overlay(tmp_path, STEPS["tier-0-shadow"]))
    key = dc.name_of
    assert sorted(rendered["prod"], key=key) == sorted(simulated, key=key)


def test_mistyped_steps_are_caught(
    tmp_path: Path,
    kubectl: Path,
    kubernetes_validate_installed: None,
    request: pytest.FixtureRequest,
) -> None:
    # Weights not adding up, a subset left for a track removed from the kustomization, and a
    # track deciding with a version the release does not mount: all refused before a cluster.
    retired = STEPS["finish-3-retire"]
    state = replace(retired, deciding={"stable": {"credit-risk": "1", "churn": "1"}})
    canary = canary_state({"stable": 90, "canary": 5})
    objects = dc.render(kubectl, overlay(tmp_path, state, canary))
    problems = "\n".join(problems_of(objects, optional_istio_schemas(request)))
    assert "do not add up to 100" in problems
    assert "running tracks ['stable'] != subsets ['canary', 'stable']" in problems
    assert "subset canary selects 0 workloads" in problems
    assert "credit-risk version 1 decides but is not mounted" in problems
