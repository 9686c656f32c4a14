"""The transport-neutral core of InferenceService: validation, version contract, execution.

Order of checks for each request, all before any compute: the model and version exist and
are ready; the caller's ``x-feature-version`` equals the model's feature schema version; the
tensor's dtype, shape, byte size and values are valid. Only then does it reach the runtime.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlpair import logs
from mlpair.contracts.manifest import ModelEntry, list_versions, load_entry
from mlpair.errors import ServiceError
from mlpair.inference import metrics
from mlpair.inference.errors import FeatureVersionMismatch, InvalidInput, ModelFailure, ModelNotFound, ModelNotReady
from mlpair.inference.runtimes.onnx import OnnxRuntime
from mlpair.inference.settings import InferenceSettings

logger = logging.getLogger(__name__)

# Element sizes of the data types the wire format can name; only FP32 is accepted as input.
ITEM_SIZE = {"FP32": 4, "FP64": 8, "FP16": 2, "INT64": 8}
MAX_REPORTED_CELLS = 5  # non-finite cells named in one error message


@dataclass(frozen=True)
class TensorIn:
    """A raw input tensor as it arrived: type name (e.g. "FP32"), shape and little-endian bytes."""

    data_type: str
    shape: tuple[int, ...]
    content: bytes


@dataclass(frozen=True)
class InferResult:
    """Logits ``[batch, n_classes] float32`` and the version that produced them."""

    model_name: str
    model_version: str
    logits: np.ndarray


@dataclass
class LoadedModel:
    """A model version ready to serve."""

    entry: ModelEntry
    runtime: OnnxRuntime

    @property
    def version(self) -> str:
        return self.entry.manifest.model_version

    @property
    def feature_version(self) -> str:
        return self.entry.manifest.versions.feature_schema_version


class InferenceEngine:
    """Loads model versions from the repository and runs validated requests on them."""

    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        self._models: dict[str, dict[str, LoadedModel]] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="runtime")
        self.ready = False

    # -- lifecycle -------------------------------------------------------------------------

    def discover(self) -> list[Path]:
        """Entry folders to load: the latest version of each configured (or found) model."""
        root = self.settings.model_repository
        names = self.settings.models
        if not names and root.is_dir():
            names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        found = []
        for name in names:
            versions = list_versions(root, name)
            if versions:
                found.append(root / name / str(versions[-1]))
            elif self.settings.models:
                raise ModelNotFound(f"model {name!r} has no versions under {root}")
        return found

    def load(self) -> None:
        """Loads, verifies and warms every model :meth:`discover` finds (blocking).

        Raises:
            ManifestError: an entry's version triple or files are inconsistent.
            ModelNotFound: a configured model is missing, or the repository has no models.
        """
        entries = self.discover()
        if not entries:
            raise ModelNotFound(f"no models found under {self.settings.model_repository}")
        for path in entries:
            started = time.perf_counter()
            entry = load_entry(path)
            runtime = OnnxRuntime(entry.model_path, provider=self.settings.execution_provider,
                                  intra_op_threads=self.settings.intra_op_threads,
                                  graph_optimization=self.settings.graph_optimization)
            model = LoadedModel(entry, runtime)
            self._warm_up(model)
            name = entry.manifest.model_name
            self._models.setdefault(name, {})[model.version] = model
            metrics.MODEL_LOAD_DURATION.labels(name, model.version).observe(time.perf_counter() - started)
            metrics.MODEL_READY.labels(name, model.version).set(1)
            logger.info("model %s version %s ready (%s, triple %s)", name, model.version,
                        runtime.description, entry.manifest.versions.model_dump())
        self.ready = True

    def _warm_up(self, model: LoadedModel) -> None:
        """Runs the model once at batch 1 and at max batch so first requests pay no set-up cost.

        Raises:
            ModelFailure: the warm-up output has the wrong shape or is not finite.
        """
        n = model.entry.manifest.n_features
        for rows in (1, self.settings.max_batch_size):
            logits = model.runtime.run(np.zeros((rows, n), dtype=np.float32))
            self._check_output(model, logits, rows)

    def close(self) -> None:
        """Stops accepting work; running executions finish."""
        self.ready = False
        self._executor.shutdown(wait=True)

    # -- serving ---------------------------------------------------------------------------

    def model(self, name: str, version: str = "") -> LoadedModel:
        """The loaded model for ``name`` and ``version`` (empty = latest).

        Raises:
            ModelNotReady: nothing is loaded yet. ModelNotFound: unknown model or version,
            naming what is available.
        """
        if not self.ready:
            raise ModelNotReady("models are not loaded yet; retry after readiness")
        versions = self._models.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model {name!r}; available: {', '.join(sorted(self._models)) or 'none'}",
                                metadata={"model": name})
        if not version:
            return versions[max(versions, key=int)]
        if version not in versions:
            available = ", ".join(sorted(versions, key=int))
            raise ModelNotFound(f"model {name!r} has no version {version!r}; available: {available}",
                                metadata={"model": name, "available_versions": available})
        return versions[version]

    def models(self) -> dict[str, list[str]]:
        """Model name → ready versions, ascending."""
        return {name: sorted(v, key=int) for name, v in self._models.items()}

    async def infer(self, name: str, version: str, feature_version: str | None, tensor: TensorIn) -> InferResult:
        """Validates and runs one request, recording its outcome and latency.

        Args:
            name, version: model and version (empty = latest).
            feature_version: the caller's ``x-feature-version``; None when absent.
            tensor: ``[batch, n_features]`` FP32 raw bytes.

        Raises:
            ModelNotReady, ModelNotFound, FeatureVersionMismatch, InvalidInput, ModelFailure.
        """
        started = time.perf_counter()
        # Label by loaded names only: a client-chosen name must not create new time series.
        label_name = name if name in self._models else "unknown"
        label_version, code = version or "latest", "OK"
        try:
            result = await self._infer(name, version, feature_version, tensor)
            label_version = result.model_version
            return result
        except ServiceError as exc:
            code = exc.code
            raise
        finally:
            metrics.REQUESTS.labels(label_name, label_version, code).inc()
            metrics.REQUEST_DURATION.labels(label_name, label_version).observe(time.perf_counter() - started)

    async def _infer(self, name: str, version: str, feature_version: str | None, tensor: TensorIn) -> InferResult:
        checks_started = time.perf_counter()
        model = self.model(name, version)
        check_feature_version(model.feature_version, feature_version)
        x = decode_features(tensor, model.entry.manifest.n_features, self.settings.max_batch_size)
        logs.record_stage("validate", time.perf_counter() - checks_started)
        if x.shape[0] == 0:
            return InferResult(name, model.version, np.zeros((0, len(model.entry.manifest.class_names)), np.float32))
        started = time.perf_counter()
        try:
            logits = await asyncio.get_running_loop().run_in_executor(self._executor, model.runtime.run, x)
        except Exception as exc:
            logger.exception("runtime failed for %s version %s", name, model.version)
            raise ModelFailure("the model failed to run") from exc
        compute_s = time.perf_counter() - started
        metrics.COMPUTE_DURATION.labels(name, model.version).observe(compute_s)
        logs.record_stage("compute", compute_s)
        metrics.ROWS.labels(name, model.version).observe(x.shape[0])
        self._check_output(model, logits, x.shape[0])
        return InferResult(name, model.version, logits)

    @staticmethod
    def _check_output(model: LoadedModel, logits: np.ndarray, rows: int) -> None:
        """Refuses output with the wrong row count or non-finite values (never an empty success)."""
        if logits.ndim != 2 or logits.shape[0] != rows:
            raise ModelFailure("the model returned the wrong number of rows")
        if not np.isfinite(logits).all():
            name = model.entry.manifest.model_name
            metrics.NONFINITE_OUTPUTS.labels(name, model.version).inc()
            raise ModelFailure("the model produced a non-finite logit")


def check_feature_version(expected: str, received: str | None) -> None:
    """The version contract: the caller's feature schema version must equal the model's.

    Raises:
        FeatureVersionMismatch: missing or different, naming both versions.
    """
    if received is None:
        raise FeatureVersionMismatch(
            f"missing x-feature-version metadata; this model expects feature version {expected!r}",
            metadata={"expected": expected, "received": ""})
    if received != expected:
        raise FeatureVersionMismatch(
            f"feature version mismatch: the model expects {expected!r}, the request declares {received!r}",
            metadata={"expected": expected, "received": received})


def decode_features(tensor: TensorIn, n_features: int, max_rows: int) -> np.ndarray:
    """Validates a raw tensor and returns it as ``[batch, n_features] float32`` (a zero-copy view).

    ``[0, n_features]`` is valid and yields an empty result.

    Raises:
        InvalidInput: with a message naming what is wrong (dtype, shape, byte size, NaN/Inf cells).
    """
    if tensor.data_type != "FP32":
        raise InvalidInput(f"expected FP32, got {tensor.data_type or 'no data type'}")
    shape = tensor.shape
    if len(shape) != 2:
        raise InvalidInput(f"expected shape [batch, {n_features}], got {list(shape)}")
    rows, cols = shape
    if rows < 0 or cols < 0:
        raise InvalidInput(f"shape dimensions must be non-negative, got {list(shape)}")
    if cols != n_features:
        raise InvalidInput(f"expected {n_features} features per row, got {cols}")
    if rows > max_rows:
        raise InvalidInput(f"{rows} rows exceed the limit of {max_rows} per request; split the request")
    expected_bytes = rows * cols * 4
    if len(tensor.content) != expected_bytes:
        raise InvalidInput(f"shape {list(shape)} FP32 needs {expected_bytes} bytes, got {len(tensor.content)}")
    x = np.frombuffer(tensor.content, dtype="<f4").reshape(rows, cols)
    if not np.isfinite(x).all():
        cells = np.argwhere(~np.isfinite(x))[:MAX_REPORTED_CELLS]
        named = ", ".join(f"row {r} column {c}" for r, c in cells)
        raise InvalidInput(f"input has NaN or Inf at {named}")
    return x
