"""gRPC interceptors that give every RPC its trace span, log context and (for Infer) its log line.

Server side, in this order (outermost first), before ``mlpair.rpc.ErrorInterceptor``:

1. OpenTelemetry's aio server interceptor: extracts the caller's W3C ``traceparent`` and opens
   the SERVER span (health checks are not traced).
2. :class:`RequestContextInterceptor`: sets the :class:`mlpair.logs.RequestContext` (layer,
   request id, model version) that every log line of the call carries; for InferenceService
   it writes the one DEBUG line per call with the inference id, input fingerprint, batch id
   and timings per stage.

Client side (PredictionService → InferenceService): OpenTelemetry's aio client interceptor
(CLIENT span, ``traceparent`` injected) and :class:`RequestIdClientInterceptor`, which passes
the business request id on as ``x-request-id`` so both layers' lines share it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace

from mlpair import logs

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
HEALTH_SERVICE = "grpc.health.v1.Health"
MAX_REQUEST_ID_LENGTH = 128


def server_interceptors(layer: str, tracer_provider: trace.TracerProvider | None = None, *,
                        log_calls: bool = False) -> list[grpc.aio.ServerInterceptor]:
    """The observability interceptors for a server, to put before the ErrorInterceptor.

    Args:
        layer: ``inference`` or ``prediction``.
        tracer_provider: where spans go; None = the global provider (set in ``main()``).
        log_calls: write one DEBUG (or sampled) line per call, as InferenceService does.
    """
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=tracer_provider, filter_=_not_health_check),
            RequestContextInterceptor(layer, log_calls=log_calls)]


def _not_health_check(call_details) -> bool:
    # A plain prefix test: the instrumentation's own service_name() filter parses metadata per call.
    # Server details carry the method as str; client call details may carry bytes.
    method = call_details.method
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(f"/{HEALTH_SERVICE}/")


def client_interceptors(tracer_provider: trace.TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a channel to the other service: a CLIENT span with W3C trace context,
    and the current request id as ``x-request-id``."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    # the pair is unary-unary only; the dependency health checks PredictionService runs are not traced
    unary_unary = aio_client_interceptors(tracer_provider=tracer_provider, filter_=_not_health_check)[0]
    return [unary_unary, RequestIdClientInterceptor()]


def _metadata_value(metadata, key: str) -> str:
    """A metadata value by lower-case key (gateways may keep the caller's case)."""
    for k, v in metadata or ():
        if k.lower() == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _code_name(context: grpc.aio.ServicerContext) -> str:
    """The status the handler set (``grpc.StatusCode`` or its number, by grpcio version)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(code, "UNKNOWN")


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets the log context of each unary-unary call; optionally writes one line per call.

    The request id is the caller's ``x-request-id`` metadata, else the request's own
    ``request_id`` field (PredictRequest). The model version is the response's
    ``model_version`` when it has one, else the request's, else the process default.
    """

    def __init__(self, layer: str, *, log_calls: bool = False) -> None:
        self.layer = layer
        self.log_calls = log_calls

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        inner = handler.unary_unary
        layer, log_calls = self.layer, self.log_calls
        header_request_id = _metadata_value(handler_call_details.invocation_metadata, REQUEST_ID_KEY)

        async def observed(request, context: grpc.aio.ServicerContext):
            request_id = header_request_id or getattr(request, "request_id", "")
            ctx = logs.RequestContext(layer, request_id=request_id[:MAX_REQUEST_ID_LENGTH],
                                      model_version=getattr(request, "model_version", ""))
            token = logs.begin_request(ctx)
            started = time.perf_counter()
            code = "OK"
            try:
                response = await inner(request, context)
                served = getattr(response, "model_version", "")
                if served:
                    ctx.model_version = served
                return response
            except BaseException:
                code = _code_name(context)
                raise
            finally:
                ctx.stages["total"] = time.perf_counter() - started
                if log_calls:
                    _log_call(method, request, ctx, code)
                logs.end_request(token)

        return grpc.unary_unary_rpc_method_handler(
            observed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _log_call(method: str, request, ctx: logs.RequestContext, code: str) -> None:
    """The one line per call: inference id, input fingerprint, batch id, timings per stage."""
    level = logs.per_request_level(logger)
    if level is None:
        return
    inputs = getattr(request, "inputs", None)
    payload = inputs.SerializeToString(deterministic=True) if hasattr(inputs, "SerializeToString") \
        else request.SerializeToString(deterministic=True)
    rows = list(getattr(inputs, "shape", ()) or ())[:1]
    logger.log(level, "%s %s", method.rsplit("/", 1)[-1], code, extra={
        "method": method, "code": code, "model": getattr(request, "model_name", ""),
        "rows": rows[0] if rows else None, "input_fingerprint": logs.fingerprint(payload),
        "timings_ms": {stage: round(s * 1000, 3) for stage, s in ctx.stages.items()}})


class RequestIdClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the current request id as ``x-request-id`` metadata (printable ASCII ids only:
    gRPC metadata cannot carry other characters)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        ctx = logs.current_request()
        if ctx is not None and ctx.request_id and ctx.request_id.isascii() and ctx.request_id.isprintable():
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
            metadata.add(REQUEST_ID_KEY, ctx.request_id)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)
