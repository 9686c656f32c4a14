"""Drift: the statistics themselves, then real holdout applicants replayed through the real pair."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from scipy.stats import ks_2samp

from mlpair.cli import main as cli_main
from mlpair.prediction.monitoring.drift import DriftConfig, DriftMonitor
from mlpair.prediction.monitoring.drift_report import reports_from_metrics
from mlpair.prediction.monitoring.drift_statistics import chi2_against_frequencies, ks_against_quantiles
from tests.observability.pair import predict_request

CONCURRENCY = 8


# -- the statistics -----------------------------------------------------------------------------

def test_ks_against_quantiles_matches_scipy_two_sample_ks_on_continuous_data():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=4000)
    quantiles = np.quantile(reference, np.linspace(0, 1, 101))
    for shift in (0.0, 0.3, 1.0):
        sample = rng.normal(loc=shift, size=500)
        d, p = ks_against_quantiles(sample, quantiles, len(reference))
        exact = ks_2samp(sample, reference, method="asymp")
        assert d == pytest.approx(exact.statistic, abs=0.012)  # 101 quantiles: CDF known to ±1/100
        assert (p < 1e-3) == (exact.pvalue < 1e-3)


def test_ks_against_quantiles_is_exact_at_atoms():
    """A discrete feature (loan term in months) drawn from its own distribution: D ≈ 0, not the
    size of an atom, which a continuous-CDF formula would report."""
    rng = np.random.default_rng(1)
    values, weights = np.array([12.0, 24.0, 36.0, 48.0, 60.0]), np.array([0.1, 0.2, 0.3, 0.3, 0.1])
    reference = rng.choice(values, size=5000, p=weights)
    sample = rng.choice(values, size=800, p=weights)
    d, p = ks_against_quantiles(sample, np.quantile(reference, np.linspace(0, 1, 101)), len(reference))
    assert d < 0.05 and p > 0.01
    d_moved, _ = ks_against_quantiles(np.full(800, 60.0), np.quantile(reference, np.linspace(0, 1, 101)), 5000)
    assert d_moved > 0.85


def test_chi2_flags_a_moved_category_and_one_never_seen_in_training():
    freq = np.array([0.5, 0.3, 0.2, 0.0])  # last slot: unknown category, never seen in training
    _, p_same, tv_same = chi2_against_frequencies(np.array([250, 150, 100, 0]), freq, 3000)
    assert p_same > 0.5 and tv_same == pytest.approx(0.0)
    _, p_moved, tv_moved = chi2_against_frequencies(np.array([100, 150, 250, 0]), freq, 3000)
    assert p_moved < 1e-10 and tv_moved == pytest.approx(0.3)
    _, p_new, tv_new = chi2_against_frequencies(np.array([200, 120, 80, 100]), freq, 3000)
    assert p_new < 1e-10 and tv_new == pytest.approx(0.2)


def test_no_verdict_below_min_rows_and_bonferroni_over_all_tests(credit_entry, credit_holdout):
    from mlpair.contracts.assembly import FeatureAssembler

    monitor = DriftMonitor(credit_entry, DriftConfig(min_rows=200))
    x = FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records[:100])
    x[:, 0] += 5.0  # an absurd shift of the first numeric feature
    for row in x:
        monitor.observe(row, 0.3)
    report = monitor.report()
    assert report.window_rows == 100 and not report.drifted, "100 rows < min_rows: no verdict yet"
    schema = credit_entry.preprocessing.feature_schema
    assert monitor.tests == len(schema.numeric) + len(schema.categorical) + 1  # + the score
    assert report.corrected_alpha == pytest.approx(0.01 / monitor.tests)


def test_window_slides(credit_entry):
    monitor = DriftMonitor(credit_entry, DriftConfig(window_rows=10))
    n = credit_entry.manifest.n_features
    for i in range(25):
        monitor.observe(np.full(n, i, dtype=np.float32), i / 100)
    x, scores = monitor.snapshot()
    assert sorted(scores.round(2)) == [i / 100 for i in range(15, 25)] and x.shape == (10, n)


# -- acceptance: real holdout applicants through the real pair ------------------------------------

async def _replay(pair, holdout, tag: str, transform=lambda r: r) -> None:
    """Every holdout applicant through PredictionService.Predict, CONCURRENCY in flight."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(eid, record):
        async with gate:
            await pair.stub.Predict(predict_request(f"{tag}-{eid}", eid, transform(record)), timeout=30)

    await asyncio.gather(*(one(e, r) for e, r in zip(holdout.entity_ids, holdout.records, strict=True)))


