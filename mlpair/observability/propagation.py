"""What crosses a hop is chosen, not forwarded: bounded W3C trace context and at most one caller's identity.

PredictionService merges many callers' rows into one Infer call, so whatever it forwarded of
one caller's headers would travel on other callers' work: a caller's ~8 KB ``tracestate`` once
pushed shared Infer calls past gRPC's metadata limit and turned other callers' decisions into
fallbacks (C44), and merged calls carried the first caller's ``traceparent`` and
``x-request-id`` (C45). So:

* **In** (:func:`incoming`): ``tracestate`` and ``baggage`` are list headers; duplicates are
  combined (W3C Trace Context §3.3.1, W3C Baggage §3.2) and the result is trimmed to
  :data:`MAX_LIST_CHARS` characters by whole entries — entries over 128 characters go first, then
  entries from the right, as W3C Trace Context §3.3.1.5 ("Tracestate Limits") prescribes. Two
  different ``traceparent`` values are no valid parent: the call starts a trace of its own, and
  that caller's ``tracestate`` is not read (§3.3.1: not parsed without a valid traceparent).
* **Out** (:func:`outgoing`): a call made for one caller is a child of that caller's span and
  carries that caller's request id; a call made for several callers starts a trace of its own
  whose span links to every caller's span (OpenTelemetry's pattern for batched work), with no
  request id and no caller's ``tracestate`` or baggage. Either way the trace headers are trimmed
  as above, so the metadata of an outgoing call is bounded whatever callers send.

Limits: 512 characters is the W3C minimum a tracestate propagator must keep (§3.3.1.5); baggage
is held to the same bound (W3C Baggage allows up to 8,192 bytes, which would let one caller's
baggage crowd every merged call).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from mlpair import logs

TRACEPARENT, TRACESTATE, BAGGAGE = "traceparent", "tracestate", "baggage"
REQUEST_ID_KEY = "x-request-id"
TRACE_KEYS = frozenset({TRACEPARENT, TRACESTATE, BAGGAGE})
MAX_LIST_CHARS = 512
LARGE_ENTRY_CHARS = 128  # W3C Trace Context §3.3.1.5: entries over 128 characters are removed first
MAX_ENTRIES = {TRACESTATE: 32, BAGGAGE: 64}  # list-member limits of the two W3C specifications


def trim_list(value: str, max_entries: int, max_chars: int = MAX_LIST_CHARS) -> str:
    """A W3C list header (``k=v,k2=v2``) cut to ``max_entries`` entries and ``max_chars``
    characters by whole entries: entries over 128 characters first, then from the right."""
    if len(value) <= max_chars and value.count(",") < max_entries:
        return value
    entries = [e.strip(" \t") for e in value.split(",")]
    entries = [e for e in entries if e][:max_entries]
    if len(",".join(entries)) > max_chars:
        entries = [e for e in entries if len(e) <= LARGE_ENTRY_CHARS]
    kept, size = [], -1
    for entry in entries:
        if size + 1 + len(entry) > max_chars:
            break
        kept.append(entry)
        size += 1 + len(entry)
    return ",".join(kept)


def incoming(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[dict[str, str], list[str]]:
    """The trace carrier to extract from a call's metadata, and its ``x-request-id`` values.

    Returns:
        The carrier (``traceparent`` only when the call sent one value of it; ``tracestate`` and
        ``baggage`` combined and trimmed) and every ``x-request-id`` value, in order.
    """
    parents: set[str] = set()
    lists: dict[str, list[str]] = {}
    request_ids: list[str] = []
    for key, value in metadata or ():
        key = key.lower()  # gateways may keep the caller's case
        if key not in TRACE_KEYS and key != REQUEST_ID_KEY:
            continue
        text = value if isinstance(value, str) else value.decode(errors="replace")
        if key == TRACEPARENT:
            parents.add(text)
        elif key == REQUEST_ID_KEY:
            request_ids.append(text)
        else:
            lists.setdefault(key, []).append(text)
    carrier: dict[str, str] = {}
    if len(parents) == 1:
        carrier[TRACEPARENT] = parents.pop()
    elif len(parents) > 1:
        lists.pop(TRACESTATE, None)
    for key, values in lists.items():
        if trimmed := trim_list(",".join(values), MAX_ENTRIES[key]):
            carrier[key] = trimmed
    return carrier, request_ids


@dataclass(frozen=True, slots=True)
class Caller:
    """One caller of shared work: its trace context (span and baggage) and its request id."""

    context: otel_context.Context
    request_id: str = ""

    @classmethod
    def current(cls) -> Caller:
        """The caller whose request the running code serves (its span and request id)."""
        request = logs.current_request()
        return cls(otel_context.get_current(), request.request_id if request is not None else "")

    @property
    def span_context(self) -> trace.SpanContext:
        """The span context of the caller's current span (invalid when the caller had no span)."""
        return trace.get_current_span(self.context).get_span_context()


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an outgoing call's span belongs: its parent context, links and request id."""

    parent: otel_context.Context | None  # None: the current context (a call made for no caller in particular)
    links: tuple[trace.Link, ...] = ()
    request_id: str = ""


def outgoing(callers: Sequence[Caller] | None) -> Origin:
    """The origin of a call made for ``callers`` (None = the running code's own caller)."""
    if callers is None:
        request = logs.current_request()
        return Origin(None, (), request.request_id if request is not None else "")
    if len(callers) == 1:
        return Origin(callers[0].context, (), callers[0].request_id)
    links = tuple(trace.Link(sc) for sc in (c.span_context for c in callers) if sc.is_valid)
    return Origin(otel_context.Context(), links, "")


def trimmed_carrier(carrier: dict[str, str]) -> list[tuple[str, str]]:
    """An injected carrier as metadata, its list headers trimmed (the caller's tracestate and
    baggage travel inside the parent context, as long as it received them)."""
    out = []
    for key, value in carrier.items():
        if key in MAX_ENTRIES:
            value = trim_list(value, MAX_ENTRIES[key])
            if not value:
                continue
        out.append((key, value))
    return out
