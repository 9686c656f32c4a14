"""``inference_*`` Prometheus metrics (the system-layer SLA), labelled by model and version.

Served on the service's own HTTP port (``metrics_port``). Histograms, never summaries, so
replicas aggregate. Model and version labels only take loaded names ("unknown" otherwise), so
a client cannot create time series.

With several workers (``workers`` > 1, :mod:`mlpair.workers`) the supervisor serves every worker's
metrics summed (prometheus-client multiprocess mode); each gauge says how workers combine:
queue depth and device memory add up (``livesum``), a model version is ready only when it is in
every live worker (``livemin``). ``live*`` modes drop a worker that exited.
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, Histogram

# Buckets span 0.1 ms … 2.5 s: one CPU row takes ~20 µs, the SLA is p99 ≤ 120 ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.12, 0.25, 0.5, 1.0, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

REQUESTS = Counter(
    "inference_requests_total", "Inference calls by model, version and gRPC status code.", ["model", "version", "code"]
)
REQUEST_DURATION = Histogram(
    "inference_request_duration_seconds",
    "Inference latency inside the server.",
    ["model", "version"],
    buckets=LATENCY_BUCKETS,
)
QUEUE_DURATION = Histogram(
    "inference_queue_duration_seconds",
    "Time a request waited in the batch queue.",
    ["model", "version"],
    buckets=LATENCY_BUCKETS,
)
COMPUTE_DURATION = Histogram(
    "inference_compute_duration_seconds",
    "Runtime execution time per batch.",
    ["model", "version"],
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "inference_batch_size_rows", "Rows per executed batch.", ["model", "version"], buckets=ROW_BUCKETS
)
QUEUE_DEPTH = Gauge(
    "inference_queue_depth_rows", "Rows waiting in the batch queue.", ["model", "version"], multiprocess_mode="livesum"
)
QUEUE_DROPPED = Counter(
    "inference_queue_dropped_total",
    "Queued requests removed before compute: deadline expired or caller cancelled.",
    ["model", "version", "reason"],
)
QUEUE_REJECTED = Counter(
    "inference_queue_rejected_total", "Requests refused because the queue was full.", ["model", "version"]
)
OBSERVABILITY_ERRORS = Counter(
    "inference_observability_errors_total",
    "Log lines, spans or metrics that failed to be made (caught: never a failed request).",
    ["stage"],
)
NONFINITE_OUTPUTS = Counter(
    "inference_nonfinite_outputs_total",
    "Rows whose model output had a NaN or Inf logit (never returned as logits).",
    ["model", "version"],
)
MODEL_LOAD_DURATION = Histogram(
    "inference_model_load_duration_seconds",
    "Load plus warm-up time per model version.",
    ["model", "version"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
MODEL_LOAD_FAILURES = Counter(
    "inference_model_load_failures_total", "Model versions that failed to load or warm up.", ["model", "version"]
)
MODEL_READY = Gauge(
    "inference_model_ready",
    "1 when a model version is loaded, warmed and serving.",
    ["model", "version"],
    multiprocess_mode="livemin",
)
DEVICE_MEMORY = Gauge(
    "inference_device_memory_bytes",
    "Accelerator memory held by a model version (GPU only).",
    ["model", "version"],
    multiprocess_mode="livesum",
)


def shared_across_processes() -> bool:
    """Whether this process writes its metrics for a supervisor to aggregate (prometheus-client's
    multiprocess mode, set up by :mod:`mlpair.workers`): a value computed at scrape time
    (``set_function``) cannot be read from there."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
