"""PredictionService settings, from ``PREDICTION_*`` environment variables or CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class PredictionSettings(BaseSettings):
    """Everything the prediction server reads; built once in ``main()`` and passed down."""

    model_config = SettingsConfigDict(env_prefix="PREDICTION_", extra="ignore", protected_namespaces=(),
                                      use_attribute_docstrings=True)

    host: str = "0.0.0.0"
    """Interface the gRPC server binds to."""
    port: int = 9001
    """gRPC port (0 picks a free one)."""
    metrics_port: int = 9002
    """Prometheus HTTP port; 0 disables the exporter."""
    inference_target: str = "127.0.0.1:8001"
    """host:port of InferenceService."""
    inference_timeout_ms: int = 1000
    """Deadline of each Infer call, in milliseconds."""
    crm_url: str = "sqlite+aiosqlite:///var/crm.sqlite"
    """SQLAlchemy async URL of the CRM database (e.g. postgresql+asyncpg://…)."""
    model_repository: Path = Path("var/models")
    """Model repository root; the fitted preprocessing and calibration are read from it."""
    config_dir: Path = Path("config")
    """Folder with ``<model_name>/feature-schema.toml`` and ``<model_name>/policy.toml``."""
    model_name: str = "credit-risk"
    """Model family served when a request names none."""
    max_message_bytes: int = 4 * 1024 * 1024
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
    """Fraction of decisions logged at INFO when DEBUG is off (0 = none; per-decision lines are DEBUG)."""
    drift_window_rows: int = 1000
    """Decisions in the sliding window each drift evaluation looks at."""
    drift_min_rows: int = 200
    """Fewest decisions in the window before drift is judged at all."""
    drift_ks_threshold: float = 0.15
    """KS statistic above which a numeric feature (or the score) may drift (design.md's alarm)."""
    drift_categorical_threshold: float = 0.15
    """Total variation distance above which a categorical feature may drift."""
    drift_alpha: float = 0.01
    """Family-wise significance of one evaluation; each test uses alpha / number of tests (Bonferroni)."""
    drift_interval_s: float = 30.0
    """Seconds between drift evaluations (0 disables the periodic evaluation)."""
