"""Every RPC's trace span, log context and (for Infer) log line, made inside the handlers.

Server side, :func:`observe_servicer` wraps each RPC method of a servicer instance (after
:func:`mlpair.rpc.guard_servicer`, so it sees the status the guard chose). Per call it:

1. continues the caller's W3C ``traceparent`` (or starts a trace) and opens the SERVER span,
   named after the full method (``/mlpair.inference.v1.InferenceService/Infer``), with the
   OpenTelemetry RPC attributes (``rpc.system``, ``rpc.service``, ``rpc.method``,
   ``rpc.grpc.status_code``); health checks are not wrapped, so not traced;
2. sets the :class:`mlpair.logs.RequestContext` that every log line of the call carries: layer,
   request id (the caller's ``x-request-id`` metadata, else the request's own ``request_id``
   field), model version (the response's, else the request's, else the process default);
3. for InferenceService, writes the one DEBUG (or sampled) line per call with the input
   fingerprint and timings per stage.

Client side (PredictionService → InferenceService), :class:`CallTracer` opens the CLIENT span of
an outgoing call and adds its ``traceparent`` and the business request id (``x-request-id``)
to the call's metadata. What crosses a hop is chosen, not forwarded (:mod:`.propagation`): the
caller's ``tracestate`` and ``baggage`` are bounded on the way in and out, and a call made for
several callers (a coalesced Infer call) has a span of its own linking to each caller's span and
carries no single caller's request id.

Why not gRPC interceptors (what this module was before): grpc.aio runs every interceptor in
Python on every call, on top of the work it does. Priced by
``tests/observability/bench_overhead.py --components`` (CPU per echo call, client and server
together): OpenTelemetry's aio server interceptor 65 µs, its client interceptor 88 µs, our
request-context and request-id interceptors 24 and 19 µs — 174 µs per hop, about half of what
a whole single-row Infer call costs the server. The same spans and metadata made here cost a
fraction of that (see the ``--components`` figures in docs/observability.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import grpc
from opentelemetry import propagate, trace

from mlpair import logs
from mlpair.observability.propagation import REQUEST_ID_KEY, Caller, incoming, outgoing, trimmed_carrier
from mlpair.observability.tracing import INSTRUMENTATION_NAME
from mlpair.rpc import rpc_methods

logger = logging.getLogger(__name__)

__all__ = ["REQUEST_ID_KEY", "CallTracer", "Caller", "observe_servicer"]

MAX_REQUEST_ID_LENGTH = 128
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_CODE_NUMBERS = {code.name: code.value[0] for code in grpc.StatusCode}
# Server span status per OpenTelemetry's RPC conventions: only these codes mark the server's own
# failure; a client error (INVALID_ARGUMENT, NOT_FOUND ...) leaves the span's status unset.
_SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


def observe_servicer(servicer, service: str, layer: str, tracer_provider: trace.TracerProvider | None = None, *,
                     log_calls: bool = False):
    """Gives every RPC method of ``servicer`` its SERVER span and log context (module docstring).

    Args:
        servicer: a servicer instance, already passed through :func:`mlpair.rpc.guard_servicer`.
        service: the full gRPC service name (``mlpair.inference.v1.InferenceService``).
        layer: ``inference`` or ``prediction``.
        tracer_provider: where spans go; None = the global provider (set in ``main()``).
        log_calls: write one DEBUG (or sampled) line per call, as InferenceService does.

    Returns:
        ``servicer``, its RPC methods (the CamelCase coroutine methods) wrapped in place.
    """
    tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
    for name in rpc_methods(servicer):
        setattr(servicer, name, _observed(getattr(servicer, name), service, name, layer, tracer, log_calls))
    return servicer


def _observed(inner: Callable[..., Awaitable], service: str, rpc: str, layer: str, tracer: trace.Tracer,
              log_calls: bool) -> Callable[..., Awaitable]:
    method = f"/{service}/{rpc}"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}

    async def observed(request, context: grpc.aio.ServicerContext):
        carrier, header_request_ids = incoming(context.invocation_metadata())
        header_request_id = header_request_ids[-1] if header_request_ids else ""
        parent = propagate.extract(carrier) if carrier else None
        span = tracer.start_span(method, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        request_id = header_request_id or getattr(request, "request_id", "")
        ctx = logs.RequestContext(layer, request_id=request_id[:MAX_REQUEST_ID_LENGTH],
                                  model_version=getattr(request, "model_version", ""))
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
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
                if code in _SERVER_FAULTS:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, code))
                raise
            finally:
                span.set_attribute("rpc.grpc.status_code", _CODE_NUMBERS.get(code, 2))
                ctx.stages["total"] = time.perf_counter() - started
                if log_calls:
                    _log_call(method, request, ctx, code)
                logs.end_request(token)

    observed.__wrapped__ = inner
    return observed


def _code_name(context: grpc.aio.ServicerContext) -> str:
    """The status the handler set (``grpc.StatusCode`` or its number, by grpcio version)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(code, "UNKNOWN")


def _log_call(method: str, request, ctx: logs.RequestContext, code: str) -> None:
    """The one line per call: inference id, input fingerprint, batch id, timings per stage.
    Never raises (the call's outcome is already decided): a failure is counted (``call_log``)."""
    try:
        _write_call_line(method, request, ctx, code)
    except Exception:  # noqa: BLE001
        logs.observability_failed("call_log")


def _write_call_line(method: str, request, ctx: logs.RequestContext, code: str) -> None:
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


class CallTracer:
    """CLIENT spans and trace metadata for calls to the other service.

    Args:
        tracer_provider: where spans go; None = the global provider.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)

    @contextlib.contextmanager
    def call(self, service: str, rpc: str, metadata: tuple[tuple[str, str], ...],
             callers: Sequence[Caller] | None = None) -> Iterator[tuple]:
        """Opens the CLIENT span of ``/service/rpc`` for the ``with`` block and yields ``metadata``
        plus the trace headers and, when the request id is printable ASCII (all gRPC metadata can
        carry), ``x-request-id``. A ``grpc.RpcError`` leaving the block sets the span's status code
        and error status, and propagates.

        Args:
            callers: whose work the call does (:func:`~mlpair.observability.propagation.outgoing`):
                None = the running code's own caller (a child of the current span); one caller =
                a child of that caller's span with its request id; several = a span of its own
                linking to each caller's span, without any caller's request id.
        """
        origin = outgoing(callers)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
        if callers is not None and len(callers) > 1:
            attributes["mlpair.callers"] = len(callers)
        span = self._tracer.start_span(f"/{service}/{rpc}", context=origin.parent, kind=trace.SpanKind.CLIENT,
                                       attributes=attributes, links=origin.links)
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span, origin.parent))
            extra = trimmed_carrier(carrier)
            request_id = origin.request_id
            if request_id and request_id.isascii() and request_id.isprintable():
                extra.append((REQUEST_ID_KEY, request_id[:MAX_REQUEST_ID_LENGTH]))
            try:
                yield (*metadata, *extra)
            except grpc.RpcError as exc:
                code = exc.code()
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
                raise
            span.set_attribute("rpc.grpc.status_code", 0)
