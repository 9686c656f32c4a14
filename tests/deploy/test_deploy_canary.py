"""Progressive delivery of PredictionService: the Argo Rollout and its analysis, and every step of
docs/canary-runbook.md rendered to a valid production state.

The Rollout (deploy/k8s/progressive-delivery) runs the prediction-stable Deployment's template and
canaries every change of it 1% -> 30% -> 100% over Istio, judged by the AnalysisTemplate on the
project's own metrics (tests/observability/test_live_prometheus.py runs those queries against a
live Prometheus). A runbook step is simulated the way an operator performs it: the one file of
the prod overlay it edits (track-stable.yaml: the version that decides and the shadow; the
versions themselves are published to the overlay's model source, not listed in a manifest) is
rewritten in a copy of the overlay under tmp_path whose resources point back at the real deploy/
tree, and the result goes through the checks the committed overlays are held to.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import deploy_checks as dc
import ledger_checks as lc
import pytest
import yaml

from tests.observability import canary_analysis as ca

PROD = dc.K8S_DIR / "overlays" / "prod"
ARGO_CRD_DIR = dc.SHARED_DIR / "schemas" / "argo-rollouts"
# What the analysis judges (the list): errors, latency, fallbacks, decision disagreement
# and logit difference against the stable version (the shadow metrics), drift; and that there is
# something to judge: the canary is scraped and called.
ANALYSIS_METRICS = {"canary-scraped", "canary-traffic", "error-ratio", "latency-p99", "fallback-ratio",
                    "decision-disagreement", "logit-difference-p99", "score-drift"}
# The comparison with the stable version: no comparison at all (a revision that shadows nothing) is
# Inconclusive, a person decides; every other metric fails without data.
COMPARISON_METRICS = {"decision-disagreement", "logit-difference-p99"}
# Kinds whose metrics decide a promotion. Argo Rollouts' are checked; Flagger's (Canary,
# MetricTemplate) judge no-data by other rules and would need a check of their own.
ARGO_ANALYSIS_KINDS = {"AnalysisTemplate", "ClusterAnalysisTemplate"}
FLAGGER_ANALYSIS_KINDS = {"Canary", "MetricTemplate"}


@dataclass(frozen=True)
class State:
    """What the runbook's files say at one step (credit-risk version 2 replacing version 1)."""

    deciding: dict[str, str]  # family -> the version that decides
    shadows: dict[str, str] = field(default_factory=dict)  # family -> shadow version


STEPS = {
    # Committed: version 2 published and shadowed on live traffic, version 1 decides.
    "shadow": State({"credit-risk": "1", "churn": "1"}, {"credit-risk": "2"}),
    # The canary: the template decides with 2 and compares with 1 (the analysis's shadow metrics).
    "canary": State({"credit-risk": "2", "churn": "1"}, {"credit-risk": "1"}),
    # Promoted: the comparison with version 1 ends, itself a rollout; version 1 stays published,
    # the version to go back to.
    "retire-after-promotion": State({"credit-risk": "2", "churn": "1"}),
    # Aborted: version 1 decided throughout; the shadow of version 2 ends.
    "retire-after-abort": State({"credit-risk": "1", "churn": "1"}),
}


@pytest.fixture(scope="session")
def argo_schemas() -> dc.CrdSchemas:
    """Validators from Argo Rollouts' CRD files in ../shared (data only, never copied here)."""
    files = sorted(ARGO_CRD_DIR.glob("*-crd.yaml"))
    if not files:
        pytest.skip(f"Argo Rollouts CRD schemas not found in {ARGO_CRD_DIR}; the Rollout schema checks need them")
    return dc.CrdSchemas(files, "Argo Rollouts")


def track_state(state: State) -> dict:
    """track-stable.yaml for a state."""
    (patch,) = dc.load_file(PROD / "track-stable.yaml")
    env = [{"name": "PREDICTION_ENSEMBLES",
            "value": json.dumps({family: [version] for family, version in state.deciding.items()})}]
    if state.shadows:
        env.append({"name": "PREDICTION_SHADOWS", "value": json.dumps(state.shadows)})
    patch["spec"]["template"]["spec"]["containers"][0]["env"] = env
    return patch


