"""The client PredictionService uses to call InferenceService.

It sends raw little-endian float32 bytes, a per-call deadline, and ``x-feature-version`` as a
lower-case metadata key (HTTP/2 requires lower case; the test suite asserts it). The one
private call helper turns ``grpc.RpcError`` into this service's own typed errors. Calls never
wait for a broken connection (no ``wait_for_ready``): while InferenceService is down they fail
at once with :class:`InferenceUnavailable`, so the caller can fall back inside its budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.observability.calls import CallTracer, Caller
from mlpair.prediction.errors import InferenceContractError, InferenceFailed, InferenceTimeout, InferenceUnavailable
from mlpair.rpc import error_info, message_size_options, open_channel

logger = logging.getLogger(__name__)

FEATURE_VERSION_KEY = "x-feature-version"
SERVICE = "mlpair.inference.v1.InferenceService"
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
# Only UNAVAILABLE is safe and useful to retry: the call did not reach a model (gRPC's own
# guidance); RESOURCE_EXHAUSTED means the server is shedding load and a retry would add to it.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_CONTRACT = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}


class InferenceClient:
    """Async InferenceService client over one shared channel.

    Args:
        target: ``host:port`` of InferenceService.
        timeout_ms: deadline of a call that names none.
        max_message_bytes: gRPC message limit, both directions.
        reconnect_backoff_max_ms: longest wait between reconnection attempts after the server
            went away (gRPC's default of 120 s would delay recovery by minutes).
        credentials: TLS to InferenceService when given, else plaintext.
        tracer: opens each call's CLIENT span and adds its trace context and the request id to the
            metadata (:class:`mlpair.observability.calls.CallTracer`); None = no tracing.
    """

    def __init__(self, target: str, *, timeout_ms: int, max_message_bytes: int,
                 reconnect_backoff_max_ms: int = 1000, credentials: grpc.ChannelCredentials | None = None,
                 tracer: CallTracer | None = None) -> None:
        options = [*message_size_options(max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_backoff_max_ms)),
                   ("grpc.min_reconnect_backoff_ms", min(100, reconnect_backoff_max_ms)),
                   ("grpc.max_reconnect_backoff_ms", reconnect_backoff_max_ms)]
        self._channel = open_channel(target, options, credentials)
        self._tracer = tracer
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout_s = timeout_ms / 1000.0

    async def close(self) -> None:
        await self._channel.close()

    async def infer(self, model_name: str, model_version: str, feature_version: str,
                    features: np.ndarray, *, timeout_s: float | None = None,
                    callers: Sequence[Caller] | None = None) -> tuple[np.ndarray, str]:
        """Logits for ``features`` ``[batch, n_features] float32``.

        Args:
            timeout_s: deadline of this call in seconds; None uses the client's default.
            callers: the callers whose rows the call carries (its span links to each; a call for
                several carries no single caller's request id); None = the running request's.

        Returns:
            Logits ``[batch, n_classes] float32`` and the model version that served them. A row
            InferenceService reports as a row error (its output was unusable) is all NaN here:
            it fails that row alone, never the call.

        Raises:
            InferenceTimeout: the deadline passed (DEADLINE_EXCEEDED).
            InferenceUnavailable: down or overloaded; ``retryable`` is true for UNAVAILABLE.
            InferenceContractError: the version contract was refused (no decision on this vector).
            InferenceFailed: any other failure.
        """
        x = np.ascontiguousarray(features, dtype="<f4")
        request = pb.InferRequest(
            model_name=model_name, model_version=model_version,
            inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()),
            per_row_errors=True,  # rows of many callers share a call: one row's output must fail no other
        )
        timeout = self._timeout_s if timeout_s is None else timeout_s
        response = await self._call(self._stub.Infer, request, ((FEATURE_VERSION_KEY, feature_version),), timeout,
                                    callers)
        out = response.logits
        if out.data_type != pb.DATA_TYPE_FP32 or len(out.shape) != 2 or out.shape[0] != x.shape[0] \
                or len(out.content) != out.shape[0] * out.shape[1] * 4:
            raise InferenceFailed("InferenceService returned a malformed logits tensor")
        logits = np.frombuffer(out.content, dtype="<f4").reshape(tuple(out.shape))
        if response.row_errors:
            logits = logits.copy()
            for error in response.row_errors:
                if not 0 <= error.row < len(logits):
                    raise InferenceFailed("InferenceService named a row error outside the request")
                logits[error.row] = np.nan  # no usable output: judged per row by the caller
        return logits, response.model_version

    async def ready(self, timeout_s: float) -> bool:
        """Whether InferenceService answers ``grpc.health.v1`` with SERVING within ``timeout_s``."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _call(self, method, request, metadata, timeout: float, callers: Sequence[Caller] | None = None):
        try:
            if self._tracer is None:
                return await method(request, timeout=timeout, metadata=metadata)
            with self._tracer.call(SERVICE, "Infer", metadata, callers) as traced:
                return await method(request, timeout=timeout, metadata=traced)
        except grpc.RpcError as exc:
            code = exc.code()
            info = error_info(exc)
            reason = info.reason if info else ""
            logger.debug("Infer failed: %s %s", code.name, reason)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise InferenceTimeout("the inference call ran out of its deadline") from exc
            if code in _UNAVAILABLE:
                error = InferenceUnavailable("the inference service is unavailable; retry later",
                                             metadata={"inference_code": code.name})
                error.retryable = code in _RETRYABLE
                raise error from exc
            if code in _CONTRACT:
                raise InferenceContractError(
                    "the inference service refused the feature/model version contract; no decision was made",
                    metadata={"inference_code": code.name, "inference_reason": reason}) from exc
            logger.warning("Infer failed: %s %s", code.name, reason)
            raise InferenceFailed("inference failed") from exc
