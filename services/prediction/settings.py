"""PredictionService settings, from ``PREDICTION_*`` environment variables or CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import model_validator
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
    models: list[str] = []
    """Model families served (each needs config_dir/<name>/ and a trained model); empty = model_name alone."""
    ensembles: dict[str, list[str]] = {}
    """Model family → versions whose mean calibrated probability decides (JSON); absent = the latest alone."""
    shadows: dict[str, str] = {}
    """Model family → a version also scored for every decision, compared in metrics, never served (JSON)."""
    inference_max_batch_rows: int = 1024
    """Most rows per Infer call; keep at most InferenceService's max_batch_size."""
    max_batch_items: int = 1000
    """Most items one BatchPredict call may carry; more is INVALID_ARGUMENT."""
    explain_top_reasons: int = 3
    """Top reasons, in business language, returned with an explanation."""
    max_message_bytes: int = 4 * 1024 * 1024
    """gRPC message size limit, both directions, in bytes."""
    shutdown_grace_s: float = 20.0
    """Seconds in-flight requests get to finish after SIGTERM before the server exits."""
    log_level: str = "INFO"
    """Root log level."""
    log_format: Literal["text", "json"] = "text"
    """Log line format: readable text locally, JSON lines in production."""

    # -- TLS (when not behind a mesh that terminates mTLS) ----------------------------------
    tls_cert_file: Path | None = None
    """PEM certificate chain of the gRPC port; with tls_key_file, the port speaks TLS only."""
    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: Path | None = None
    """PEM CA bundle; when set, callers must present a certificate it signed (mutual TLS)."""
    inference_tls_ca_file: Path | None = None
    """PEM CA bundle that signed InferenceService's certificate; set = call InferenceService over TLS."""
    inference_tls_cert_file: Path | None = None
    """PEM client certificate presented to InferenceService (when it requires mutual TLS)."""
    inference_tls_key_file: Path | None = None
    """PEM private key of inference_tls_cert_file."""

    @model_validator(mode="after")
    def _tls_is_consistent(self) -> PredictionSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if (self.inference_tls_cert_file is None) != (self.inference_tls_key_file is None):
            raise ValueError("inference_tls_cert_file and inference_tls_key_file go together")
        if self.inference_tls_cert_file is not None and self.inference_tls_ca_file is None:
            raise ValueError("an inference client certificate needs inference_tls_ca_file (TLS to InferenceService)")
        return self
