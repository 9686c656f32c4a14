"""``prediction_*`` Prometheus metrics (the business-layer SLA), labelled by model."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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
INFERENCE_ROWS = Histogram("prediction_inference_call_rows", "Rows per Infer call (packed rows of one or many requests).",
                           ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
BATCH_ITEMS = Histogram("prediction_batch_items", "Items per BatchPredict call.", buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000))
EXPLANATIONS = Counter("prediction_explanations_total", "Decisions returned with an explanation.", ["model"])
ENSEMBLE_SPREAD = Histogram("prediction_ensemble_spread", "Max minus min of the ensemble members' calibrated probabilities.",
                            ["model"], buckets=(0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0))
UNCERTAIN_DECISIONS = Counter("prediction_uncertain_decisions_total",
                              "Decisions routed to the policy's uncertainty decision because the ensemble spread exceeded its bound.",
                              ["model"])
SHADOW_LOGIT_DIFFERENCE = Histogram(
    "prediction_shadow_logit_difference", "|shadow margin - primary margin| per row, in logits (canary evidence).",
    ["model", "primary_version", "shadow_version"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0))
SHADOW_DECISIONS = Counter("prediction_shadow_decisions_total",
                           "Shadow decisions compared with the served ones, by agreement (agree or disagree).",
                           ["model", "primary_version", "shadow_version", "agreement"])
SHADOW_FAILURES = Counter("prediction_shadow_failures_total", "Shadow calls that failed or were skipped (never affects the served decision).",
                          ["model", "shadow_version", "cause"])
