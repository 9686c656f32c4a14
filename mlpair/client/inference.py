"""InferenceService from Python: :func:`infer_logits`; see :mod:`mlpair.client`."""

from __future__ import annotations

import grpc
import numpy as np

from mlpair.api.inference.v1 import inference_service_pb2 as inference_pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as inference_grpc
from mlpair.client.channels import DEFAULT_TIMEOUT_S, open_channel

# The metadata key of the caller's feature schema version: mlpair.contracts.FEATURE_VERSION_KEY, which
# the client-only distribution (clients/python) does not ship; tests/test_client_install.py keeps the
# two equal.
FEATURE_VERSION_KEY = "x-feature-version"

# Rows per Infer call: well under InferenceService's default max_request_rows (8192, above which it
# refuses a call), and a message far under the 16 MiB limit (about 100 KB at churn's 49 features);
# the server splits each call into batches of its max_batch_size (default 128 rows) itself.
INFER_ROWS_PER_CALL = 512
INFER_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def infer_logits(
    target: str,
    model_name: str,
    model_version: str,
    feature_version: str,
    features: np.ndarray,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
    rows_per_call: int = INFER_ROWS_PER_CALL,
) -> tuple[np.ndarray, str]:
    """Raw logits of InferenceService for assembled feature rows (``InferenceService.Infer``), in
    calls of at most ``rows_per_call`` rows over one channel. Zero rows still make one call (an
    empty ``[0, n_features]`` tensor), so the model, version, feature version and column count are
    checked and the logits' shape is the server's, as for any other input.

    Args:
        model_version: the version to run; empty = the repository's latest.
        feature_version: the feature schema version the rows were assembled with (the manifest's
            ``versions.feature_schema_version``), sent as ``x-feature-version``: InferenceService
            refuses rows of another version.
        features: ``[rows, n_features] float32`` (other dtypes are converted).
        timeout_s: deadline of each call, in seconds.

    Returns:
        Logits ``[rows, n_classes] float32`` (``[0, n_classes]`` for zero rows) and the model
        version that computed them.

    Raises:
        grpc.RpcError: INVALID_ARGUMENT (wrong shape or non-finite values), NOT_FOUND (unknown model
            or version), FAILED_PRECONDITION (the feature version disagrees with the model's),
            RESOURCE_EXHAUSTED (queue full: retry later), UNAVAILABLE (down or not yet SERVING),
            DEADLINE_EXCEEDED, INTERNAL (the model failed).
        ValueError: the reply's logits tensor is malformed.
    """
    x = np.ascontiguousarray(features, dtype="<f4")
    if x.ndim != 2:
        raise ValueError(f"features must be [rows, n_features], got shape {x.shape}")
    sizes = [(f"grpc.max_{way}_message_length", INFER_MAX_MESSAGE_BYTES) for way in ("send", "receive")]
    parts, version = [], model_version
    with open_channel(target, credentials, sizes) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        for start in range(0, max(len(x), 1), rows_per_call):  # one call, with no rows, for zero rows
            chunk = x[start : start + rows_per_call]
            request = inference_pb.InferRequest(
                model_name=model_name,
                model_version=model_version,
                inputs=inference_pb.Tensor(
                    data_type=inference_pb.DATA_TYPE_FP32, shape=chunk.shape, content=chunk.tobytes()
                ),
            )
            reply = stub.Infer(request, timeout=timeout_s, metadata=((FEATURE_VERSION_KEY, feature_version),))
            out = reply.logits
            if out.data_type != inference_pb.DATA_TYPE_FP32 or len(out.shape) != 2 or out.shape[0] != len(chunk):
                raise ValueError("InferenceService returned a malformed logits tensor")
            if len(out.content) != out.shape[0] * out.shape[1] * 4:
                raise ValueError("InferenceService returned a logits tensor of the wrong byte size")
            parts.append(np.frombuffer(out.content, dtype="<f4").reshape(tuple(out.shape)))
            version = reply.model_version
    return np.concatenate(parts), version
