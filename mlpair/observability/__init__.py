"""Observability shared by both services: tracing, per-call spans and log context, personal-data redaction.

- :mod:`.tracing`: the OpenTelemetry tracer provider (OTLP export by setting, none by
  default) and CRM statement spans.
- :mod:`.calls`: each RPC's SERVER span and log context (wrappers of the servicers' methods)
  and each outgoing call's CLIENT span, carrying W3C trace context and the request id across
  the pair.
- :mod:`.redaction`: what keeps personal data out of log lines and error details.
- :mod:`.metrics`: the gauge constructor the services' metrics modules declare their gauges with.

Log formatting lives in :mod:`mlpair.logs`; metrics in each service's ``metrics.py``; drift
in :mod:`mlpair.prediction.monitoring.drift`. Alert rules and dashboards: ``deploy/observability/``.
"""
