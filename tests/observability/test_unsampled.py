"""Spans the sampler would drop are made without the SDK, and are the spans the SDK would have made."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mlpair.observability.calls import CallTracer, Unsampled, _remote_parent
from mlpair.observability.tracing import build_tracer_provider

HEX = "0123456789abcdefABCDEF_ -"
W3C = TraceContextTextMapPropagator()


def _context(trace_id: int, sampled: bool, remote: bool) -> trace.SpanContext:
    return trace.SpanContext(trace_id, 0x00F067AA0BA902B7, is_remote=remote,
                             trace_flags=trace.TraceFlags(1 if sampled else 0))


def test_without_an_exporter_every_unsampled_span_is_dropped_and_a_sampled_caller_is_not():
    unsampled = Unsampled(build_tracer_provider("mlpair-test"))
    assert unsampled.drops(None)
    assert unsampled.drops(_context(7, sampled=False, remote=True))
    assert unsampled.drops(_context(7, sampled=False, remote=False))
    assert not unsampled.drops(_context(7, sampled=True, remote=True))  # the caller's choice is kept


def test_with_an_exporter_new_traces_take_the_sdk_path():
    provider = build_tracer_provider("mlpair-test", exporter=InMemorySpanExporter(), sample_ratio=0.5)
    unsampled = Unsampled(provider)
    assert not unsampled.drops(None)  # the ratio sampler decides by trace id: asked per call
    assert unsampled.drops(_context(7, sampled=False, remote=True))


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.builds(lambda v, t, s, f: f"{v}-{t}-{s}-{f}", st.sampled_from(["00", "01", "ff", "0", "000"]),
              st.text(HEX, min_size=31, max_size=33), st.text(HEX, min_size=15, max_size=17),
              st.text(HEX, min_size=1, max_size=3)),
    st.builds(lambda t, s, f, pad: f"{pad}00-{t:032x}-{s:016x}-{f:02x}{pad}", st.integers(0, 2**128 - 1),
              st.integers(0, 2**64 - 1), st.integers(0, 255), st.sampled_from(["", " ", "\t"])),
    st.text(max_size=70)))
def test_a_lone_traceparent_is_read_as_the_w3c_propagator_reads_it(header):
    ours = _remote_parent({"traceparent": header})
    theirs = trace.get_current_span(W3C.extract({"traceparent": header})).get_span_context()
    if ours is not None:  # ours reads version 00 only; anything else goes to the propagator
        assert theirs.is_valid
        assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == \
            (theirs.trace_id, theirs.span_id, theirs.trace_flags, theirs.is_remote)
    elif header.strip(" \t").startswith("00-") and theirs.is_valid:
        raise AssertionError(f"a valid version-00 traceparent was not read: {header!r}")


def test_an_unsampled_outgoing_call_continues_the_trace_with_a_new_span():
    provider = build_tracer_provider("mlpair-test")
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("server") as server,
        CallTracer(provider).call("svc", "Infer", (("x-feature-version", "v1"),)) as metadata,
    ):
        pass
    sent = dict(metadata)
    parent = server.get_span_context()
    version, trace_id, span_id, flags = sent["traceparent"].split("-")
    assert (version, int(trace_id, 16), flags) == ("00", parent.trace_id, "00")
    assert int(span_id, 16) not in (0, parent.span_id)
    assert sent["x-feature-version"] == "v1"
