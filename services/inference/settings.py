"""InferenceService settings, from ``INFERENCE_*`` environment variables or CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class InferenceSettings(BaseSettings):
    """Everything the inference server reads; built once in ``main()`` and passed down."""

    model_config = SettingsConfigDict(env_prefix="INFERENCE_", extra="ignore", protected_namespaces=(),
                                      use_attribute_docstrings=True)

    host: str = "0.0.0.0"
    """Interface the gRPC server binds to."""
    port: int = 8001
    """gRPC port (0 picks a free one)."""
    metrics_port: int = 8002
    """Prometheus HTTP port; 0 disables the exporter."""
    model_repository: Path = Path("var/models")
    """Root of ``<model_name>/<version>/`` entries."""
    models: list[str] = []
    """Model names to load; empty loads every model found in the repository."""
    execution_provider: Literal["auto", "cuda", "cpu"] = "auto"
    """ONNX Runtime execution provider; auto = CUDA when available, else CPU (logged)."""
    intra_op_threads: int = 1
    """ONNX Runtime threads per inference; 1 suits small models and many concurrent calls."""
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    """ONNX Runtime graph optimisation level."""
    max_batch_size: int = 1024
    """Most rows one request may carry; larger requests get INVALID_ARGUMENT."""
    max_message_bytes: int = 16 * 1024 * 1024
    """gRPC message size limit, both directions, in bytes."""
    shutdown_grace_s: float = 20.0
    """Seconds in-flight requests get to finish after SIGTERM before the server exits."""
    log_level: str = "INFO"
    """Root log level."""
    log_format: Literal["text", "json"] = "text"
    """Log line format: readable text locally, JSON lines in production."""
    # -- Observability (issue 6) ----------------------------------------------------------------
    otlp_endpoint: str = ""
    """OTLP/gRPC collector for traces (e.g. http://otel-collector:4317); empty = no export."""
    trace_sample_ratio: float = 1.0
    """Fraction of new traces recorded when exporting; a caller's sampling decision is kept."""
    log_sample_ratio: float = 0.0
    """Fraction of Infer calls logged at INFO when DEBUG is off (0 = none; per-call lines are DEBUG)."""
