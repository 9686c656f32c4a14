"""Logging for every role: JSON lines in production, readable text locally, never raw personal data.

Configured once, in ``main()``, by :func:`configure_logging`; code elsewhere only does
``logger = logging.getLogger(__name__)``. Every line carries:

========================  ==================================================================
``ts``                    UTC time, ISO 8601 with milliseconds
``level``, ``logger``     as in :mod:`logging`
``layer``                 ``inference`` or ``prediction`` (``training`` for ``mlpair train``)
``message``               the formatted message
``trace_id``, ``span_id`` W3C trace context of the current OpenTelemetry span ("" outside one)
``request_id``            the business request id (Predict) or the caller's ``x-request-id``
``model_version``         the model version serving the request, or this process's default
========================  ==================================================================

plus whatever the call passes as ``extra={...}``. Lines of an Infer call also carry
``inference_id`` and ``batch_id``; the one DEBUG line per Infer call (emitted by
:func:`mlpair.observability.calls.observe_servicer`) adds the
``input_fingerprint`` (a BLAKE2b hash, never the values) and ``timings_ms`` per stage. The
one line per decision (:func:`log_decision`) carries ``decision``, ``reason_codes`` and
``from_cache``.

Per-request lines are DEBUG (or sampled at INFO with ``sample_ratio``), never unconditional
INFO: the hop budget (docs/design.md) leaves no room for a formatted line per RPC.

Every string that reaches a line passes through the process's
:data:`~mlpair.observability.redaction.PROCESS_REDACTOR`, which error details share:
schema-flagged personal fields (registered with :func:`add_personal_fields`) and patterns
(e-mail addresses, national ID numbers, IBANs, card and phone numbers, each with its check
characters) are replaced before the line is written.

**Logging never fails a request.** A request's outcome is decided before its line is written,
and no log line may change it: :func:`log_decision` takes every decision shape (a probability or
none, replayed, stale, fallback, invalid model output) at every level and sampling ratio; a
failure anywhere on the way (building the fields, a filter, a formatter, the stream) is caught,
counted through :func:`count_failures_with` (``<layer>_observability_errors_total``) and never
raised into the request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import secrets
import sys
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

from mlpair.observability.redaction import PROCESS_REDACTOR

CONTEXT_FIELDS = ("layer", "trace_id", "span_id", "request_id", "model_version")
_INFERENCE_FIELDS = ("inference_id", "batch_id")
# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    *CONTEXT_FIELDS,
    *_INFERENCE_FIELDS,
}

_redactor = PROCESS_REDACTOR  # shared with error details (mlpair.errors)
_sample_ratio = 0.0
_process_fields: dict[str, str] = {"layer": "", "model_version": ""}
_failure_counters: dict[str, Callable[[str], None]] = {}  # layer → counts a failure of one stage


@dataclass(slots=True)
class RequestContext:
    """What the log lines of one RPC share; set by the server interceptor for the call's duration.

    ``stages`` maps a stage name (``validate``, ``queue``, ``compute``, ``total``) to seconds.
    """

    layer: str
    request_id: str = ""
    model_version: str = ""
    inference_id: str = ""
    batch_id: str = ""
    stages: dict[str, float] = field(default_factory=dict)

    def ensure_inference_id(self) -> str:
        """The call's inference id, made on first use (so calls that log nothing pay nothing)."""
        if not self.inference_id:
            self.inference_id = new_id()
        return self.inference_id


_current: ContextVar[RequestContext | None] = ContextVar("mlpair_request_context", default=None)


def begin_request(context: RequestContext) -> Token:
    """Makes ``context`` the current request's; pass the token to :func:`end_request`."""
    return _current.set(context)


def end_request(token: Token) -> None:
    """Restores the request context that was current before :func:`begin_request` returned ``token``."""
    _current.reset(token)


def current_request() -> RequestContext | None:
    """The current RPC's context, or None outside one."""
    return _current.get()


