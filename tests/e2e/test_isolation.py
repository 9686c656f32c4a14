"""No caller changes another caller's outcome, in one PredictionService process (C43, C44, C45).

Real servers in process: InferenceService serving a credit-risk entry whose logits are NaN for
applicants of 95+ (``tests.nonfinite``), PredictionService in front of it with the cache off, so
every answer comes from an Infer call that other callers' rows may share. Each example of the
cases is a test with its exact count; the same isolation with several processes is in
``test_isolation_replicas.py``.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from tests import nonfinite
from tests.e2e.conftest import crm_count
from tests.fault_support import inference_forwarder, prediction_settings
from tests.support.e2e import big_tracestate, decided, traced_prediction, traceparent

pytestmark = pytest.mark.timeout(120)
MODEL = "credit-risk"


def item(request_id: str, record: dict, explain: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=f"entity-{request_id}", model_name=MODEL,
                             attributes=to_attributes(record), explain=explain)


def counted(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


@pytest.fixture(scope="module")
async def review_and_approve(prediction, credit_holdout) -> tuple[dict, dict]:
    """Two real holdout applicants the model, alone, sends to review and approves."""
    stub, _ = prediction
    records = credit_holdout.records[:60]
    reply = await stub.BatchPredict(pb.BatchPredictRequest(
        requests=[item(f"probe-{i}", r) for i, r in enumerate(records)]), timeout=30)
    labels = [r.prediction.decision_label for r in reply.results]
    return records[labels.index("REVIEW")], records[labels.index("APPROVE")]


async def test_c43_batch_of_good_bad_good_decides_the_good_items_as_when_alone(prediction, review_and_approve):
    stub, predictor = prediction
    first, third = review_and_approve
    alone = [await stub.Predict(item("c43-alone-1", first), timeout=10),
             await stub.Predict(item("c43-alone-3", third), timeout=10)]
    assert [a.decision_label for a in alone] == ["REVIEW", "APPROVE"]
    invalid_before, rows_before = counted("prediction_model_output_invalid_total"), await crm_count(predictor)

    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item("c43-b1", first), item("c43-b2", nonfinite.bad(first)), item("c43-b3", third)]), timeout=10)

    assert [r.WhichOneof("outcome") for r in reply.results] == ["prediction"] * 3
    good = [reply.results[0].prediction, reply.results[2].prediction]
    assert [decided(g) for g in good] == [decided(a) for a in alone]  # bit-identical probabilities
    bad = reply.results[1].prediction
    assert (bad.decision_label, bad.reason_codes[0], bad.fallback, bad.degraded_reason, bad.probability) == \
        ("REVIEW", "MODEL_OUTPUT_INVALID", True, "MODEL_OUTPUT_INVALID", 0.0)
    assert counted("prediction_model_output_invalid_total") - invalid_before == 1
    assert await crm_count(predictor) - rows_before == 3  # the bad item is recorded like any decision
    row = await predictor.crm.find("c43-b2")
    assert (row.decision, row.probability, row.reason_codes[0]) == ("REVIEW", None, "MODEL_OUTPUT_INVALID")


async def test_c43_an_explanation_beside_a_bad_row_is_the_same_as_alone(prediction, review_and_approve):
    stub, _ = prediction
    first, _ = review_and_approve
    alone = await stub.Predict(item("c43-explain-alone", first, explain=True), timeout=10)
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item("c43-explain-bad", nonfinite.bad(first), explain=True), item("c43-explain", first, explain=True)]),
        timeout=10)
    bad, good = (r.prediction for r in reply.results)
    assert bad.reason_codes[0] == "MODEL_OUTPUT_INVALID" and not bad.contributions
    assert decided(good) == decided(alone)
    assert [(c.feature, c.contribution) for c in good.contributions] == \
        [(c.feature, c.contribution) for c in alone.contributions]


# -- what crosses the hop (C44, C45) ------------------------------------------------------------

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
INFER = "/mlpair.inference.v1.InferenceService/Infer"
MAX_INFER_METADATA_CHARS = 1500  # x-feature-version, traceparent, tracestate and baggage (512 each at most), x-request-id


@pytest.fixture(scope="module")
async def hop(inference, nonfinite_repository, tmp_path_factory):
    """PredictionService (cache off, its own spans) → a recording forwarder → InferenceService.

    Rows queued while an Infer call is in flight wait up to a second for it: concurrent callers merge."""
    async with inference_forwarder(inference) as (target, forwarder):
        settings = prediction_settings(tmp_path_factory.mktemp("hop"), nonfinite_repository, target,
                                       models=[MODEL], cache_backend="off", coalesce_max_delay_ms=1000,
                                       inference_timeout_ms=10_000)
        async with traced_prediction(settings) as (stub, predictor, provider, spans):
            yield stub, predictor, provider, spans, forwarder


def transitions() -> float:
    return sum(REGISTRY.get_sample_value("prediction_circuit_transitions_total",
                                         {"dependency": "inference", "state": s}) or 0.0
               for s in ("OPEN", "HALF_OPEN", "CLOSED"))


# The case's header (8,159 characters of tracestate: gRPC's 8 KiB soft metadata limit refuses a
# few per cent of such calls at random) and a heavier one (with 3,900 characters of baggage: about
# half are refused), which made plain callers fall back in nearly every run before the fix.
HEADERS = {"tracestate_8k": (("tracestate", big_tracestate()),),
           "tracestate_8k_and_baggage_4k": (("tracestate", big_tracestate()),
                                            ("baggage", ",".join(f"b{i:02d}={'x' * 60}" for i in range(60))))}


@pytest.mark.parametrize("header", HEADERS.values(), ids=HEADERS.keys())
async def test_c44_a_callers_huge_trace_headers_make_no_plain_caller_fall_back(hop, credit_holdout, header):
    stub, predictor, _, _, forwarder = hop
    records = credit_holdout.records[:120]
    forwarder.received.clear()
    before = transitions()
    limit = asyncio.Semaphore(32)

    async def call(rid: str, record: dict, metadata=()):
        async with limit:
            try:
                return await stub.Predict(item(rid, record), metadata=metadata, timeout=20)
            except grpc.aio.AioRpcError as exc:
                return exc

    big = [call(f"c44-big-{i}", records[i], (("traceparent", traceparent()[0]), *header)) for i in range(15)]
    plain = [call(f"c44-plain-{i}", records[15 + i]) for i in range(105)]
    replies = await asyncio.gather(*[c for pair in zip(big, plain) for c in pair], *plain[15:])
    big_replies, plain_replies = replies[0:30:2], [*replies[1:30:2], *replies[30:]]

    assert sum(isinstance(r, grpc.aio.AioRpcError) or r.fallback for r in plain_replies) == 0  # 0 of 105
    # the big-header caller is decided, or refused up front by gRPC itself: never a recorded fallback
    assert not [r for r in big_replies if not isinstance(r, grpc.aio.AioRpcError) and r.fallback]
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in big_replies if isinstance(r, grpc.aio.AioRpcError))
    assert transitions() == before and predictor.scorer.caller.breaker.state.name == "CLOSED"
    sizes = [sum(len(k) + len(v) for k, v in metadata) for metadata, _ in forwarder.received]
    assert max(sizes) <= MAX_INFER_METADATA_CHARS, max(sizes)


async def test_c45_a_merged_infer_call_carries_no_callers_request_id_and_links_every_caller(
        hop, credit_holdout, credit_entry):
    stub, _, provider, spans, forwarder = hop
    records = credit_holdout.records[200:209]
    rows = FeatureAssembler(credit_entry.preprocessing).assemble_many(records)
    owner = {row.tobytes(): i for i, row in enumerate(rows)}
    callers = [traceparent() for _ in records]
    provider.force_flush()
    spans.clear()
    forwarder.received.clear()
    forwarder.delay_s = 0.3  # the first call is slow: the other callers queue and merge behind it
    try:
        await asyncio.gather(*(
            stub.Predict(item(f"c45-{i}", record), timeout=20,
                         metadata=(("traceparent", header), ("x-request-id", f"c45-caller-{i}")))
            for i, (record, (header, _, _)) in enumerate(zip(records, callers))))
    finally:
        forwarder.delay_s = 0.0
    provider.force_flush()
    finished = spans.get_finished_spans()
    predict_span = {}  # caller → its Predict server span's id
    for span in finished:
        if span.name == PREDICT and span.kind == SpanKind.SERVER:
            i = next(i for i, (_, t, p) in enumerate(callers) if format(span.parent.span_id, "016x") == p)
            predict_span[i] = span.context.span_id
    client_spans = {s.context.span_id: s for s in finished if s.name == INFER and s.kind == SpanKind.CLIENT}

    merged = 0
    for metadata, request in forwarder.received:
        x = np.frombuffer(request.inputs.content, dtype="<f4").reshape(tuple(request.inputs.shape))
        owners = {owner[row.tobytes()] for row in x}
        request_ids = [v for k, v in metadata if k == "x-request-id"]
        [sent] = [v for k, v in metadata if k == "traceparent"]
        _, trace_id, span_id, _ = sent.split("-")
        span = client_spans[int(span_id, 16)]
        if len(owners) > 1:
            merged += 1
            assert request_ids == []  # no single caller's request id on several callers' rows
            assert trace_id not in {t for _, t, _ in callers}  # a trace of its own
            assert {link.context.span_id for link in span.links} == {predict_span[i] for i in owners}
        else:
            [i] = owners
            assert request_ids == [f"c45-caller-{i}"] and trace_id == callers[i][1]
    assert merged >= 1 and len(forwarder.received) < len(records)
