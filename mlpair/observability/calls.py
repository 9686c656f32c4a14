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
Python on every call, on top of the work it does; together they cost about half of what a whole
single-row Infer call costs the server, and the same spans and metadata made here a fraction of
that (``tests/observability/bench_overhead.py --components``; docs/decisions/0002).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import grpc
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context

from mlpair import logs
from mlpair.observability.propagation import REQUEST_ID_KEY, TRACEPARENT, Caller, incoming, outgoing, trimmed_carrier
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


_OFF = "AlwaysOffSampler"
# W3C Trace Context version 00 exactly as TraceContextTextMapPropagator accepts it (no trailing fields)
_TRACEPARENT_00 = re.compile(r"[ \t]*00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})[ \t]*")


class Unsampled:
    """Knows, without asking the sampler per call, when a span would be dropped, and then makes
    the span OpenTelemetry would have made — a non-recording span with the trace's ids — directly.

    Every call's span used to go through the SDK even when nothing records it (no exporter: the
    sampler is ``ParentBased(ALWAYS_OFF)``; or a caller that did not sample its trace): sampler,
    id generator, span context, context switch and, for an outgoing call, the propagator's
    formatting (docs/decisions/0002-tracing-without-interceptors.md). The ids must still exist
    (every log line carries ``trace_id`` and ``span_id``, and both services' lines share the trace
    id), so only the machinery is skipped. The sampler is read once, from its description
    (``ParentBased{root:AlwaysOffSampler,...}``, ``AlwaysOffSampler``): any other sampler, a
    provider that is not the SDK's, or a propagator without W3C ``traceparent`` keeps the full path.

    Args:
        provider: the tracer provider; None = the global one (read once it is set).
    """

    def __init__(self, provider: trace.TracerProvider | None) -> None:
        self._provider = provider
        self._drops: tuple[bool, bool, bool] | None = None  # new trace, remote unsampled parent, local one

    def drops(self, parent: trace.SpanContext | None) -> bool:
        """Whether a span under ``parent`` (None or invalid: a new trace) would be dropped."""
        drops = self._drops if self._drops is not None else self._resolve()
        if drops is None:
            return False
        if parent is None or not parent.is_valid:
            return drops[0]
        if parent.trace_flags.sampled:
            return False
        return drops[1] if parent.is_remote else drops[2]

    def _resolve(self) -> tuple[bool, bool, bool] | None:
        provider = self._provider if self._provider is not None else trace.get_tracer_provider()
        sampler = getattr(provider, "sampler", None)
        if sampler is None:  # a proxy before the SDK's provider is set, or not the SDK: ask every time
            return None
        if TRACEPARENT not in propagate.get_global_textmap().fields:
            self._drops = (False, False, False)
            return self._drops
        description = sampler.get_description()
        if description == _OFF:
            self._drops = (True, True, True)
        elif description.startswith("ParentBased{"):
            self._drops = (
                f"root:{_OFF}," in description,
                f"remoteParentNotSampled:{_OFF}," in description,
                f"localParentNotSampled:{_OFF}}}" in description,
            )
        else:
            self._drops = (False, False, False)
        return self._drops


def _remote_parent(carrier: Mapping[str, str]) -> trace.SpanContext | None:
    """The caller's span context from a carrier holding a lone, valid, version-00 ``traceparent``
    (what the W3C propagator would extract from it); None for anything else."""
    if len(carrier) != 1:
        return None
    match = _TRACEPARENT_00.fullmatch(carrier.get(TRACEPARENT, ""))
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(match[3], 16)))


def _unsampled_span(parent: trace.SpanContext | None) -> trace.NonRecordingSpan:
    """The span the SDK makes when its sampler drops: the parent's trace (or a new one), a new span id."""
    if parent is not None and parent.is_valid:
        trace_id, state = parent.trace_id, parent.trace_state
    else:
        trace_id, state = random.getrandbits(128) or 1, None
    return trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id,
            random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT),
            trace_state=state,
        )
    )


def observe_servicer(
    servicer, service: str, layer: str, tracer_provider: trace.TracerProvider | None = None, *, log_calls: bool = False
):
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
    unsampled = Unsampled(tracer_provider)
    for name in rpc_methods(servicer):
        setattr(servicer, name, _observed(getattr(servicer, name), service, name, layer, tracer, unsampled, log_calls))
    return servicer


