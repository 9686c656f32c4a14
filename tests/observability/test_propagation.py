"""What crosses a hop: W3C list headers trimmed by whole entries, one traceparent, chosen origins."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mlpair import logs
from mlpair.observability.propagation import MAX_LIST_CHARS, Caller, incoming, outgoing, trim_list, trimmed_carrier

pytestmark = pytest.mark.timeout(60)

entry = st.builds(lambda k, v: f"{k}={v}", st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True),
                  st.from_regex(r"[!-+\--<>-~]{1,250}", fullmatch=True))  # printable, no ',' or '='


@settings(max_examples=100, deadline=None)
@given(st.lists(entry, max_size=80), st.sampled_from([32, 64]))
def test_a_trimmed_list_is_bounded_and_made_of_whole_entries_in_order(entries, max_entries):
    value = ",".join(entries)
    trimmed = trim_list(value, max_entries)
    kept = trimmed.split(",") if trimmed else []
    assert len(trimmed) <= MAX_LIST_CHARS and len(kept) <= max_entries
    it = iter(entries)
    assert all(any(k == e for e in it) for k in kept)  # a subsequence: whole entries, order kept
    if len(value) <= MAX_LIST_CHARS and len(entries) <= max_entries:
        assert trimmed == value  # nothing is touched that fits


def test_entries_over_128_characters_go_first_then_from_the_right():
    small = [f"s{i}=" + "v" * 60 for i in range(10)]  # 63 characters each
    value = ",".join([small[0], "big=" + "x" * 200, *small[1:]])
    assert trim_list(value, 32) == ",".join(small[:8])  # 8 × 63 + 7 commas = 511


def test_incoming_combines_list_headers_and_refuses_two_parents():
    one = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    other = "00-4bf92f3577b34da6a3ce929d0e0e4737-00f067aa0ba902b8-01"
    carrier, ids = incoming([("traceparent", one), ("TraceState", "a=1"), ("tracestate", "b=2"),
                             ("baggage", "x=1"), ("x-request-id", "r1"), ("other", "kept out")])
    assert carrier == {"traceparent": one, "tracestate": "a=1,b=2", "baggage": "x=1"} and ids == ["r1"]
    carrier, _ = incoming([("traceparent", one), ("traceparent", other), ("tracestate", "a=1")])
    assert carrier == {}  # no valid parent: a trace of its own, and that caller's tracestate is not read
    carrier, _ = incoming([("traceparent", one), ("traceparent", one)])
    assert carrier == {"traceparent": one}  # the same value twice is one parent


def test_a_call_for_several_callers_has_no_parent_and_no_request_id_but_links_each():
    tracer = TracerProvider().get_tracer("t")
    callers = []
    for i in range(3):
        with tracer.start_as_current_span(f"caller-{i}"):
            token = logs.begin_request(logs.RequestContext("prediction", request_id=f"r{i}"))
            callers.append(Caller.current())
            logs.end_request(token)
    merged = outgoing(callers)
    assert merged.request_id == "" and trace.get_current_span(merged.parent).get_span_context().is_valid is False
    assert [link.context.span_id for link in merged.links] == [c.span_context.span_id for c in callers]
    single = outgoing(callers[:1])
    assert single.request_id == "r0" and single.parent is callers[0].context and single.links == ()
    assert outgoing(None).parent is None


def test_an_injected_carrier_is_trimmed_and_empty_lists_dropped():
    assert trimmed_carrier({"traceparent": "p", "tracestate": "x=" + "y" * 600, "baggage": "a=1"}) == \
        [("traceparent", "p"), ("baggage", "a=1")]
