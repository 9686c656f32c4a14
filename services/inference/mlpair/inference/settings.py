"""InferenceService settings, from ``INFERENCE_*`` environment variables or CLI flags.

In this order: network and process; TLS; model repository and versions; runtime; GPU signals;
health after start; dynamic batching (``max_batch_size``, ``max_queue_delay_ms``, priorities); streaming.
Each field's docstring says what it does and its unit."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from mlpair.inference.versions import VersionPolicy
from mlpair.rpc.server import ConnectionSettings


class InferenceSettings(ConnectionSettings):
    """Everything the inference server reads; built once in ``main()`` and passed down."""

    model_config = SettingsConfigDict(
        env_prefix="INFERENCE_", extra="ignore", protected_namespaces=(), use_attribute_docstrings=True
    )

    # -- network and process ---------------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface the gRPC and metrics ports bind to: loopback, so a local run is reachable from this
    machine only; 0.0.0.0 (every interface) where others must reach it, as the images and manifests set."""
    port: int = 8001
    """gRPC port (0 picks a free one); serves InferenceService, OIP v2 and grpc.health.v1."""
    metrics_port: int = 8002
    """Prometheus HTTP port; 0 disables the exporter."""
    max_message_bytes: int = 16 * 1024 * 1024
    """gRPC message size limit, both directions, in bytes; larger messages get RESOURCE_EXHAUSTED."""
    workers: int = 0
    """Serving processes sharing the gRPC port under one supervisor (docs/decisions/0015); 0 = one per CPU
    of the container's limit (cgroup cpu.max or CFS quota, else the CPUs available), but 1 when serving on
    a GPU (each worker loads its own copy of every model onto the device)."""
    shutdown_grace_s: float = 20.0
    """Seconds in-flight requests get to finish after SIGTERM before the server exits."""
    shutdown_accept_ms: int = 500
    """Milliseconds calls are still served after SIGTERM (health already NOT_SERVING), so calls sent
    just before it that gRPC has received but not yet dispatched are served, not cancelled or refused."""
    log_level: str = "INFO"
    """Root log level."""
    log_format: Literal["text", "json"] = "text"
    """Log line format: readable text locally, JSON lines in production."""
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    """The asyncio event loop of each process: the standard library's or uvloop (libuv); uvloop measured
    no faster on single-row OIP calls (docs/decisions/0009-uvloop-for-predictionservice.md). Both keep
    timers in whole milliseconds: the standard loop waits until the next one at least, uvloop rounds to
    the nearest, so on uvloop a max_queue_delay_ms under 0.5 means no wait at all."""
    tracing: bool = True
    """OpenTelemetry spans with W3C trace context and per-call log context on every RPC (its CPU
    per call: docs/observability.md, Overhead); off only where that matters more than traces."""
    otlp_endpoint: str = ""
    """OTLP/gRPC collector for traces (e.g. http://otel-collector:4317); empty = the standard
    OTEL_EXPORTER_OTLP_ENDPOINT (and OTEL_EXPORTER_OTLP_* options) when set, else no export."""
    trace_sample_ratio: float = 1.0
    """Fraction of new traces recorded when exporting; a caller's sampling decision is kept. When not
    set, the standard OTEL_TRACES_SAMPLER (+ OTEL_TRACES_SAMPLER_ARG) decides, if set, else 1.0."""
    log_sample_ratio: float = 0.0
    """Fraction of Infer calls logged at INFO when DEBUG is off (0 = none; per-call lines are DEBUG)."""

    # -- TLS (when not behind a mesh that terminates mTLS) ----------------------------------
    tls_cert_file: Path | None = None
    """PEM certificate chain of the gRPC port; with tls_key_file, the port speaks TLS only."""
    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: Path | None = None
    """PEM CA bundle; when set, callers must present a certificate it signed (mutual TLS)."""

    # -- model repository and versions -----------------------------------------------------
    model_repository: Path = Path("var/models")
    """Root of ``<model_name>/<version>/`` entries, read in place (when model_source is empty)."""
    model_source: str = ""
    """The repository's URI when it is not a local folder: ``s3://bucket/prefix`` (endpoint, region and
    credentials from the standard AWS variables and files), ``models:/name``, ``models:/name@alias`` or
    ``models:/`` (an MLflow registry, from MLFLOW_TRACKING_URI); empty = model_repository."""
    model_cache_dir: Path = Path("var/model-cache")
    """Node-local cache of versions downloaded from model_source, keyed by content digest; a restart or
    another process given the same folder reuses it."""
    model_cache_max_bytes: int = 4 * 2**30
    """Bytes model_cache_dir may hold; least recently used versions are evicted beyond it (0 = no bound)."""
    source_retry_max_s: float = 30.0
    """Longest wait, in seconds, between tries of an unreachable model_source at start (0.5 s doubling)."""
    models: list[str] = []
    """Model names to load; empty loads every model found in the repository."""
    version_policy: str = "latest:1"
    """Versions served per model: ``latest:N`` (the N highest), ``all``, or ``specific:1,3``."""
    model_control: Literal["none", "poll", "explicit"] = "none"
    """Loading after start-up: none; poll the repository every repository_poll_s; explicit = admin RPCs."""
    repository_poll_s: float = 10.0
    """Seconds between repository scans when model_control is poll."""

    # -- runtime ---------------------------------------------------------------------------
    runtime: Literal["onnx", "torch"] = "onnx"
    """Execution backend: ONNX Runtime (model.onnx) or PyTorch (the exported program beside it)."""
    execution_provider: Literal["auto", "cuda", "cpu"] = "auto"
    """Device: auto = CUDA when available, else CPU (logged); cuda = CUDA or refuse to start (exit 2, one-line reason)."""
    intra_op_threads: int = 1
    """Threads per model execution; 1 suits small models and many concurrent calls."""
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    """ONNX Runtime graph optimisation level."""
    half_precision: bool = False
    """PyTorch on CUDA only: run in FP16 (logits are returned as FP32; ~1e-3 deviation)."""
    cuda_graphs: bool = False
    """PyTorch on CUDA only: replay captured CUDA graphs for the warm-up batch sizes."""
    deterministic: bool = False
    """Audited mode: fixed seeds and deterministic kernels; batch-invariant results, some speed lost."""
    execution_instances: int = 1
    """Model executions that may run at once per model version (threads in the runtime executor)."""
    inline_execution_max_ms: float = 0.5
    """A version whose warm-up batch of max_batch_size rows ran within this many ms runs its batches on
    the event-loop thread (a thread hop costs more than such a batch); 0 = always in the executor."""

    # -- GPU signals (mlpair.inference.gpu_signals) -----------------------------------------
    gpu_sample_interval_s: float = 5.0
    """Seconds between samples of the GPUs through NVML (and of torch's CUDA allocator), in a thread,
    never per request; 0 = no sampling. Without NVML or a GPU nothing is sampled whatever this says."""
    gpu_ghost_memory_max_bytes: int = 4 * 2**30
    """Bytes torch may hold reserved but unallocated ("ghost memory") on a device before the server
    turns not ready, until it falls back under; 0 = no limit. Only the torch runtime on CUDA has it."""

    # -- health after start (mlpair.inference.model_health) ----------------------------------
    unhealthy_after_failures: int = 3
    """Consecutive failed batches (the runtime raised, or returned the wrong row count) after which a model
    version turns not ready; a sticky CUDA error turns it not ready (and fails liveness) at once."""
    self_test_interval_s: float = 10.0
    """Seconds between known-answer self-tests of a healthy model version (one batch of 8 rows through
    its batcher); without traffic, a model that turned wrong or broken is seen within this long."""
    self_test_retry_s: float = 1.0
    """Seconds between self-tests of an unhealthy model version; the first passing one makes it ready again."""
    self_test_atol: float = 1e-4
    """Absolute tolerance of the self-test: logits match when |y - ref| <= atol + rtol * |ref|, where atol
    also gets 4 times the spread measured at warm-up (batch size, padding, half precision)."""
    self_test_rtol: float = 1e-3
    """Relative tolerance of the self-test (see self_test_atol)."""

    # -- dynamic batching ------------------------------------------------------------------
    batching: bool = True
    """Dynamic batching on; off executes each request (or chunk) on its own."""
    max_batch_size: int = 128
    """Most rows in one model execution (rows, never requests)."""
    max_queue_delay_ms: float = 2.0
    """Longest a queued request waits for batch-mates before its batch runs, in milliseconds."""
    preferred_batch_sizes: list[int] = []
    """Batch sizes (rows) to run as soon as reached; empty = fill up to max_batch_size or the delay."""
    max_request_rows: int = 8192
    """Most rows one request may carry; above max_batch_size it is split into batches, above this refused."""
    max_queue_rows: int = 16384
    """Rows that may wait per model version and priority level; beyond it that level's requests get
    RESOURCE_EXHAUSTED (unless priority_queue_rows sets the level's own limit)."""
    priority_levels: int = 2
    """Priority levels of the batch queue, 1 (highest) to this (Triton's priority_levels): a batch takes
    higher levels' waiting rows first; a request naming another level is refused INVALID_ARGUMENT."""
    default_priority_level: int = 0
    """Level of a request that names none (priority 0 or absent); 0 = the lowest, priority_levels."""
    priority_queue_rows: list[int] = []
    """Rows that may wait per level, level 1 first (e.g. [16384, 2048]); levels not listed take
    max_queue_rows. A full level refuses its own requests only."""

    # -- streaming (OIP ModelStreamInfer) ---------------------------------------------------
    stream_max_in_flight: int = 128
    """Requests one ModelStreamInfer stream may have read but not yet answered; at the limit the server
    stops reading that stream until a response is sent, and HTTP/2 flow control holds the client."""

    @field_validator("version_policy")
    @classmethod
    def _policy_is_valid(cls, value: str) -> str:
        VersionPolicy.parse(value)
        return value

    @model_validator(mode="after")
    def _limits_are_consistent(self) -> InferenceSettings:
        if self.max_batch_size < 1 or self.max_request_rows < 1 or self.stream_max_in_flight < 1:
            raise ValueError("max_batch_size, max_request_rows and stream_max_in_flight must be at least 1")
        if self.gpu_sample_interval_s < 0 or self.gpu_ghost_memory_max_bytes < 0:
            raise ValueError("gpu_sample_interval_s and gpu_ghost_memory_max_bytes cannot be negative (0 = off)")
        if self.unhealthy_after_failures < 1 or self.self_test_interval_s <= 0 or self.self_test_retry_s <= 0:
            raise ValueError(
                "unhealthy_after_failures must be at least 1, self_test_interval_s and self_test_retry_s above 0"
            )
        if self.self_test_atol < 0 or self.self_test_rtol < 0:
            raise ValueError("self_test_atol and self_test_rtol cannot be negative")
        if self.max_request_rows > self.max_queue_rows:
            raise ValueError(
                f"max_request_rows ({self.max_request_rows}) cannot exceed max_queue_rows "
                f"({self.max_queue_rows}): such a request could never be queued"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.priority_levels < 1 or not 0 <= self.default_priority_level <= self.priority_levels:
            raise ValueError("priority_levels must be at least 1 and default_priority_level in 0..priority_levels")
        if len(self.priority_queue_rows) > self.priority_levels or any(
            r < self.max_request_rows for r in self.priority_queue_rows
        ):
            raise ValueError(
                f"priority_queue_rows takes one limit per level ({self.priority_levels} at most), each at least "
                f"max_request_rows ({self.max_request_rows}): a smaller one could never queue such a request"
            )
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} must lie in 1..max_batch_size ({self.max_batch_size})")
        return self

    @property
    def default_level(self) -> int:
        """The priority level of a request that names none: default_priority_level, 0 meaning the lowest."""
        return self.default_priority_level or self.priority_levels

    def models_to_serve(self) -> list[str]:
        """Models a server with these settings serves: ``models``, else every folder of
        ``model_repository`` (none when it does not exist; dot folders skipped)."""
        if self.models:
            return list(self.models)
        root = self.model_repository
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