def _server_span(
    tracer: trace.Tracer, unsampled: Unsampled, method: str, attributes: dict, carrier: dict[str, str]
) -> tuple[trace.Span, otel_context.Context]:
    """The call's SERVER span and the context to run it in: made directly when the sampler would
    drop it (:class:`Unsampled`), else by the SDK from the extracted caller's context."""
    span: trace.Span
    if not carrier:
        if unsampled.drops(None):
            span = _unsampled_span(None)
            return span, trace.set_span_in_context(span)
        parent = None
    else:
        remote = _remote_parent(carrier)
        if remote is not None and unsampled.drops(remote):
            span = _unsampled_span(remote)
            return span, trace.set_span_in_context(span)
        parent = propagate.extract(carrier)
    span = tracer.start_span(method, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    return span, trace.set_span_in_context(span, parent)


def _observed(
    inner: Callable[..., Awaitable],
    service: str,
    rpc: str,
    layer: str,
    tracer: trace.Tracer,
    unsampled: Unsampled,
    log_calls: bool,
) -> Callable[..., Awaitable]:
    method = f"/{service}/{rpc}"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}

    @functools.wraps(inner)  # inspect.unwrap reaches the guarded method
    async def observed(request, context: grpc.aio.ServicerContext):
        carrier, header_request_ids = incoming(context.invocation_metadata())
        header_request_id = header_request_ids[-1] if header_request_ids else ""
        span, span_context = _server_span(tracer, unsampled, method, attributes, carrier)
        request_id = header_request_id or getattr(request, "request_id", "")
        ctx = logs.RequestContext(
            layer, request_id=request_id[:MAX_REQUEST_ID_LENGTH], model_version=getattr(request, "model_version", "")
        )
        attached = otel_context.attach(span_context)
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
            if code in _SERVER_FAULTS and span.is_recording():
                span.set_status(trace.Status(trace.StatusCode.ERROR, code))
            raise
        finally:
            if span.is_recording():
                span.set_attribute("rpc.grpc.status_code", _CODE_NUMBERS.get(code, 2))
            ctx.stages["total"] = time.perf_counter() - started
            if log_calls:
                _log_call(method, request, ctx, code)
            logs.end_request(token)
            otel_context.detach(attached)
            span.end()

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
    payload = (
        inputs.SerializeToString(deterministic=True)
        if inputs is not None and hasattr(inputs, "SerializeToString")
        else request.SerializeToString(deterministic=True)
    )
    rows = list(getattr(inputs, "shape", ()) or ())[:1]
    logger.log(
        level,
        "%s %s",
        method.rsplit("/", 1)[-1],
        code,
        extra={
            "method": method,
            "code": code,
            "model": getattr(request, "model_name", ""),
            "rows": rows[0] if rows else None,
            "input_fingerprint": logs.fingerprint(payload),
            "timings_ms": {stage: round(s * 1000, 3) for stage, s in ctx.stages.items()},
        },
    )


class CallTracer:
    """CLIENT spans and trace metadata for calls to the other service.

    Args:
        tracer_provider: where spans go; None = the global provider.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._unsampled = Unsampled(tracer_provider)

    @contextlib.contextmanager
    def call(
        self, service: str, rpc: str, metadata: tuple[tuple[str, str], ...], callers: Sequence[Caller] | None = None
    ) -> Iterator[tuple]:
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
        if (fast := self._unsampled_metadata(origin)) is not None:  # nothing records this span
            yield (*metadata, *fast)
            return
        attributes: dict[str, str | int] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
        if callers is not None and len(callers) > 1:
            attributes["mlpair.callers"] = len(callers)
        span = self._tracer.start_span(
            f"/{service}/{rpc}",
            context=origin.parent,
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            links=origin.links,
        )
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

    def _unsampled_metadata(self, origin) -> list[tuple[str, str]] | None:
        """The call's trace and request-id metadata when its span would be dropped and the parent
        carries no tracestate or baggage (the common case), made without the SDK or the
        propagator: the parent's trace id, a new span id, flags 00. None = take the full path."""
        parent_context = origin.parent if origin.parent is not None else otel_context.get_current()
        parent = trace.get_current_span(parent_context).get_span_context()
        if (
            not self._unsampled.drops(parent)
            or (parent.is_valid and parent.trace_state)
            or baggage.get_all(parent_context)
        ):  # a dropped span's links are dropped with it
            return None
        trace_id = parent.trace_id if parent.is_valid else random.getrandbits(128) or 1
        extra = [(TRACEPARENT, f"00-{trace_id:032x}-{random.getrandbits(64) or 1:016x}-00")]
        request_id = origin.request_id
        if request_id and request_id.isascii() and request_id.isprintable():
            extra.append((REQUEST_ID_KEY, request_id[:MAX_REQUEST_ID_LENGTH]))
        return extra