def overlay(tmp_path: Path, state: State) -> Path:
    """A copy of the prod overlay in ``state``."""
    target = tmp_path / "prod"
    target.mkdir()
    kustomization = yaml.safe_load((PROD / "kustomization.yaml").read_text())

    def relative(path: Path) -> str:
        return os.path.relpath(path, target)  # kustomize refuses absolute paths

    kustomization["resources"] = [relative((PROD / r).resolve()) for r in kustomization["resources"]]
    kustomization["components"] = [relative((PROD / c).resolve()) for c in kustomization["components"]]
    for patch in kustomization["patches"]:
        if patch.get("path") not in (None, "track-stable.yaml"):
            shutil.copy(PROD / patch["path"], target / patch["path"])
    (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    (target / "track-stable.yaml").write_text(yaml.safe_dump(track_state(state), sort_keys=False))
    return target


def problems_of(objects: list[dict], istio_schemas, argo_schemas) -> list[str]:
    """Everything the committed overlays are held to, in one list."""
    problems = dc.route_problems(objects) + dc.model_source_problems(objects)
    for obj in objects:
        if dc.is_istio(obj):
            problems += istio_schemas.errors(obj) if istio_schemas else []
        elif dc.is_argo(obj):
            problems += argo_schemas.errors(obj) if argo_schemas else []
        else:
            problems += dc.kubernetes_schema_errors(obj, dc.KUBERNETES_VERSIONS[-1])
        if obj["kind"] in dc.WORKLOAD_KINDS:
            problems += dc.lint_workload(obj)
            if dc.app_of(obj) == "prediction":
                problems += lc.ledger_problems(obj, objects) + lc.rollout_problems(obj, objects)
    return problems + lc.migrate_job_problems(objects) + lc.migrate_order_problems(objects)


def optional(request: pytest.FixtureRequest, name: str):
    """A schema fixture when ../shared is there; the other checks run either way."""
    try:
        return request.getfixturevalue(name)
    except pytest.skip.Exception:
        return None


def the(objects: list[dict], kind: str) -> dict:
    (obj,) = dc.of_kind(objects, kind)
    return obj


def canary_template(objects: list[dict], name: str = "prediction-canary") -> dict:
    (template,) = [o for o in dc.of_kind(objects, "AnalysisTemplate") if o["metadata"]["name"] == name]
    return template


# -- the Rollout and its analysis ---------------------------------------------------------------------


def test_argo_objects_match_the_argo_rollouts_crds(rendered: dict, argo_schemas: dc.CrdSchemas) -> None:
    objects = [obj for obj in rendered["prod"] if dc.is_argo(obj)]
    assert sorted(dc.name_of(o) for o in objects) == ["AnalysisTemplate/prediction-canary",
                                                      "AnalysisTemplate/prediction-canary-outcomes",
                                                      "Rollout/prediction-rollout"]
    assert [p for obj in objects for p in argo_schemas.errors(obj)] == []
    assert not any(dc.is_argo(obj) for obj in rendered["dev"])


def test_argo_schema_rejects_mistyped_fields(rendered: dict, argo_schemas: dc.CrdSchemas) -> None:
    rollout = json.loads(json.dumps(the(rendered["prod"], "Rollout")))
    rollout["spec"]["strategy"]["canary"]["stepz"] = rollout["spec"]["strategy"]["canary"].pop("steps")
    rollout["spec"]["strategy"]["canary"]["maxUnavailable"] = [0]
    problems = "\n".join(argo_schemas.errors(rollout))
    assert "'stepz' was unexpected" in problems and "maxUnavailable" in problems


def test_canary_steps_are_1_30_100_each_held_and_judged(rendered: dict) -> None:
    canary = the(rendered["prod"], "Rollout")["spec"]["strategy"]["canary"]
    weights = [s["setWeight"] for s in canary["steps"] if "setWeight" in s]
    assert weights == [1, 30, 100]
    # Every weight is held before the next one (the analysis measures during the hold).
    for i, step in enumerate(canary["steps"]):
        if "setWeight" in step:
            assert dc.duration_ms(canary["steps"][i + 1]["pause"]["duration"]) >= 3_600_000
    # Background analysis from the first step on: a breach at 1%, 30% or 100% aborts.
    assert canary["analysis"]["startingStep"] == 1
    assert [t["templateName"] for t in canary["analysis"]["templates"]] == ["prediction-canary"]


def test_analysis_judges_the_projects_own_metrics_and_aborts_on_one_breach(rendered: dict) -> None:
    objects = rendered["prod"]
    template = canary_template(objects)["spec"]
    rollout_args = {a["name"] for a in the(objects, "Rollout")["spec"]["strategy"]["canary"]["analysis"]["args"]}
    declared = {a["name"]: a for a in template["args"]}
    assert {m["name"] for m in template["metrics"]} == ANALYSIS_METRICS
    for metric in template["metrics"]:
        # One failed measurement aborts; a measurement passes only on its successCondition.
        assert metric["failureLimit"] == 0 and "successCondition" in metric, metric["name"]
        query = metric["provider"]["prometheus"]["query"]
        # The canary's pods only, by the revision hash Argo passes.
        assert 'rollouts_pod_template_hash="{{args.canary-hash}}"' in query, metric["name"]
        used = set(re.findall(r"\{\{args\.([\w-]+)\}\}", json.dumps(metric)))
        assert used <= set(declared), metric["name"]
        # Every argument a metric uses has a value: from the Rollout or a default here.
        assert all(name in rollout_args or "value" in declared[name] for name in used), metric["name"]


def _analysis_templates(rendered: dict) -> list[tuple[str, dict, dict | None]]:
    """(overlay, template, the Rollout that runs it or None) for every Argo analysis template."""
    out = []
    for overlay, objects in sorted(rendered.items()):
        rollouts = dc.of_kind(objects, "Rollout")
        for template in (o for o in objects if o["kind"] in ARGO_ANALYSIS_KINDS):
            using = [r for r in rollouts if template["metadata"]["name"] in
                     [t["templateName"] for t in r["spec"]["strategy"].get("canary", {}).get("analysis", {}).get(
                         "templates", [])]]
            out.append((overlay, template, using[0] if using else None))
    return out


def test_c57_no_analysis_metric_passes_an_empty_result_or_nan(rendered: dict) -> None:
    # A ratio over a window in which the canary took no call is NaN (0/0), a query that finds no
    # series is an empty vector: Argo passes both to the conditions as result [NaN] and []. No
    # metric of any analysis in any overlay may call either a success (a canary nobody calls
    # would be promoted on them), nor fail to evaluate them (result[0] of []: an Error, retried).
    templates = _analysis_templates(rendered)
    assert [(overlay, dc.name_of(t)) for overlay, t, _ in templates] == [
        ("prod", "AnalysisTemplate/prediction-canary"), ("prod", "AnalysisTemplate/prediction-canary-outcomes")]
    templates = [(o, t, r) for o, t, r in templates if t["metadata"]["name"] == "prediction-canary"]
    assert not [dc.name_of(o) for objects in rendered.values() for o in objects
                if o["kind"] in FLAGGER_ANALYSIS_KINDS and o["apiVersion"].startswith("flagger.app/")]
    for overlay, template, rollout in templates:
        # The pod-template hashes and the namespace as Argo would pass them: no condition reads them.
        given = {a["name"]: f"<{a['name']}>" for a in template["spec"]["args"] if "value" not in a}
        metrics = ca.template_metrics(template, ca.argument_values(template, rollout, given))
        assert {m.name for m in metrics} == ANALYSIS_METRICS
        phases = {m.name: (ca.phase_of(m, []), ca.phase_of(m, [math.nan])) for m in metrics}
        assert phases == {name: (ca.INCONCLUSIVE,) * 2 if name in COMPARISON_METRICS else (ca.FAILED,) * 2
                          for name in ANALYSIS_METRICS}, overlay
        # Several values where the query sums to one: not a measurement either.
        assert not [m.name for m in metrics if ca.phase_of(m, [0.0, 0.0]) == ca.SUCCESSFUL]
        # And each metric does pass a number inside its bounds (0: no error, no fallback, no
        # disagreement, no drift; the latency over its bound and the logit difference, none).
        inside = {"canary-scraped": 1.0, "canary-traffic": float(ca.argument_values(template, rollout, given)[
            "min-canary-rate"])}
        assert {m.name: ca.phase_of(m, [inside.get(m.name, 0.0)]) for m in metrics} == {
            name: ca.SUCCESSFUL for name in ANALYSIS_METRICS}
        # One measurement that is not a success stops the Rollout: Failed aborts it, Inconclusive
        # pauses it.
        for m in metrics:
            assert ca.run_phase(metrics, [ca.Measurement(m.name, [], ca.phase_of(m, []))]) in (
                ca.FAILED, ca.INCONCLUSIVE), m.name


def test_c57_canary_traffic_wants_the_minimum_rate_of_calls(rendered: dict) -> None:
    template = canary_template(rendered["prod"])
    rollout = the(rendered["prod"], "Rollout")
    values = ca.argument_values(template, rollout, {"canary-hash": "6c8d7f9b4", "stable-hash": "5f7c9d8b6",
                                                    "namespace": "mlpair"})
    metrics = {m.name: m for m in ca.template_metrics(template, values)}
    traffic = metrics["canary-traffic"]
    # The floor brings at least the decisions score-drift needs into its 5-minute window.
    (decisions,) = re.findall(r">= (\d+)\s*$", metrics["score-drift"].query)
    assert float(values["min-canary-rate"]) == 1.0 and 1.0 * 300 >= int(decisions) == 200
    assert traffic.query.split() == ['sum(rate(prediction_requests_total{', 'namespace="mlpair",',
                                     'rollouts_pod_template_hash="6c8d7f9b4"}[5m]))']
    assert [ca.phase_of(traffic, [r]) for r in (0.0, 0.5, 0.99, 1.0, 40.0)] == [ca.FAILED] * 3 + [ca.SUCCESSFUL] * 2
    # Measured first once a whole 5-minute window of the step's traffic is in, as every metric of
    # the canary's calls.
    delays = {m["name"]: m.get("initialDelay") for m in template["spec"]["metrics"]}
    assert delays == {name: "2m" if name == "canary-scraped" else "5m" for name in ANALYSIS_METRICS}


def test_rollout_runs_the_stable_track_and_argo_drives_its_routes(rendered: dict) -> None:
    objects = rendered["prod"]
    rollout = the(objects, "Rollout")
    (workload,) = dc.workloads(objects, "prediction")
    assert dc.rollout_of(workload, objects) is rollout
    # Both revisions run the stable track's template: Istio's metrics tell them apart only by the
    # canonical revision Argo writes on each revision's pods (never a selector: pods are relabelled).
    canary_strategy = rollout["spec"]["strategy"]["canary"]
    revision = "service.istio.io/canonical-revision"
    assert canary_strategy["canaryMetadata"]["labels"][revision] == "canary"
    assert canary_strategy["stableMetadata"]["labels"][revision] == "stable"
    assert revision not in rollout["spec"]["selector"]["matchLabels"]
    assert rollout["spec"]["selector"] == workload["spec"]["selector"]
    assert dc.autoscaler_of(workload, objects)["spec"]["scaleTargetRef"]["kind"] == "Rollout"
    canary = rollout["spec"]["strategy"]["canary"]
    assert canary["maxUnavailable"] == 0  # as the Deployment's: never below the HPA's count
    istio = canary["trafficRouting"]["istio"]
    service = dc.by_name(objects, "VirtualService", istio["virtualService"]["name"])
    (weighted,) = [r for r in service["spec"]["http"] if r["name"] in istio["virtualService"]["routes"]]
    # At rest, and after an abort: everything on the stable subset.
    assert {d["destination"]["subset"]: d["weight"] for d in weighted["route"]} == {
        istio["destinationRule"]["stableSubsetName"]: 100, istio["destinationRule"]["canarySubsetName"]: 0}
    rule = dc.by_name(objects, "DestinationRule", istio["destinationRule"]["name"])
    for subset in rule["spec"]["subsets"]:
        assert dc.selector_matches(subset["labels"], dc.pod_labels(workload)), subset["name"]


# -- the runbook's steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_runbook_step_renders_a_valid_state(step: str, tmp_path: Path, kubectl: Path,
                                            kubernetes_validate_installed: None,
                                            request: pytest.FixtureRequest) -> None:
    state = STEPS[step]
    objects = dc.render(kubectl, overlay(tmp_path, state))
    assert problems_of(objects, optional(request, "istio_schemas"), optional(request, "argo_schemas")) == []
    (workload,) = dc.workloads(objects, "prediction")
    settings = dc.settings_of(workload, objects)
    assert dc.json_setting(settings, "PREDICTION_ENSEMBLES", {}) == {f: [v] for f, v in state.deciding.items()}
    assert dc.json_setting(settings, "PREDICTION_SHADOWS", {}) == state.shadows