def _income_times_3(record: dict) -> dict:
    income = record.get("Income")
    return {**record, "Income": None if income is None else income * 3}


async def test_drift_quiet_on_the_holdout_and_fires_on_income_times_3(pair, credit_holdout):
    (monitor,) = pair.predictor.drift.monitors.values()
    assert monitor.config.ks_threshold == 0.15 and monitor.config.window_rows >= len(credit_holdout.records)

    await _replay(pair, credit_holdout, "drift-plain")
    (quiet,) = await pair.predictor.drift.evaluate()
    assert quiet.window_rows >= len(credit_holdout.records)
    assert not quiet.drifted, [(t.feature, t.statistic, t.p_value) for t in quiet.features]
    assert max(t.statistic for t in quiet.features if t.test == "ks") < 0.15

    await _replay(pair, credit_holdout, "drift-income3", _income_times_3)
    (shifted,) = await pair.predictor.drift.evaluate()
    assert shifted.drifted_features == ["Income"], [(t.feature, round(t.statistic, 3)) for t in shifted.features]
    income = next(t for t in shifted.features if t.feature == "Income")
    assert income.statistic > 0.15 and income.p_value < shifted.corrected_alpha
    assert shifted.score is not None and shifted.score.drifted, "richer applicants move the score distribution"

    # Exported as metrics, and read back by `mlpair drift-report` from a real metrics endpoint.
    from prometheus_client import REGISTRY, generate_latest

    (from_metrics,) = [r for r in reports_from_metrics(generate_latest(REGISTRY).decode())
                       if r.model_name == shifted.model_name]
    assert from_metrics.drifted_features == ["Income"] and from_metrics.window_rows == shifted.window_rows
    assert from_metrics.score.drifted


def test_drift_report_command_reads_a_metrics_endpoint(capsys):
    from prometheus_client import REGISTRY, start_http_server

    from mlpair.prediction import metrics

    metrics.DRIFT_WINDOW_ROWS.labels("cli-model").set(500)
    metrics.DRIFT_MIN_ROWS.labels("cli-model").set(200)
    metrics.DRIFT_CORRECTED_ALPHA.labels("cli-model").set(0.001)
    metrics.DRIFT_THRESHOLD.labels("cli-model", "ks").set(0.15)
    metrics.DRIFT_STATISTIC.labels("cli-model", "Income", "ks").set(0.4)
    metrics.DRIFT_P_VALUE.labels("cli-model", "Income", "ks").set(1e-9)
    metrics.DRIFT_DETECTED.labels("cli-model", "Income").set(1)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert cli_main(["drift-report", "--metrics-url", url]) == 2
        out = capsys.readouterr().out
        assert "cli-model: DRIFT over 500 decisions" in out and "Income" in out
        # Too few decisions for a verdict: the report says so instead of "no drift".
        metrics.DRIFT_WINDOW_ROWS.labels("cli-model").set(7)
        metrics.DRIFT_DETECTED.labels("cli-model", "Income").set(0)
        cli_main(["drift-report", "--metrics-url", url])  # exit code also reflects other models' gauges (below: alone)
        out = capsys.readouterr().out
        assert "cli-model: no verdict: 7 decisions in the window, fewer than the 200 needed" in out
        assert "cli-model: no drift" not in out
        assert cli_main(["drift-report", "--metrics-url", "http://127.0.0.1:1/metrics", "--timeout-s", "1"]) == 1
    finally:
        server.shutdown()
        thread.join(timeout=5)
        for gauge in (metrics.DRIFT_WINDOW_ROWS, metrics.DRIFT_MIN_ROWS, metrics.DRIFT_CORRECTED_ALPHA):
            gauge.remove("cli-model")
        metrics.DRIFT_THRESHOLD.remove("cli-model", "ks")
        metrics.DRIFT_STATISTIC.remove("cli-model", "Income", "ks")
        metrics.DRIFT_P_VALUE.remove("cli-model", "Income", "ks")
        metrics.DRIFT_DETECTED.remove("cli-model", "Income")



