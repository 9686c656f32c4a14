"""``inference_*`` Prometheus metrics (the system-layer SLA), labelled by model and version."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Buckets span 0.1 ms … 2.5 s: one CPU row takes ~20 µs, the SLA is p99 ≤ 120 ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.12, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("inference_requests_total", "Infer calls by outcome.", ["model", "version", "code"])
REQUEST_DURATION = Histogram("inference_request_duration_seconds", "Infer latency inside the server.",
                             ["model", "version"], buckets=LATENCY_BUCKETS)
COMPUTE_DURATION = Histogram("inference_compute_duration_seconds", "Runtime execution time per call.",
                             ["model", "version"], buckets=LATENCY_BUCKETS)
ROWS = Histogram("inference_request_rows", "Rows per Infer call.", ["model", "version"],
                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
NONFINITE_OUTPUTS = Counter("inference_nonfinite_outputs_total", "Model outputs with NaN or Inf, never returned.",
                            ["model", "version"])
MODEL_LOAD_DURATION = Histogram("inference_model_load_duration_seconds", "Load plus warm-up time per model version.",
                                ["model", "version"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
MODEL_READY = Gauge("inference_model_ready", "1 when a model version is loaded and warmed.", ["model", "version"])
