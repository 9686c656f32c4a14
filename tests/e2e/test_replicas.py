"""One decision per request id across replicas (C40, C41, C42), with real processes.

Two healthy PredictionService replicas and a third whose InferenceService is unreachable (it can
only fall back) share one decision ledger and one CRM in PostgreSQL, over one InferenceService.
Each example of the cases is a test with its exact expectation; every answer is compared with the
CRM row of its request id. The cluster (``conftest.replicas``) is shared with the isolation tests
(C43), whose model entry gives NaN logits only for applicants of 95+: for every real applicant
here it is the real model, bit for bit.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from tests.e2e.replicas import contradicts, crm_rows, refusal_reason, request

pytestmark = pytest.mark.timeout(240)
A, B, CUT_OFF = 0, 1, 2  # replica indexes: two healthy ones, one without InferenceService (conftest.replicas)


@pytest.fixture(scope="module")
async def applicants(replicas, credit_holdout):
    """Two real holdout applicants: one the model approves alone, one it declines alone."""
    records = credit_holdout.records[:200]
    reply = await replicas.stubs[A].BatchPredict(pb.BatchPredictRequest(
        requests=[request(f"probe-{i}", r) for i, r in enumerate(records)]), timeout=60)
    labels = [result.prediction.decision_label for result in reply.results]
    return records[labels.index("APPROVE")], records[labels.index("DECLINE")]


async def settled(replicas, request_id: str) -> list:
    """The CRM row(s) of ``request_id`` once the relays have delivered it."""
    for _ in range(100):
        rows = (await crm_rows(replicas.crm_url, [request_id])).get(request_id, [])
        if rows:
            return rows
        await asyncio.sleep(0.1)
    return []


def same_decision(first: pb.PredictResponse, later: pb.PredictResponse) -> bool:
    return (later.decision_id, later.decision_label, later.probability, list(later.reason_codes), later.decided_at) == \
        (first.decision_id, first.decision_label, first.probability, list(first.reason_codes), first.decided_at)


async def test_c40_a_decision_is_replayed_after_any_time_and_by_another_replica(replicas, applicants):
    approve, _ = applicants
    first = await replicas.stubs[A].Predict(request("c40-r1", approve), timeout=20)
    assert first.decision_label == "APPROVE" and not first.replayed
    await asyncio.sleep(3.0)  # longer than the old per-process retention the case was shown with
    again = await replicas.stubs[A].Predict(request("c40-r1", approve), timeout=20)
    elsewhere = await replicas.stubs[B].Predict(request("c40-r1", approve), timeout=20)
    for reply in (again, elsewhere):
        assert reply.replayed and same_decision(first, reply)
    [row] = await settled(replicas, "c40-r1")
    assert row.decision == "APPROVE" and contradicts(elsewhere, row) == []


async def test_c41_a_fallback_on_one_replica_is_what_every_replica_answers(replicas, applicants):
    approve, _ = applicants
    fallback = await replicas.stubs[CUT_OFF].Predict(request("c41-r2", approve), timeout=20)
    assert fallback.fallback and fallback.decision_label == "REVIEW"
    healthy = await replicas.stubs[B].Predict(request("c41-r2", approve), timeout=20)
    assert healthy.replayed and healthy.fallback and same_decision(fallback, healthy)
    [row] = await settled(replicas, "c41-r2")
    assert row.decision == "REVIEW" and row.probability is None and contradicts(healthy, row) == []


async def test_c42_a_used_request_id_with_another_payload_is_refused(replicas, applicants, churn_holdout):
    approve, decline = applicants
    first = await replicas.stubs[A].Predict(request("c42-r3", approve), timeout=20)
    assert first.decision_label == "APPROVE"
    other_applicant = request("c42-r3", decline)
    other_family = request("c42-r3", churn_holdout.records[0], model_name="churn")
    for stub in replicas.stubs:
        for reused in (other_applicant, other_family):
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await stub.Predict(reused, timeout=20)
            assert excinfo.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert refusal_reason(excinfo.value) == "IDEMPOTENCY_KEY_REUSED" and "c42-r3" in excinfo.value.details()
    # the same payload spelt differently (attribute order, a null for an absent attribute) is a retry
    spelt = pb.PredictRequest(request_id="c42-r3", entity_id="entity-c42-r3")
    for name in reversed(list(request("x", approve).attributes)):
        spelt.attributes[name].CopyFrom(request("x", approve).attributes[name])
    spelt.attributes["NotInAnySchema"].CopyFrom(pb.AttributeValue())
    retry = await replicas.stubs[B].Predict(spelt, timeout=20)
    assert retry.replayed and same_decision(first, retry)
    [row] = await settled(replicas, "c42-r3")
    assert row.decision == "APPROVE" and contradicts(retry, row) == []


async def test_c42_batch_predict_refuses_a_reused_request_id_per_item(replicas, applicants):
    approve, decline = applicants
    first = await replicas.stubs[A].Predict(request("c42-batch-old", approve), timeout=20)
    reply = await replicas.stubs[B].BatchPredict(pb.BatchPredictRequest(requests=[
        request("c42-batch-new", decline), request("c42-batch-old", decline), request("c42-batch-old-2", approve),
        request("c42-batch-old", approve, entity_id="entity-c42-batch-old")]), timeout=30)
    fresh, reused, other, replay = reply.results
    assert fresh.prediction.decision_label == "DECLINE" and not fresh.prediction.replayed
    assert reused.WhichOneof("outcome") == "error" and reused.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    info = error_details_pb2.ErrorInfo()
    assert reused.error.details[0].Unpack(info) and info.reason == "IDEMPOTENCY_KEY_REUSED"
    assert info.metadata["request_id"] == "c42-batch-old"
    assert other.prediction.decision_label == "APPROVE" and not other.prediction.replayed
    # an id may appear once per batch: the fourth item repeats the second's id, so it is refused as a duplicate
    assert replay.WhichOneof("outcome") == "error" and replay.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    again = await replicas.stubs[A].BatchPredict(pb.BatchPredictRequest(requests=[request("c42-batch-old", approve)]),
                                                 timeout=30)
    assert again.results[0].prediction.replayed and same_decision(first, again.results[0].prediction)


async def test_c40_concurrent_first_calls_on_every_replica_make_one_decision(replicas, applicants):
    """The same 20 new ids sent at once to all three replicas (the cut-off one would fall back,
    the others decide from the model): for each id one decision is made and all three callers get it."""
    approve, _ = applicants
    ids = [f"c40-race-{i}" for i in range(20)]
    calls = [stub.Predict(request(rid, approve), timeout=30) for rid in ids for stub in replicas.stubs]
    replies = await asyncio.gather(*calls)
    by_id: dict[str, list[pb.PredictResponse]] = {}
    for reply in replies:
        by_id.setdefault(reply.request_id, []).append(reply)
    rows = await crm_rows(replicas.crm_url, ids)
    for _ in range(100):
        if len(rows) == len(ids):
            break
        await asyncio.sleep(0.1)
        rows = await crm_rows(replicas.crm_url, ids)
    made = 0
    for rid, answers in by_id.items():
        assert len(answers) == 3
        assert sum(not a.replayed for a in answers) == 1  # exactly one decision was made...
        made += 1
        assert all(same_decision(answers[0], a) for a in answers)  # ...and everybody got it
        [row] = rows[rid]
        assert all(contradicts(a, row) == [] for a in answers)
    assert made == 20