async def test_periodic_evaluation_exports_gauges_until_stopped(credit_entry, credit_holdout):
    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.prediction import metrics
    from mlpair.prediction.monitoring.drift import DriftMonitors

    monitors = DriftMonitors({credit_entry.manifest.model_name: DriftMonitor(credit_entry, DriftConfig(min_rows=10))})
    x = FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records[:50])
    for row in x:
        monitors.observe(credit_entry.manifest.model_name, row, 0.2)
    monitors.observe("a-family-without-monitor", x[0], 0.2)  # ignored, never an error
    from prometheus_client import REGISTRY

    model = {"model": credit_entry.manifest.model_name}
    metrics.DRIFT_WINDOW_ROWS.labels(**model).set(-1)
    monitors.start(0.05)
    try:
        for _ in range(100):
            if REGISTRY.get_sample_value("prediction_drift_window_rows", model) == 50:
                break
            await asyncio.sleep(0.05)
    finally:
        await monitors.stop()
    assert REGISTRY.get_sample_value("prediction_drift_window_rows", model) == 50
    assert REGISTRY.get_sample_value("prediction_drift_threshold", {**model, "test": "ks"}) == 0.15


def test_drift_report_exits_3_while_no_verdict_exists(capsys):
    """Before a window holds enough decisions (or before any monitor reported) there is no verdict:
    a distinct exit code, never the 0 of "no drift"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    window = Gauge("prediction_drift_window_rows", "", ["model"], registry=registry)
    served = {"body": b""}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(served["body"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        assert cli_main(["drift-report", "--metrics-url", url]) == 3  # no monitor has reported yet
        assert "no drift monitors reported" in capsys.readouterr().out
        window.labels("quiet-model").set(7)
        Gauge("prediction_drift_min_rows", "", ["model"], registry=registry).labels("quiet-model").set(200)
        served["body"] = generate_latest(registry)
        assert cli_main(["drift-report", "--metrics-url", url]) == 3
        assert "quiet-model: no verdict: 7 decisions in the window, fewer than the 200 needed" in capsys.readouterr().out
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_drift_report_json_is_strict_json_with_the_derived_alpha_and_null_for_what_the_metrics_lack(capsys):
    """``--json`` parses under a strict parser (no NaN, as JavaScript's JSON.parse): alpha is the
    exported Bonferroni level times the tests, a gauge the exposition lacks is null, and no version
    is made up (the drift gauges carry none)."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()

    def gauge(name: str, *labels: str) -> Gauge:
        return Gauge(name, "", ["model", *labels], registry=registry)

    gauge("prediction_drift_window_rows").labels("json-model").set(500)
    gauge("prediction_drift_min_rows").labels("json-model").set(200)
    gauge("prediction_drift_corrected_alpha").labels("json-model").set(0.01 / 3)  # 2 features + the score
    gauge("prediction_drift_threshold", "test").labels("json-model", "ks").set(0.15)  # no chi2 threshold
    statistic = gauge("prediction_drift_statistic", "feature", "test")
    statistic.labels("json-model", "Income", "ks").set(0.4)
    statistic.labels("json-model", "Home", "chi2").set(0.01)
    gauge("prediction_drift_p_value", "feature", "test").labels("json-model", "Income", "ks").set(1e-9)  # not Home's
    gauge("prediction_drift_detected", "feature").labels("json-model", "Income").set(1)
    gauge("prediction_score_drift_statistic").labels("json-model").set(0.05)
    gauge("prediction_score_drift_p_value").labels("json-model").set(0.5)
    gauge("prediction_score_drift_detected").labels("json-model").set(0)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert cli_main(["drift-report", "--metrics-url", url, "--json"]) == 2
    finally:
        server.shutdown()
        thread.join(timeout=5)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    (report,) = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert report["alpha"] == 0.01 and report["corrected_alpha"] == pytest.approx(0.01 / 3)
    assert "model_version" not in report
    assert (report["judged"], report["drifted"], report["drifted_features"]) == (True, True, ["Income"])
    home = next(t for t in report["features"] if t["feature"] == "Home")
    assert (home["statistic"], home["p_value"], home["threshold"], home["drifted"]) == (0.01, None, None, False)
    assert (report["score"]["p_value"], report["score"]["threshold"]) == (0.5, 0.15)
