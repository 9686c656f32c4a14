"""The client PredictionService uses to call InferenceService.

It sends raw little-endian float32 bytes, a per-call deadline, and ``x-feature-version`` as a
lower-case metadata key (HTTP/2 requires lower case; the test suite asserts it). The one
private call helper turns ``grpc.RpcError`` into this service's own typed errors. Calls never
wait for a broken connection (no ``wait_for_ready``): while InferenceService is down they fail
at once with :class:`InferenceUnavailable`, so the caller can fall back inside its budget.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.contracts import FEATURE_VERSION_KEY
from mlpair.contracts.target import ModelTarget
from mlpair.observability.calls import Caller, CallTracer
from mlpair.prediction import metrics
from mlpair.prediction.errors import (
    InferenceContractError,
    InferenceFailed,
    InferenceOverloaded,
    InferenceTimeout,
    InferenceUnavailable,
    PredictionError,
)
from mlpair.rpc import client_keepalive_options, error_info, message_size_options, open_channel

logger = logging.getLogger(__name__)

SERVICE = "mlpair.inference.v1.InferenceService"
RATE_LIMITED_HEADER = "x-mlpair-rate-limited"  # added by the mesh's local rate limit (deploy/istio)
_CONTRACT = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}
# InferenceService's ErrorInfo reasons (services/inference/mlpair/inference/errors.py, engine.py, health)
MODEL_FAILURE = "MODEL_FAILURE"
MODEL_UNHEALTHY = "MODEL_UNHEALTHY"
NON_FINITE_OUTPUT = "NON_FINITE_OUTPUT"
# Client-side balancing (load_balancing="round_robin"): gRPC's round_robin policy over every address
# the target resolves to, and gRPC client-side health checking (gRFC A17): each address's
# grpc.health.v1 Watch for this name keeps it in the rotation only while SERVING.
_ROUND_ROBIN_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE}}
)
# gRPC's own RESOURCE_EXHAUSTED texts for its size limits (grpc-core, chttp2 and message_size filters)
_SIZE_TEXTS = (
    ("message_size", ("message larger than max",)),
    ("metadata_size", ("metadata size exceeds", "header size exceeds", "header list size")),
)


def classify(exc: grpc.RpcError) -> tuple[str, PredictionError]:
    """A failed Infer call's cause (a metric label) and the error it becomes, by what it means.

    **Inference-side faults** — the replica that took the call could not answer it, and another
    replica may — become :class:`InferenceUnavailable`: they count against the circuit breaker,
    lead to a stale result or the fallback (REVIEW, flagged and recorded), and the retryable ones
    are tried once more (:class:`~mlpair.prediction.scoring.resilience.ResilientCaller`; each
    attempt is a new pick of the channel's balancer or of the mesh, so another replica):

    * UNAVAILABLE (retryable): ``model_unhealthy`` when InferenceService took the model version
      out after consecutive runtime failures (ErrorInfo reason ``MODEL_UNHEALTHY``), else
      ``unavailable`` (no connection, a reset connection, draining, not ready: the call reached
      no model);
    * INTERNAL (retryable): ``model_failure`` when the model's batch failed on that replica
      (reason ``MODEL_FAILURE``: a runtime error, CUDA error or out-of-memory), ``internal`` for
      any other INTERNAL (an unexpected server error, a stream reset by HTTP/2 ``INTERNAL_ERROR``);
      UNKNOWN (``unknown``: a handler raised outside the server's own errors) likewise;
    * CANCELLED by the server (``cancelled``) and DEADLINE_EXCEEDED (``timeout``): not retried
      (the time is spent).

    Not inference-side, so never retried and never a fallback:

    * RESOURCE_EXHAUSTED is load shed — InferenceService's queue is full (``queue_full``), the
      mesh's rate limit refused the call (``rate_limited``, its reply header) or another proxy
      did (``resource_exhausted``) — and becomes :class:`InferenceOverloaded`: the callers get
      RESOURCE_EXHAUSTED to retry later, nothing is recorded, and the breaker does not count it
      (the service is up) — unless gRPC's message or metadata size limit refused the call
      (``message_size``, ``metadata_size``: a retry would meet the same limit).
    * INVALID_ARGUMENT (``invalid_argument``: this side built a tensor the model refuses) and a
      whole call refused for non-finite output (``non_finite_output``: reason ``MODEL_FAILURE``
      with ErrorInfo metadata ``reason=NON_FINITE_OUTPUT``) are :class:`InferenceFailed`
      (INTERNAL). Non-finite output is a property of these rows under this model version, the
      same on every replica, so a retry elsewhere would only repeat it; this client asks for
      ``per_row_errors``, under which InferenceService reports such rows one by one (each then
      decided as invalid output, services/inference/mlpair/inference/engine.py), so a whole call refused for it
      means a server that ignored the request's contract. Any other code is ``other``, also
      :class:`InferenceFailed`.
    * A refused version contract (FAILED_PRECONDITION, NOT_FOUND) is
      :class:`InferenceContractError` (``contract``).
    """
    code = exc.code()
    info = error_info(exc)
    reason = info.reason if info else ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout", InferenceTimeout("the inference call ran out of its deadline")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        error = InferenceUnavailable(
            "the inference service is unavailable; retry later", metadata={"inference_code": code.name}
        )
        error.retryable = code == grpc.StatusCode.UNAVAILABLE
        cause = "model_unhealthy" if reason == MODEL_UNHEALTHY else code.name.lower()
        return cause, error
    if code == grpc.StatusCode.INTERNAL and not (info and info.metadata.get("reason") == NON_FINITE_OUTPUT):
        return _replica_fault("model_failure" if reason == MODEL_FAILURE else "internal", code)
    if code == grpc.StatusCode.UNKNOWN:
        return _replica_fault("unknown", code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = (exc.details() or "").lower()
        if size := next((c for c, texts in _SIZE_TEXTS if any(t in details for t in texts)), None):
            return size, InferenceFailed("inference failed")  # a retry would hit the same limit
        cause = (
            "queue_full" if reason == "QUEUE_FULL" else "rate_limited" if _rate_limited(exc) else "resource_exhausted"
        )
        return cause, InferenceOverloaded(
            "the inference service is shedding load; nothing was decided or recorded: retry later with backoff",
            metadata={"cause": cause},
        )
    if code in _CONTRACT:
        return "contract", InferenceContractError(
            "the inference service refused the feature/model version contract; no decision was made",
            metadata={"inference_code": code.name, "inference_reason": reason},
        )
    cause = {grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument", grpc.StatusCode.INTERNAL: "non_finite_output"}.get(
        code, "other"
    )
    return cause, InferenceFailed("inference failed")


def _replica_fault(cause: str, code: grpc.StatusCode) -> tuple[str, InferenceUnavailable]:
    """An error of the replica that took the call: retryable on another, else the fallback."""
    error = InferenceUnavailable(
        "the inference service failed to answer; retry later", metadata={"inference_code": code.name}
    )
    error.retryable = True
    return cause, error


def _rate_limited(exc: grpc.RpcError) -> bool:
    """Whether the mesh's rate limit, not InferenceService, refused the call (its reply header)."""
    metadata: Sequence[tuple[str, str | bytes]] | None  # what a grpc.aio error carries, if anything
    for metadata in (getattr(exc, "initial_metadata", tuple)(), getattr(exc, "trailing_metadata", tuple)()):
        if any(key.lower() == RATE_LIMITED_HEADER for key, _ in metadata or ()):
            return True
    return False


class InferenceClient:
    """Async InferenceService client over one shared channel.

    Args:
        target: InferenceService as a gRPC target name: ``host:port`` (one connection, as
            gRPC's default ``pick_first`` keeps, e.g. to a Service behind the mesh, which balances
            per call), or several replicas: ``dns:///name:port`` (every address a DNS name
            resolves to, e.g. a headless Service) or ``ipv4:host:port,host:port,...``.
        load_balancing: ``pick_first`` (gRPC's default) or ``round_robin``: each call goes to the
            next replica whose ``grpc.health.v1`` status for ``mlpair.inference.v1.InferenceService``
            is SERVING (gRPC client-side health checking, a Watch per replica), so a replica that
            turns NOT_SERVING leaves the rotation with its next health update and comes back with
            the one after it recovers; a retry (a new call) goes to the next replica.
        timeout_ms: deadline of a call that names none.
        max_message_bytes: gRPC message limit, both directions.
        reconnect_backoff_max_ms: longest wait between reconnection attempts after the server
            went away (gRPC's default of 120 s would delay recovery by minutes).
        keepalive_ms, keepalive_timeout_ms: ping the server every ``keepalive_ms`` (with or without
            calls; 0 = never) and drop the connection when a ping goes unanswered for
            ``keepalive_timeout_ms`` (:func:`mlpair.rpc.channels.client_keepalive_options`).
            InferenceService accepts pings every ``keepalive_min_ping_interval_ms`` (1 s by default).
        credentials: TLS to InferenceService when given, else plaintext.
        tracer: opens each call's CLIENT span and adds its trace context and the request id to the
            metadata (:class:`mlpair.observability.calls.CallTracer`); None = no tracing.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_ms: int,
        max_message_bytes: int,
        reconnect_backoff_max_ms: int = 1000,
        credentials: grpc.ChannelCredentials | None = None,
        tracer: CallTracer | None = None,
        keepalive_ms: int = 0,
        keepalive_timeout_ms: int = 5000,
        load_balancing: str = "pick_first",
    ) -> None:
        if load_balancing not in ("pick_first", "round_robin"):
            raise ValueError(f"load_balancing must be pick_first or round_robin, not {load_balancing!r}")
        options: list[tuple[str, int | str]] = [
            *message_size_options(max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_backoff_max_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, reconnect_backoff_max_ms)),
            ("grpc.max_reconnect_backoff_ms", reconnect_backoff_max_ms),
            *client_keepalive_options(keepalive_ms, keepalive_timeout_ms),
        ]
        if load_balancing == "round_robin":
            options.append(("grpc.service_config", _ROUND_ROBIN_CONFIG))
        self._channel = open_channel(target, options, credentials)
        self._tracer = tracer
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout_s = timeout_ms / 1000.0

    async def close(self) -> None:
        """Closes the channel to InferenceService; calls still in flight are cancelled."""
        await self._channel.close()

    async def infer(
        self,
        target: ModelTarget,
        features: np.ndarray,
        *,
        timeout_s: float | None = None,
        callers: Sequence[Caller] | None = None,
        priority: int = 0,
    ) -> tuple[np.ndarray, str]:
        """Logits for ``features`` ``[batch, n_features] float32`` from ``target``'s model.

        Args:
            timeout_s: deadline of this call in seconds; None uses the client's default.
            callers: the callers whose rows the call carries (its span links to each; a call for
                several carries no single caller's request id); None = the running request's.
            priority: InferenceService's batch-queue level for the call (``InferRequest.priority``):
                1 the highest, 0 = InferenceService's default level.

        Returns:
            Logits ``[batch, n_classes] float32`` and the model version that served them. A row
            InferenceService reports as a row error (its output was unusable) is all NaN here:
            it fails that row alone, never the call.

        Raises:
            InferenceTimeout: the deadline passed (DEADLINE_EXCEEDED).
            InferenceUnavailable: down; ``retryable`` is true for UNAVAILABLE.
            InferenceOverloaded: InferenceService (or the mesh) shed the call: retry later.
            InferenceContractError: the version contract was refused (no decision on this vector).
            InferenceFailed: any other failure (see :func:`classify`).
        """
        x = np.ascontiguousarray(features, dtype="<f4")
        request = pb.InferRequest(
            model_name=target.name,
            model_version=target.version,
            inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()),
            per_row_errors=True,  # rows of many callers share a call: one row's output must fail no other
            priority=priority,
        )
        timeout = self._timeout_s if timeout_s is None else timeout_s
        response = await self._call(
            self._stub.Infer, request, ((FEATURE_VERSION_KEY, target.feature_version),), timeout, callers
        )
        out = response.logits
        if (
            out.data_type != pb.DATA_TYPE_FP32
            or len(out.shape) != 2
            or out.shape[0] != x.shape[0]
            or len(out.content) != out.shape[0] * out.shape[1] * 4
        ):
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
        """Whether InferenceService answers ``grpc.health.v1`` with SERVING within ``timeout_s``
        (under ``round_robin``: whether any replica in the rotation does — a replica that is not
        SERVING is out of it, and with none left the call fails at once)."""
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
            cause, error = classify(exc)
            metrics.labelled(metrics.INFERENCE_ERRORS, request.model_name, cause).inc()
            if isinstance(error, InferenceFailed):
                logger.warning("Infer failed: %s (%s)", exc.code().name, cause)
            else:
                logger.debug("Infer failed: %s (%s)", exc.code().name, cause)
            raise error from exc
