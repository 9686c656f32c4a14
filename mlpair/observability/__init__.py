"""Observability shared by both services: tracing, gRPC interceptors, personal-data redaction.

- :mod:`.tracing`: the OpenTelemetry tracer provider (OTLP export by setting, none by
  default) and CRM statement spans.
- :mod:`.interceptors`: server and client gRPC interceptors that carry W3C trace context
  and the request id across the pair and set each RPC's log context.
- :mod:`.redaction`: what keeps personal data out of log lines.

Log formatting lives in :mod:`mlpair.logs`; metrics in each service's ``metrics.py``; drift
in :mod:`mlpair.prediction.drift`. Alert rules and dashboards: ``deploy/observability/``.
"""
