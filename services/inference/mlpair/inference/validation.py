"""Checks every request passes before it may join a batch: version contract, then the tensor.

Transport-neutral: both the project's own API and the Open Inference Protocol convert their
messages into :class:`TensorIn` and run the same checks, so they refuse the same inputs with
the same messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlpair.inference.errors import FeatureVersionMismatch, InvalidInput

# Element sizes (bytes) of every data type the Open Inference Protocol names; only FP32 is
# accepted as model input, the rest are recognised so the error can say what arrived.
ITEM_SIZE = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
    "BYTES": 0,
}
MAX_REPORTED_CELLS = 5  # non-finite cells named in one error message
SMALL_ARRAY = 256  # values up to which all_finite sums in Python rather than calling numpy


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of a float array is finite (no NaN, no ±Inf).

    A small float32 array (a single-row request: 30 features, or its 2 logits) is summed as
    Python floats instead: float32 values summed in float64 cannot overflow (the largest float32
    is 3.4e38; it would take 5e269 of them to reach float64's limit), so the sum is finite exactly
    when every value is, and it costs a fraction of ``np.isfinite(x).all()``, whose cost is nearly
    all per-call overhead at this size (docs/decisions/0004). Larger or wider arrays go to numpy.
    """
    if x.size <= SMALL_ARRAY and x.dtype.itemsize <= 4 and x.dtype.kind == "f":
        return math.isfinite(sum(x.ravel().tolist()))
    return bool(np.isfinite(x).all())


@dataclass(frozen=True, slots=True)
class TensorIn:
    """An input tensor as it arrived, before any check.

    Attributes:
        data_type: OIP type name, e.g. "FP32" ("" when the caller named none).
        shape: dimensions as sent.
        content: raw little-endian row-major bytes, or None when ``values`` carries the data.
        values: typed elements (OIP ``fp32_contents``), or None for raw bytes.
        name: the input's name ("" when the protocol has none, as in the project's own API).
    """

    data_type: str
    shape: tuple[int, ...]
    content: bytes | None = None
    values: Sequence[float] | None = None
    name: str = ""


def check_feature_version(expected: str, received: str | None) -> None:
    """The version contract: the caller's feature schema version must equal the model's.

    Raises:
        FeatureVersionMismatch: missing or different, naming both versions.
    """
    if received is None or received == "":
        raise FeatureVersionMismatch(
            f"missing x-feature-version; this model expects feature version {expected!r}",
            metadata={"expected": expected, "received": ""},
        )
    if received != expected:
        raise FeatureVersionMismatch(
            f"feature version mismatch: the model expects {expected!r}, the request declares {received!r}",
            metadata={"expected": expected, "received": received},
        )


def decode_features(tensor: TensorIn, n_features: int, max_rows: int) -> np.ndarray:
    """Validates a tensor and returns it as ``[batch, n_features] float32``.

    Raw bytes become a zero-copy read-only view. ``[0, n_features]`` is valid (empty result).

    Args:
        tensor: the input as it arrived.
        n_features: the model's row width.
        max_rows: most rows one request may carry (``max_request_rows``).

    Raises:
        InvalidInput: naming what is wrong: data type, shape, byte or element count, NaN/Inf cells.
    """
    data_type = tensor.data_type
    if data_type != "FP32":
        if data_type in ITEM_SIZE:
            raise InvalidInput(f"expected FP32, got {data_type}")
        raise InvalidInput(
            f"unknown datatype {data_type!r}; this model takes FP32"
            if data_type
            else "missing datatype; this model takes FP32"
        )
    shape = tensor.shape
    if len(shape) != 2:
        raise InvalidInput(f"expected shape [batch, {n_features}], got {list(shape)}")
    rows, cols = shape
    if rows < 0 or cols < 0:
        raise InvalidInput(f"shape dimensions must be non-negative, got {list(shape)}")
    if cols != n_features:
        raise InvalidInput(f"expected {n_features} features per row, got {cols}")
    if rows > max_rows:
        raise InvalidInput(f"{rows} rows exceed the limit of {max_rows} rows per request; split the request")
    if tensor.content is not None:
        x = _from_bytes(tensor.content, rows, cols)
    else:
        x = _from_values(tensor.values or (), rows, cols)
    if not all_finite(x):
        cells = np.argwhere(~np.isfinite(x))[:MAX_REPORTED_CELLS]
        named = ", ".join(f"row {r} column {c}" for r, c in cells)
        raise InvalidInput(f"input has NaN or Inf at {named}")
    return x


def _from_bytes(content: bytes, rows: int, cols: int) -> np.ndarray:
    size = len(content)
    expected = rows * cols * 4
    if size % 4:
        raise InvalidInput(
            f"FP32 payload of {size} bytes is not a multiple of 4 bytes; shape {[rows, cols]} needs {expected} bytes"
        )
    if size != expected:
        raise InvalidInput(f"shape {[rows, cols]} FP32 needs {expected} bytes, got {size}")
    return np.frombuffer(content, dtype="<f4").reshape(rows, cols)


def _from_values(values: Sequence[float], rows: int, cols: int) -> np.ndarray:
    expected = rows * cols
    if len(values) != expected:
        raise InvalidInput(f"shape {[rows, cols]} needs {expected} FP32 values, got {len(values)}")
    return np.asarray(values, dtype=np.float32).reshape(rows, cols)