def test_committed_prod_state_is_the_shadow_step(rendered: dict, kubectl: Path, tmp_path: Path) -> None:
    simulated = dc.render(kubectl, overlay(tmp_path, STEPS["shadow"]))
    assert sorted(rendered["prod"], key=dc.name_of) == sorted(simulated, key=dc.name_of)


def test_mistyped_steps_are_caught(tmp_path: Path, kubectl: Path, kubernetes_validate_installed: None,
                                   request: pytest.FixtureRequest) -> None:
    # Starting the canary with a version named by tag rather than number, and comparing a version
    # with itself: refused before a cluster sees it. (A number that was never published is
    # refused by the pod itself, naming the published ones: tests/deploy/test_deploy_startup.py.)
    state = State({"credit-risk": "v2", "churn": "1"}, {"credit-risk": "v2", "churn": "1", "fraud": "1"})
    objects = dc.render(kubectl, overlay(tmp_path, state))
    problems = problems_of(objects, optional(request, "istio_schemas"), None)
    assert problems == [
        "Deployment/prediction-stable: credit-risk version 'v2' is not a published version number",
        "Deployment/prediction-stable: credit-risk version 'v2' is not a published version number",
        "Deployment/prediction-stable: credit-risk version v2 both decides and is shadowed",
        "Deployment/prediction-stable: churn version 1 both decides and is shadowed",
        "Deployment/prediction-stable: versions named for fraud, which is not served",
    ]


def test_the_outcomes_analysis_fails_on_a_realised_auc_drop_and_waits_for_missing_labels(rendered: dict) -> None:
    template = canary_template(rendered["prod"], "prediction-canary-outcomes")
    values = ca.argument_values(template, None, {"namespace": "mlpair", "model": "churn", "canary-version": "4"})
    (metric,) = ca.template_metrics(template, values)
    assert 'model_version="4"' in metric.query and 'family="churn"' in metric.query
    assert (ca.phase_of(metric, []), ca.phase_of(metric, [math.nan])) == (ca.INCONCLUSIVE, ca.INCONCLUSIVE)
    assert ca.phase_of(metric, [-0.01]) == ca.SUCCESSFUL and ca.phase_of(metric, [0.02]) == ca.SUCCESSFUL
    assert ca.phase_of(metric, [-0.08]) == ca.FAILED
    # what it queries is what PredictionService exports (the realised and holdout gauges' labels)
    assert {"prediction_realised_roc_auc", "prediction_holdout_roc_auc"} <= set(re.findall(r"prediction_\w+", metric.query))
