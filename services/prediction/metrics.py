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