def record_stage(stage: str, seconds: float) -> None:
    """Adds ``seconds`` to ``stage`` of the current request's timings (no-op outside a request).

    Called by the serving core at stage boundaries, e.g. ``record_stage("compute", 0.0004)``.
    """
    context = _current.get()
    if context is not None:
        context.stages[stage] = context.stages.get(stage, 0.0) + seconds


def set_process_model_version(version: str) -> None:
    """The model version lines outside a request (and requests that name none) report."""
    _process_fields["model_version"] = version


def new_id() -> str:
    """A random 64-bit id as 16 hex digits (inference and batch ids)."""
    return secrets.token_hex(8)


def fingerprint(data: bytes) -> str:
    """``blake2b:<16 hex>``: a 64-bit BLAKE2b digest of an input's bytes, to match identical
    inputs across lines without logging the values."""
    return "blake2b:" + hashlib.blake2b(data, digest_size=8).hexdigest()


def add_personal_fields(names: Iterable[str]) -> None:
    """Registers schema-flagged personal attributes; their values never appear in a line."""
    _redactor.add_fields(names)


def per_request_level(logger: logging.Logger) -> int | None:
    """Level for a per-request line: DEBUG when enabled, INFO for a ``sample_ratio`` sample,
    else None (log nothing: the common, cheap case)."""
    if logger.isEnabledFor(logging.DEBUG):
        return logging.DEBUG
    if _sample_ratio and random.random() < _sample_ratio and logger.isEnabledFor(logging.INFO):
        return logging.INFO
    return None


