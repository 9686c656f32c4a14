"""``prediction_*`` Prometheus metrics (the business-layer SLA), labelled by model."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 1.0, 2.5, 5.0)

REQUESTS = Counter("prediction_requests_total", "Predict calls by outcome.", ["model", "code"])
DECISIONS = Counter("prediction_decisions_total", "Decisions returned, by band.", ["model", "decision"])
REQUEST_DURATION = Histogram("prediction_request_duration_seconds", "Predict latency inside the server, CRM write included.",
                             ["model"], buckets=LATENCY_BUCKETS)
INFERENCE_DURATION = Histogram("prediction_inference_call_duration_seconds", "Infer call latency seen by the client.",
                               ["model"], buckets=LATENCY_BUCKETS)
CRM_WRITE_DURATION = Histogram("prediction_crm_write_duration_seconds", "CRM write latency.", ["model"],
                               buckets=LATENCY_BUCKETS)
FEATURE_GUARDS = Counter("prediction_feature_guard_total", "Feature guards fired, per feature and action.",
                         ["model", "feature", "action"])
UNKNOWN_ATTRIBUTES = Counter("prediction_unknown_attributes_total", "Request attributes the schema does not know (ignored).",
                             ["model"])
IDEMPOTENT_REPLAYS = Counter("prediction_idempotent_replays_total", "Retries answered from the CRM record.", ["model"])

# -- Observability (issue 6): CRM write health, fallbacks, drift. -------------------------------
CRM_WRITES = Counter("prediction_crm_writes_total", "CRM write attempts by outcome (ok, error).", ["model", "outcome"])
FALLBACKS = Counter("prediction_fallbacks_total",
                    "Decisions served by a fallback (stale cache entry or REVIEW) instead of fresh inference, by reason.",
                    ["model", "reason"])
DRIFT_STATISTIC = Gauge("prediction_drift_statistic",
                        "Drift effect size per feature over the window: KS statistic (test=ks) or total variation "
                        "distance (test=chi2).", ["model", "feature", "test"])
DRIFT_P_VALUE = Gauge("prediction_drift_p_value", "Drift test p-value per feature, before the Bonferroni correction.",
                      ["model", "feature", "test"])
DRIFT_DETECTED = Gauge("prediction_drift_detected",
                       "1 when a feature drifted: effect size above its threshold and p-value below alpha / tests.",
                       ["model", "feature"])
DRIFT_WINDOW_ROWS = Gauge("prediction_drift_window_rows", "Decisions in the drift window.", ["model"])
SCORE_DRIFT_STATISTIC = Gauge("prediction_score_drift_statistic",
                              "KS statistic of the calibrated score over the window against training's.", ["model"])
SCORE_DRIFT_P_VALUE = Gauge("prediction_score_drift_p_value", "KS p-value of the calibrated score drift test.", ["model"])
SCORE_DRIFT_DETECTED = Gauge("prediction_score_drift_detected", "1 when the calibrated score distribution drifted.",
                             ["model"])
DRIFT_THRESHOLD = Gauge("prediction_drift_threshold", "Effect-size threshold of each drift test (ks, chi2).",
                        ["model", "test"])
DRIFT_CORRECTED_ALPHA = Gauge("prediction_drift_corrected_alpha",
                              "Per-test significance level: alpha / number of tests (Bonferroni).", ["model"])
