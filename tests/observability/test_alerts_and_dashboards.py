"""deploy/observability validated offline: promtool on the rules and their unit tests, every
metric the rules, dashboards and docs name is one the services export, and the other way round."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO_ROOT

OBSERVABILITY = REPO_ROOT / "deploy" / "observability"
RULES = OBSERVABILITY / "prometheus" / "rules.yaml"
DASHBOARDS = {"inference": OBSERVABILITY / "grafana" / "inference-sla.json",
              "prediction": OBSERVABILITY / "grafana" / "prediction-sla.json"}
PROMTOOL_TESTS = sorted((Path(__file__).parent / "promtool").glob("*.test.yaml"))
DOCS = REPO_ROOT / "docs" / "observability.md"
# Recording rules are named level:metric:operations (model:..., model_feature:...).
OUR_NAME = re.compile(r"\b(?:[a-z_]+:)?(?:inference|prediction)_[a-z0-9_]*(?::[a-z0-9_]+)?\b")

# Every SLA the issue names has burn-rate alerts; drift has its own.
BURN_RATE_ALERTS = {
    "InferenceLatencyBudgetBurn": "inference", "InferenceErrorBudgetBurn": "inference",
    "PredictionLatencyBudgetBurn": "prediction", "PredictionErrorBudgetBurn": "prediction",
    "PredictionFallbackBudgetBurn": "prediction", "PredictionCrmWriteBudgetBurn": "prediction",
}
DRIFT_ALERTS = {"PredictionFeatureDrift", "PredictionScoreDrift", "PredictionDriftMonitorSilent",
                "PredictionFleetFeatureDrift", "PredictionFleetScoreDrift"}
# Alerts on a cause or a pattern rather than a budget: each holds for a while before it fires.
OPERATIONS_ALERTS = {"PredictionDecisionBacklogStale", "PredictionDecisionBacklogLarge", "PredictionRelayFailing",
                     "PredictionDecisionsNotDelivered",
                     "PredictionCircuitOpen", "PredictionStaleCacheRatio", "PredictionThresholdProbing",
                     "PredictionShadowDisagreement", "ScoreJobWillMissDeadline", "PredictionEventsLagging"}
# InferenceService health after start (one pod's model version out of rotation, a lost device): each holds a while.
INFERENCE_HEALTH_ALERTS = {"InferenceModelVersionNotReady", "InferenceRuntimeFailures", "InferenceSelfTestFailing",
                           "InferenceDeviceLost", "InferenceModelSourceUnreachable"}
# Realised performance on fed-back outcomes against the version's holdout figures: each holds an hour.
OUTCOME_ALERTS = {"PredictionRealisedRocAucBelowHoldout", "PredictionRealisedCalibrationWorse"}
# GPU signals (inference_gpu_*, GPU pods only; proven on synthetic series in promtool/gpu.test.yaml): each holds a while.
GPU_ALERTS = {"InferenceGpuMemoryHigh", "InferenceGpuMemoryFull", "InferenceGpuGhostMemory", "InferenceGpuSaturated",
              "InferenceGpuThrottled"}


@pytest.fixture(scope="module")
def promtool() -> Path:
    """promtool from Debian's prometheus package (``make test`` fetches it into .venv/bin)."""
    for candidate in (Path(sys.prefix) / "bin" / "promtool", shutil.which("promtool")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    message = "promtool not found; `make .venv/bin/promtool` fetches it from Debian's prometheus package"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: required in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name the two services' metrics modules can export (inference_*, prediction_*),
    and those a batch-scoring job reports (inference_job_*, mlpair.jobs.metrics)."""
    from prometheus_client import REGISTRY

    import mlpair.inference.metrics  # noqa: F401  (registers the metrics)
    import mlpair.prediction.feedback.metrics  # noqa: F401
    import mlpair.prediction.metrics  # noqa: F401
    import mlpair.prediction.recording.event_relay  # noqa: F401  (the decision events' metrics)
    from mlpair.jobs.metrics import registry_for
    from mlpair.jobs.state import JobState

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    job = JobState("j", "in.parquet", "credit-risk", "id", None, 10, 10, True, "out.parquet", started_at=1.0,
                   run_started_at=1.0, run_rows=10, deadline=2.0)
    families = [f for c in list(REGISTRY._collector_to_names) for f in getattr(c, "describe", list)()]
    families += list(registry_for(job).collect())  # a job collector describes what it collects
    return {family.name + s for family in families if family.name.startswith(("inference_", "prediction_"))
            for s in suffixes[family.type]}


def _names(expr: str) -> set[str]:
    return set(OUR_NAME.findall(expr))


def _dashboard_exprs(path: Path) -> list[str]:
    board = json.loads(path.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


# -- promtool ---------------------------------------------------------------------------------------

def test_rules_pass_promtool_check(promtool):
    out = subprocess.run([promtool, "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alerts_fire_and_stay_quiet_as_specified_by_promtool_unit_tests(promtool):
    assert {p.name for p in PROMTOOL_TESTS} == {"inference.test.yaml", "prediction.test.yaml", "operations.test.yaml",
                                               "fleet-drift.test.yaml", "probing-canary.test.yaml",
                                               "inference-health.test.yaml", "gpu.test.yaml", "score-jobs.test.yaml",
                                               "model-source.test.yaml", "outcomes.test.yaml", "events.test.yaml"}
    out = subprocess.run([promtool, "test", "rules", *PROMTOOL_TESTS], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_dashboard_query_is_valid_promql(promtool, tmp_path):
    """Each panel query, with Grafana's variables filled in, as a recording rule promtool parses."""
    exprs = [e for path in DASHBOARDS.values() for e in _dashboard_exprs(path)]
    filled = [e.replace("$__rate_interval", "5m").replace("$model", ".*") for e in exprs]
    rules_file = tmp_path / "dashboard-queries.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(filled)]}]}))
    out = subprocess.run([promtool, "check", "rules", rules_file], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# -- the rules' shape ---------------------------------------------------------------------------------

def test_each_sla_has_multi_window_burn_rate_alerts(rules):
    alerts: dict[str, list[dict]] = {}
    for rule in rules:
        if "alert" in rule:
            alerts.setdefault(rule["alert"], []).append(rule)
    assert set(alerts) == (set(BURN_RATE_ALERTS) | DRIFT_ALERTS | OPERATIONS_ALERTS | INFERENCE_HEALTH_ALERTS
                           | GPU_ALERTS | OUTCOME_ALERTS)
    for name, layer in BURN_RATE_ALERTS.items():
        windows = {r["labels"]["window"]: r for r in alerts[name]}
        assert set(windows) == {"1h", "6h", "3d"}, name
        assert {r["labels"]["severity"] for r in alerts[name]} == {"page", "ticket"}
        for window, rule in windows.items():
            assert rule["labels"]["layer"] == layer
            long_short = re.findall(r":ratio_rate(\w+) >", rule["expr"])
            assert len(long_short) == 2 and long_short[0] == window and re.search(r"\band\b", rule["expr"])
    for name in DRIFT_ALERTS | OPERATIONS_ALERTS | OUTCOME_ALERTS:
        (rule,) = alerts[name]
        assert rule["labels"]["layer"] == "prediction" and rule["for"]
    for name in INFERENCE_HEALTH_ALERTS | GPU_ALERTS:
        (rule,) = alerts[name]
        assert rule["labels"]["layer"] == "inference" and rule["for"]


def test_every_alert_names_its_layer_and_a_runbook_section_that_exists(rules):
    headings = {re.sub(r"[^a-z0-9]", "", line.lstrip("#").strip().lower())
                for line in DOCS.read_text().splitlines() if line.startswith("#")}
    for rule in (r for r in rules if "alert" in r):
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert rule["labels"]["layer"] in ("inference", "prediction")
        assert rule["annotations"]["summary"]
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in headings, f"{rule['alert']}: no section #{anchor} in {DOCS.name}"


# -- metric names agree everywhere ----------------------------------------------------------------------

def test_rules_and_dashboards_use_only_exported_metrics_and_defined_recordings(rules, exported):
    recorded = {r["record"] for r in rules if "record" in r}
    used = {name for r in rules for name in _names(r["expr"])}
    used |= {name for path in DASHBOARDS.values() for e in _dashboard_exprs(path) for name in _names(e)}
    unknown = used - exported - recorded
    assert not unknown, f"names no service exports and no rule records: {sorted(unknown)}"


def test_one_dashboard_per_sla_and_each_shows_its_own_layer_only():
    uids = set()
    for layer, path in DASHBOARDS.items():
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "model"}
        other = "prediction" if layer == "inference" else "inference"
        for expr in _dashboard_exprs(path):
            assert not any(n.split(":")[-2 if ":" in n else 0].startswith(f"{other}_") for n in _names(expr)), \
                f"{path.name} mixes in the {other} layer: {expr}"
        assert all(p.get("targets") for p in board["panels"] if p["type"] != "row")
    assert len(uids) == 2


def test_docs_table_documents_every_metric_exactly_once(exported):
    documented = re.findall(r"^\| `((?:inference|prediction)_[a-z0-9_]+)`", DOCS.read_text(), re.MULTILINE)
    assert len(documented) == len(set(documented)), "a metric is documented twice"
    # The table names counters with _total and histograms by their base name.
    families = {n for n in exported if not n.endswith(("_bucket", "_count", "_sum"))} | \
               {n[: -len("_bucket")] for n in exported if n.endswith("_bucket")}
    assert set(documented) == families, (f"undocumented: {sorted(families - set(documented))}; "
                                         f"documented but not exported: {sorted(set(documented) - families)}")