def count_failures_with(layer: str, count: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Registers how ``layer``'s observability failures are counted: ``count(stage)`` increments
    that service's ``<layer>_observability_errors_total{stage}`` (called by each server at start).
    Returns the callback it replaces."""
    previous = _failure_counters.pop(layer, None)
    if count is not None:
        _failure_counters[layer] = count
    return previous


def observability_failed(stage: str) -> None:
    """Counts one failure of an observability ``stage`` (``decision_log``, ``call_log``,
    ``format``, ``filter``, ``span``) for the current layer; never raises."""
    try:
        context = _current.get()
        layer = context.layer if context is not None else _process_fields["layer"]
        count = _failure_counters.get(layer)
        if count is not None:
            count(stage)
    except Exception:  # noqa: BLE001  (counting a failure must not become one)
        pass


def log_decision(
    logger: logging.Logger,
    *,
    decision: str,
    reason_codes: Iterable[str],
    from_cache: bool,
    probability: float | None,
    decision_id: str,
    model_version: str,
    **extra: Any,
) -> None:
    """The one line per decision (DEBUG, or a sampled INFO): decision, reason codes, cache use.

    Takes every decision shape: ``probability`` None (a fallback, or output the model could not
    give) is logged as null; ``extra`` adds fields such as ``replayed``. ``model_version`` (the
    version that served the decision) becomes the line's model version. Never raises: a failure
    is counted (``decision_log``) and the request goes on.
    """
    try:
        level = per_request_level(logger)
        if level is None:
            return
        context = _current.get()
        if context is not None:
            context.model_version = model_version
        logger.log(
            level,
            "decision %s",
            decision,
            extra={
                **extra,
                "decision": decision,
                "reason_codes": list(reason_codes),
                "from_cache": from_cache,
                "probability": None if probability is None else round(float(probability), 6),
                "decision_id": decision_id,
            },
        )
    except Exception:  # noqa: BLE001  (a log line never fails a request)
        observability_failed("decision_log")


class ContextFilter(logging.Filter):
    """Stamps each record with layer, trace and span ids, request id and model version."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Stamps the record; never raises (a filter's exception would reach the logging call)."""
        try:
            self._stamp(record)
        except Exception:  # noqa: BLE001
            observability_failed("filter")
            for name in CONTEXT_FIELDS:
                if not hasattr(record, name):
                    setattr(record, name, "")
        return True

    @staticmethod
    def _stamp(record: logging.LogRecord) -> None:
        span = trace.get_current_span().get_span_context()
        record.trace_id = format(span.trace_id, "032x") if span.is_valid else ""
        record.span_id = format(span.span_id, "016x") if span.is_valid else ""
        context = _current.get()
        if context is None:
            record.layer = _process_fields["layer"]
            record.request_id = ""
            record.model_version = _process_fields["model_version"]
        else:
            record.layer = context.layer
            record.request_id = context.request_id
            record.model_version = context.model_version or _process_fields["model_version"]
            if context.layer == "inference":
                record.inference_id = context.ensure_inference_id()
                record.batch_id = context.batch_id or context.inference_id


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """Context and extra fields of a record, redacted."""
    out = {name: getattr(record, name, "") for name in CONTEXT_FIELDS}
    out["request_id"] = _redactor.text(out["request_id"])
    for name in _INFERENCE_FIELDS:
        if hasattr(record, name):
            out[name] = getattr(record, name)
    for key, value in record.__dict__.items():
        if key not in _STANDARD:
            out[key] = _redactor.value(key, value)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, the context fields,
    extras and ``exc`` (the traceback), all redacted."""

    def format(self, record: logging.LogRecord) -> str:
        """``record`` as one line of JSON: time (ISO 8601, UTC, milliseconds), level, logger, message,
        the request context's and the record's extra fields, and the traceback as ``exc``; personal data
        redacted throughout.
        """
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _redactor.text(record.getMessage()),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["exc"] = _redactor.text(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """Readable lines for a terminal: time, level, layer, logger, message, then ``key=value``
    fields and a short trace id; redacted like the JSON form."""

    def format(self, record: logging.LogRecord) -> str:
        """``record`` as one readable line: local time with milliseconds, level, layer, logger and
        message, then the non-empty fields as ``[key=value …]`` and the trace id's first 16 hex digits
        (``trace=…``); personal data redacted, and the traceback, if any, on the lines that follow.
        """
        fields = _fields(record)
        layer = fields.pop("layer") or "-"
        trace_id = fields.pop("trace_id")
        fields.pop("span_id")
        context = " ".join(
            f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}"
            for k, v in fields.items()
            if v not in ("", None)
        )
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.") + f"{int(record.msecs):03d}"
        line = f"{ts} {record.levelname:<5} {layer} {record.name}: {_redactor.text(record.getMessage())}"
        if context:
            line += f" [{context}]"
        if trace_id:
            line += f" trace={trace_id[:16]}"
        if record.exc_info:
            line += "\n" + _redactor.text(self.formatException(record.exc_info))
        return line


class _Handler(logging.StreamHandler):
    """A stream handler whose failures (formatting, writing) are counted, not only printed."""

    def handleError(self, record: logging.LogRecord) -> None:
        observability_failed("format")
        super().handleError(record)


def set_sample_ratio(ratio: float) -> float:
    """Sets the fraction of per-request lines written at INFO when DEBUG is off; returns the old one."""
    global _sample_ratio
    previous, _sample_ratio = _sample_ratio, float(ratio)
    return previous


def make_handler(fmt: str, stream) -> logging.Handler:
    """A stream handler writing ``fmt`` ("text" or "json") lines with the context fields."""
    handler = _Handler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    return handler


def configure_logging(
    layer: str, level: str = "INFO", fmt: str = "text", *, sample_ratio: float = 0.0, stream=None
) -> None:
    """Sends logs to ``stream`` (stderr) as ``fmt`` ("text" or "json"), tagged with ``layer``.

    Args:
        layer: ``inference``, ``prediction`` or ``training``: the default for lines outside a request.
        level: root log level name.
        fmt: "json" in production, "text" locally.
        sample_ratio: fraction of requests, in [0, 1], whose per-request line is written at INFO
            when DEBUG is off (0 = none).
        stream: where lines go (default stderr).
    """
    _process_fields["layer"] = layer
    set_sample_ratio(sample_ratio)
    handler = make_handler(fmt, stream or sys.stderr)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic announces each of its plugins at INFO whenever a schema check loads it (a dozen
    # lines per start of PredictionService, none of them about this process); its migration
    # lines (alembic.runtime.migration) stay.
    logging.getLogger("alembic.runtime.plugins").setLevel(max(logging.WARNING, root.level))
