"""The client PredictionService uses to call InferenceService.

It sends raw little-endian float32 bytes, a per-call deadline, and ``x-feature-version`` as a
lower-case metadata key (HTTP/2 requires lower case; the test suite asserts it). The one
private call helper turns ``grpc.RpcError`` into this service's own typed errors.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.prediction.errors import InferenceContractError, InferenceFailed, InferenceUnavailable
from mlpair.rpc import error_info, message_size_options, open_channel

logger = logging.getLogger(__name__)

FEATURE_VERSION_KEY = "x-feature-version"
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
_CONTRACT = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}


class InferenceClient:
    """Async InferenceService client over one shared channel (TLS when ``credentials`` are given)."""

    def __init__(self, target: str, *, timeout_ms: int, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self._channel = open_channel(target, message_size_options(max_message_bytes), credentials)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._timeout_s = timeout_ms / 1000.0

    async def close(self) -> None:
        await self._channel.close()

    async def infer(self, model_name: str, model_version: str, feature_version: str,
                    features: np.ndarray) -> tuple[np.ndarray, str]:
        """Logits for ``features`` ``[batch, n_features] float32``.

        Returns:
            Logits ``[batch, n_classes] float32`` and the model version that served them.

        Raises:
            InferenceUnavailable: down, overloaded or past the deadline.
            InferenceContractError: the version contract was refused (no decision on this vector).
            InferenceFailed: any other failure.
        """
        x = np.ascontiguousarray(features, dtype="<f4")
        request = pb.InferRequest(
            model_name=model_name, model_version=model_version,
            inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()),
        )
        response = await self._call(self._stub.Infer, request, ((FEATURE_VERSION_KEY, feature_version),))
        out = response.logits
        if out.data_type != pb.DATA_TYPE_FP32 or len(out.shape) != 2 or out.shape[0] != x.shape[0] \
                or len(out.content) != out.shape[0] * out.shape[1] * 4:
            raise InferenceFailed("InferenceService returned a malformed logits tensor")
        return np.frombuffer(out.content, dtype="<f4").reshape(tuple(out.shape)), response.model_version

    async def _call(self, method, request, metadata):
        try:
            return await method(request, timeout=self._timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            info = error_info(exc)
            reason = info.reason if info else ""
            logger.warning("Infer failed: %s %s", code.name, reason)
            if code in _UNAVAILABLE:
                raise InferenceUnavailable("the inference service is unavailable; retry later") from exc
            if code in _CONTRACT:
                raise InferenceContractError(
                    "the inference service refused the feature/model version contract; no decision was made",
                    metadata={"inference_code": code.name, "inference_reason": reason}) from exc
            raise InferenceFailed("inference failed") from exc
