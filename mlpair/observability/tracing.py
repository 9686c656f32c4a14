"""OpenTelemetry tracing for both services: provider, exporter choice, gRPC and CRM spans.

One trace follows a decision across the pair: the PredictionService server span (from
mlpair.observability.calls) → the client span of its ``Infer`` call, which injects
W3C ``traceparent`` metadata → the InferenceService server span → back in PredictionService,
one span per CRM statement (``crm INSERT`` …) under the same Predict span.

Export is off by default. With ``otlp_endpoint`` set (or, failing it, the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``), spans go to that OTLP/gRPC collector (batched), head-sampled
at ``sample_ratio`` (or the standard ``OTEL_TRACES_SAMPLER``) for new traces and following the
caller's choice for continued ones; ``OTEL_SERVICE_NAME`` renames the service. Without an endpoint, spans are still *created but not sampled*: they
cost little, and their trace and span ids still reach every log line and the next hop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

INSTRUMENTATION_NAME = "mlpair"


def build_tracer_provider(
    service_name: str,
    *,
    otlp_endpoint: str = "",
    sample_ratio: float | None = 1.0,
    service_version: str = "",
    exporter: SpanExporter | None = None,
    environ: Mapping[str, str] | None = None,
) -> TracerProvider:
    """A tracer provider for one service.

    Args:
        service_name: the ``service.name`` resource attribute, e.g. ``mlpair-inference``.
        otlp_endpoint: OTLP/gRPC collector, e.g. ``http://otel-collector:4317``; "" = no export
            (or, with ``environ``, the standard variables' collector).
        sample_ratio: fraction in [0, 1] of new traces recorded when exporting
            (``ParentBased(TraceIdRatioBased)``: a caller's sampling decision is kept); None = the
            standard ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``) when ``environ`` sets it, else 1.
        service_version: the ``service.version`` resource attribute.
        exporter: an explicit exporter (tests pass an in-memory one); wins over ``otlp_endpoint``.
        environ: the process environment (``main()`` passes ``os.environ``), for the standard
            OpenTelemetry variables, each used only where the project's own setting is unset:
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (with the
            exporter's other ``OTEL_EXPORTER_OTLP_*`` variables), ``OTEL_SERVICE_NAME``,
            ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``; ``OTEL_SDK_DISABLED=true``
            turns export off. None = ignore the environment.

    Raises:
        ValueError: ``sample_ratio`` is outside [0, 1].
    """
    environ = environ if environ is not None else {}
    if sample_ratio is not None and not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample_ratio must be in [0, 1], got {sample_ratio}")
    service_name = environ.get("OTEL_SERVICE_NAME") or service_name
    exporting_from_environment = (
        not otlp_endpoint
        and environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
        and any(environ.get(name) for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"))
    )
    if exporter is None and (otlp_endpoint or exporting_from_environment):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # No endpoint argument: the exporter reads the standard variables itself (endpoint,
        # headers, certificates, OTEL_EXPORTER_OTLP_INSECURE; http:// means plaintext).
        exporter = (
            OTLPSpanExporter(endpoint=otlp_endpoint, insecure=otlp_endpoint.startswith("http://"))
            if otlp_endpoint
            else OTLPSpanExporter()
        )
    sampler: Sampler
    if exporter is None:
        sampler = ParentBased(ALWAYS_OFF)
    elif sample_ratio is None and environ.get("OTEL_TRACES_SAMPLER"):
        sampler = standard_sampler(environ["OTEL_TRACES_SAMPLER"], environ.get("OTEL_TRACES_SAMPLER_ARG"))
    else:
        sampler = ParentBased(TraceIdRatioBased(1.0 if sample_ratio is None else sample_ratio))
    resource = Resource.create(
        {"service.name": service_name, "service.namespace": "mlpair", "service.version": service_version}
    )
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def standard_sampler(name: str, arg: str | None = None) -> Sampler:
    """The sampler an ``OTEL_TRACES_SAMPLER`` value names (the OpenTelemetry specification's
    built-in values), with ``OTEL_TRACES_SAMPLER_ARG`` as the ratio of the ratio samplers
    (default 1.0).

    Raises:
        ValueError: another name (e.g. a vendor's sampler), or a ratio outside [0, 1].
    """
    ratio = float(arg) if arg else 1.0
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be in [0, 1], got {arg}")
    samplers = {
        "always_on": lambda: ALWAYS_ON,
        "always_off": lambda: ALWAYS_OFF,
        "traceidratio": lambda: TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: ParentBased(ALWAYS_ON),
        "parentbased_always_off": lambda: ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": lambda: ParentBased(TraceIdRatioBased(ratio)),
    }
    if name.lower() not in samplers:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r} is not supported; use one of {', '.join(samplers)}")
    return samplers[name.lower()]()


def instrument_engine(engine: Any, tracer_provider: trace.TracerProvider | None = None) -> None:
    """One CLIENT span per SQL statement on a SQLAlchemy engine (async or sync), named
    ``crm <OPERATION>`` (``crm INSERT``), child of whatever span is current (the Predict call).

    Neither statement parameters nor row values are recorded, so no personal data reaches a
    span. (OpenTelemetry's own SQLAlchemy instrumentation does not support SQLAlchemy 2.1 yet.)
    """
    from sqlalchemy import event

    tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
    sync_engine = getattr(engine, "sync_engine", engine)
    system = sync_engine.dialect.name

    @event.listens_for(sync_engine, "before_cursor_execute")
    def _start(conn, cursor, statement, parameters, context, executemany):
        operation = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "SQL"
        span = tracer.start_span(
            f"crm {operation}",
            kind=trace.SpanKind.CLIENT,
            attributes={"db.system": system, "db.operation.name": operation},
        )
        if context is not None:
            context._mlpair_span = span

    @event.listens_for(sync_engine, "after_cursor_execute")
    def _end(conn, cursor, statement, parameters, context, executemany):
        span = getattr(context, "_mlpair_span", None)
        if span is not None:
            span.end()

    @event.listens_for(sync_engine, "handle_error")
    def _error(exception_context):
        span = getattr(exception_context.execution_context, "_mlpair_span", None)
        if span is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exception_context.original_exception).__name__))
            span.end()
