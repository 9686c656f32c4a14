"""Outcome feedback against a running pair (processes): decisions made through Predict, their true
labels fed back through RecordOutcomes (bad items refused by item, the valid ones stored) and again
through `mlpair outcomes-import` (stored once), the realised ROC AUC on PredictionService's metrics
port equal to scikit-learn's on the same decisions, and `mlpair outcomes-report`."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta

import grpc
from prometheus_client.parser import text_string_to_metric_families
from sklearn.metrics import roc_auc_score

from mlpair.client import BatchItem, Outcome, OutcomeError, PredictionClient
from tests.support import CONFIG_DIR
from tests.support.pair import free_port, pair, running

N = 240  # decisions; the first 200 fed back through the RPC, all of them through the file


def gauge(metrics_url: str, name: str, labels: dict[str, str]) -> float | None:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def mlpair(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlpair.cli", *args], capture_output=True, text=True, timeout=120)


def test_outcomes_fed_back_to_a_running_pair_score_as_scikit_learn(model_repository, credit_holdout, tmp_path):
    metrics_port = free_port()
    p = pair(tmp_path / "pair", model_repository, prediction_env={
        "PREDICTION_METRICS_PORT": str(metrics_port), "PREDICTION_OUTCOME_REFRESH_S": "0.5",
        "PREDICTION_OUTCOME_WINDOWS_H": "[0, 24]", "PREDICTION_OUTCOME_MIN_JOINED": "20"})
    labels = [int(y) for y in credit_holdout.labels[:N]]
    names = ["bad" if y else "not bad" for y in labels]
    ids = [f"out-{i}" for i in range(N)]
    with running(p), PredictionClient(p.prediction.address, timeout_s=60) as client:
        decisions = client.batch_predict([BatchItem("credit-risk", str(e), r, i) for e, r, i in
                                          zip(credit_holdout.entity_ids[:N], credit_holdout.records[:N], ids)])
        assert all(not isinstance(d, Exception) and d.request_id == i for d, i in zip(decisions, ids))
        probabilities = [d.probability for d in decisions]

        now = datetime.now(UTC)
        results = client.record_outcomes([
            *(Outcome(label, request_id) for label, request_id in zip(names[:200], ids[:200])),
            Outcome("defaulted", ids[0]),  # 200: not a class name
            Outcome("bad"),  # 201: no id
            Outcome("not bad" if labels[1] else "bad", ids[1]),  # 202: another label for a decision that has one
            Outcome("bad", "not-decided-yet"),  # 203: kept for a later join
            Outcome("bad", ids[2], observed_at=now + timedelta(days=1)),  # 204: in the future
            Outcome(names[3], entity_id=str(credit_holdout.entity_ids[3]),  # 205: by entity and time, a duplicate
                    decided_at=decisions[3].decided_at.ToDatetime(tzinfo=UTC)),
        ])
        assert len(results) == 206
        assert all(not isinstance(r, OutcomeError) and r.request_id == i and r.decision_found and not r.duplicate
                   for r, i in zip(results[:200], ids))
        errors = {n: (r.code, r.reason, r.metadata.get("item"), r.metadata.get("field"))
                  for n, r in enumerate(results) if isinstance(r, OutcomeError)}
        assert errors == {
            200: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_OUTCOME", "200", "label"),
            201: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_OUTCOME", "201", "request_id"),
            202: (grpc.StatusCode.ALREADY_EXISTS, "OUTCOME_CONFLICT", None, None),
            204: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_OUTCOME", "204", "observed_at"),
        }
        assert (results[203].decision_found, results[203].duplicate) == (False, False)
        assert (results[205].request_id, results[205].duplicate) == (ids[3], True)

        csv = tmp_path / "outcomes.csv"
        csv.write_text("request_id,label,observed_at\n" + "".join(
            f"{i},{label},2026-01-05T00:00:00Z\n" for i, label in zip(ids, names)))
        flags = ["--ledger-url", p.ledger_url, "--model-repository", str(model_repository),
                 "--config-dir", str(CONFIG_DIR)]
        for expected in (f"{N} rows: {N - 200} stored (0 awaiting their decision), 200 on record already, 0 refused",
                         f"{N} rows: 0 stored (0 awaiting their decision), {N} on record already, 0 refused"):
            done = mlpair("outcomes-import", str(csv), *flags)
            assert (done.returncode, done.stdout.strip()) == (0, expected), done.stderr

        expected_auc = roc_auc_score(labels, probabilities)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        key = {"family": "credit-risk", "model_version": "1"}
        deadline = time.monotonic() + 30
        while gauge(metrics_url, "prediction_realised_outcomes", {**key, "window": "all"}) != N:
            assert time.monotonic() < deadline, "the realised gauges were not refreshed within 30 s"
            time.sleep(0.5)
        for window in ("all", "24h"):
            assert abs(gauge(metrics_url, "prediction_realised_roc_auc", {**key, "window": window}) - expected_auc) < 1e-9
        assert gauge(metrics_url, "prediction_outcomes_unjoined", {}) == 1  # "not-decided-yet"
        assert gauge(metrics_url, "prediction_holdout_roc_auc", key) is not None
        for name in ("prediction_realised_ece", "prediction_holdout_ece"):  # what the calibration alert compares
            assert gauge(metrics_url, name, {**key, "window": "all"} if "realised" in name else key) is not None

    report = mlpair("outcomes-report", *flags, "--picture", str(tmp_path / "outcomes.png"))
    assert report.returncode == 0, report.stderr
    assert f"credit-risk version 1, window all: {N} decisions with outcomes" in report.stdout
    auc_line = next(line for line in report.stdout.splitlines() if line.strip().startswith("ROC AUC"))
    assert auc_line.split()[2] == f"{expected_auc:.3f}"  # realised, then the holdout figure
    assert (tmp_path / "outcomes.png").stat().st_size > 10_000
