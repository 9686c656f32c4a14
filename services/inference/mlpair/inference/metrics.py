"""``inference_*`` Prometheus metrics (the system-layer SLA), labelled by model and version.

Served on the service's own HTTP port (``metrics_port``). Histograms, never summaries, so
replicas aggregate. Model and version labels only take loaded names ("unknown" otherwise), so
a client cannot create time series.

With several workers (``workers`` > 1, :mod:`mlpair.workers`) the supervisor serves every worker's
metrics summed (prometheus-client multiprocess mode); each gauge says how workers combine:
queue depth and device memory add up (``livesum``), a model version is ready (and healthy) only
when it is in every live worker (``livemin``). ``live*`` modes drop a worker that exited.
"""

from __future__ import annotations

import functools
import os

from prometheus_client import Counter, Histogram

from mlpair.observability.metrics import gauge

# Buckets span 0.1 ms … 2.5 s: from a small model's CPU batch to far past the SLA (p99 ≤ 120 ms).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.12, 0.25, 0.5, 1.0, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# A latency histogram by model and version: _latency(name, documentation).
_latency = functools.partial(Histogram, labelnames=["model", "version"], buckets=LATENCY_BUCKETS)

REQUESTS = Counter(
    "inference_requests_total", "Inference calls by model, version and gRPC status code.", ["model", "version", "code"]
)
REQUEST_DURATION = _latency("inference_request_duration_seconds", "Inference latency inside the server.")
QUEUE_DURATION = _latency("inference_queue_duration_seconds", "Time a request waited in the batch queue.")
COMPUTE_DURATION = _latency("inference_compute_duration_seconds", "Runtime execution time per batch.")
BATCH_SIZE = Histogram(
    "inference_batch_size_rows", "Rows per executed batch.", ["model", "version"], buckets=ROW_BUCKETS
)
QUEUE_DEPTH = gauge(
    "inference_queue_depth_rows", "Rows waiting in the batch queue.", ["model", "version"], workers="livesum"
)
QUEUE_DROPPED = Counter(
    "inference_queue_dropped_total",
    "Queued requests removed before compute: deadline expired or caller cancelled.",
    ["model", "version", "reason"],
)
QUEUE_REJECTED = Counter(
    "inference_queue_rejected_total", "Requests refused because the queue was full.", ["model", "version"]
)
PRIORITY_REQUESTS = Counter(
    "inference_priority_requests_total",
    "Requests by priority level (1 = highest): queued, or rejected because that level's queue was full.",
    ["model", "version", "priority", "result"],
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
MODEL_SOURCE_ERRORS = Counter(
    "inference_model_source_errors_total",
    "Reads of the model source (bucket, registry) that failed: at start (retried with backoff) or while "
    "polling (the serving versions stay).",
    ["operation"],
)
MODEL_READY = gauge(
    "inference_model_ready",
    "1 when a model version is loaded, warmed and serving.",
    ["model", "version"],
    workers="livemin",
)
DEVICE_MEMORY = gauge(
    "inference_device_memory_bytes",
    "Accelerator memory held by a model version (GPU only).",
    ["model", "version"],
    workers="livesum",
)

# -- health after start (mlpair.inference.model_health): every child made when a version is
# published, so each series exists (at 0) from then on.
RUNTIME_FAILURES = Counter(
    "inference_runtime_failures_total",
    "Failed model executions after start, by cause: batches whose runtime raised (out_of_memory, device_lost, "
    "runtime_error) or returned the wrong row count, and self-tests whose logits did not match (wrong_output).",
    ["model", "version", "cause"],
)
SELF_TEST = Counter(
    "inference_self_test_total",
    "Known-answer self-tests of a serving model version, by result (pass, fail).",
    ["model", "version", "result"],
)
SELF_TEST_DURATION = _latency(
    "inference_self_test_duration_seconds", "Time a known-answer self-test took, its wait in the batch queue included."
)
MODEL_HEALTHY = gauge(
    "inference_model_healthy",
    "1 while a serving model version answers (batches and self-test pass), 0 once it turned not ready after start.",
    ["model", "version"],
    workers="livemin",
)


def shared_across_processes() -> bool:
    """Whether this process writes its metrics for a supervisor to aggregate (prometheus-client's
    multiprocess mode, set up by :mod:`mlpair.workers`): a value computed at scrape time
    (``set_function``) cannot be read from there."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


# -- GPU signals (mlpair.inference.gpu_signals): sampled on a timer, never per request. Every series
# but inference_gpu_present exists only where NVML sees a GPU, and a field the driver does not report
# is absent, never zero. Device-wide readings are the same in every worker (livemax); this process's
# own memory adds up across workers (livesum).
GPU_PRESENT = gauge(
    "inference_gpu_present", "1 when NVML sees an NVIDIA GPU for this process, 0 when there is none (or no NVML)."
)
GPU_UTILIZATION = gauge(
    "inference_gpu_utilization_ratio",
    "Fraction of the last sample period in which a kernel ran on the device (NVML), 0-1.",
    ["device"],
)
GPU_MEMORY_UTILIZATION = gauge(
    "inference_gpu_memory_utilization_ratio",
    "Fraction of the last sample period in which device memory was read or written (NVML), 0-1.",
    ["device"],
)
GPU_MEMORY_USED = gauge("inference_gpu_memory_used_bytes", "Device memory in use by every process (NVML).", ["device"])
GPU_MEMORY_TOTAL = gauge("inference_gpu_memory_total_bytes", "Device memory installed (NVML).", ["device"])
GPU_PROCESS_MEMORY = gauge(
    "inference_gpu_process_memory_bytes",
    "Device memory held by this serving process (NVML's compute processes, by PID).",
    ["device"],
    workers="livesum",
)
GPU_TEMPERATURE = gauge("inference_gpu_temperature_celsius", "GPU core temperature (NVML).", ["device"])
GPU_POWER = gauge("inference_gpu_power_watts", "Board power draw (NVML).", ["device"])
GPU_POWER_LIMIT = gauge("inference_gpu_power_limit_watts", "Enforced board power limit (NVML).", ["device"])
GPU_SM_CLOCK = gauge("inference_gpu_sm_clock_hertz", "Current streaming-multiprocessor clock (NVML).", ["device"])
GPU_THROTTLED = gauge(
    "inference_gpu_throttled",
    "1 while NVML reports this clock-event (throttle) reason active, 0 while not; only reasons the device supports.",
    ["device", "reason"],
)
GPU_ECC_UNCORRECTED = gauge(
    "inference_gpu_ecc_uncorrected_errors",
    "Uncorrected ECC errors since the driver loaded (NVML, volatile counter; ECC-capable devices only).",
    ["device"],
)
GPU_XID_ERRORS = Counter(
    "inference_gpu_xid_errors",
    "Critical Xid events NVML delivered to this process (where the driver reports them).",
    ["device"],
)
GPU_TORCH_RESERVED = gauge(
    "inference_gpu_torch_reserved_bytes",
    "Device memory torch's caching allocator holds (torch runtime on CUDA only).",
    ["device"],
    workers="livesum",
)
GPU_TORCH_ALLOCATED = gauge(
    "inference_gpu_torch_allocated_bytes",
    "Device memory in live torch tensors (torch runtime on CUDA only).",
    ["device"],
    workers="livesum",
)
GPU_GHOST_MEMORY = gauge(
    "inference_gpu_ghost_memory_bytes",
    "torch reserved minus allocated: cached, held from other processes, used by no tensor.",
    ["device"],
    workers="livesum",
)
GPU_GHOST_MEMORY_LIMIT = gauge(
    "inference_gpu_ghost_memory_limit_bytes",
    "gpu_ghost_memory_max_bytes: ghost memory above it makes the server not ready (0 = off); beside each ghost series.",
    ["device"],
)
