"""A batch decided column by column decides every item as a single Predict of it would (C43 too).

Real InferenceService (the credit-risk model whose logits are NaN for applicants of 95+, see
``tests.nonfinite``) and PredictionService with the cache off (``test_isolation``'s pair), so every row is scored afresh. A
BatchPredict of eight or more items goes through the columnar assembly; a single Predict through
the row-wise one: the two must agree bit for bit, and an item's own problem stays its own.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests import nonfinite
from tests.e2e.conftest import crm_count

pytestmark = pytest.mark.timeout(180)
MODEL = "credit-risk"


def item(request_id: str, record: dict, *, model: str = MODEL, explain: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=f"entity-{request_id}", model_name=model,
                             attributes=to_attributes(record), explain=explain)


def decided(reply: pb.PredictResponse) -> tuple:
    """Everything of a decision that must not depend on how it was computed (ids aside)."""
    return (reply.decision_label, reply.probability, list(reply.reason_codes), reply.model_version,
            reply.feature_schema_version, reply.policy_version, reply.fallback, reply.stale, reply.degraded_reason,
            reply.spread, reply.calibration_method, [(c.feature, c.contribution) for c in reply.contributions],
            list(reply.top_reasons), [(w.code, w.field) for w in reply.warnings])


def guarded(records: list[dict], schema) -> list[dict]:
    """Holdout records with what the guards handle: missing values, sentinels, values out of
    range, unknown categories and attributes, strings for numbers."""
    numeric, categorical = schema.numeric, schema.categorical
    out = []
    for i, record in enumerate(records):
        record = dict(record)
        feat = numeric[i % len(numeric)]
        kind = i % 6
        if kind == 1:
            record[feat.name] = None
        elif kind == 2 and feat.sentinels:
            record[feat.name] = feat.sentinels[0]
        elif kind == 3:
            record[feat.name] = feat.max * 10 + 1
        elif kind == 4:
            record[categorical[i % len(categorical)].name] = "never-seen-category"
            record["an_unknown_attribute"] = "x"
        elif kind == 5:
            record[feat.name] = str(int(feat.min))
        out.append(record)
    return out


async def test_a_batch_decides_each_holdout_applicant_exactly_as_a_single_predict(prediction, credit_holdout,
                                                                                  credit_entry):
    stub, predictor = prediction
    records = guarded(credit_holdout.records[:120], credit_entry.preprocessing.feature_schema)
    explained = {3, 50}
    batch = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"col-batch-{i}", r, explain=i in explained) for i, r in enumerate(records)]), timeout=60)
    assert [r.WhichOneof("outcome") for r in batch.results] == ["prediction"] * len(records)
    alone = [await stub.Predict(item(f"col-alone-{i}", r, explain=i in explained), timeout=10)
             for i, r in enumerate(records)]
    assert [decided(r.prediction) for r in batch.results] == [decided(a) for a in alone]
    reasons = {code for r in batch.results for code in r.prediction.reason_codes}
    assert any(code.endswith("_MISSING_DEFAULTED") for code in reasons)  # the guards did fire
    assert any(code.endswith("_CLAMPED_MAX") for code in reasons)
    assert any(code.endswith("_UNKNOWN_CATEGORY") for code in reasons)
    assert len({r.prediction.decision_label for r in batch.results}) > 1


async def test_invalid_items_among_valid_ones_are_decided_or_refused_each_on_its_own(prediction, credit_holdout):
    stub, predictor = prediction
    records = credit_holdout.records[:24]
    requests, expected = [], []
    for i, record in enumerate(records):
        kind = i % 6
        if kind == 1:  # NaN logits for this row alone
            requests.append(item(f"mix-{i}", nonfinite.bad(record)))
            expected.append("invalid_output")
        elif kind == 3:  # a value no conversion rule accepts
            requests.append(item(f"mix-{i}", {**record, "Age": "forty"}))
            expected.append(code_pb2.INVALID_ARGUMENT)
        elif kind == 5 and i < 12:  # a family not served here
            requests.append(item(f"mix-{i}", record, model="no-such-model"))
            expected.append(code_pb2.NOT_FOUND)
        else:
            requests.append(item(f"mix-{i}", record))
            expected.append("ok")
    requests.append(item("mix-0", records[0]))  # a request id repeated in the batch
    expected.append(code_pb2.INVALID_ARGUMENT)
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests), timeout=60)
    assert len(reply.results) == len(requests)
    ok = 0
    for request, result, want in zip(requests, reply.results, expected):
        if isinstance(want, int):
            assert result.WhichOneof("outcome") == "error" and result.error.code == want, request.request_id
            continue
        prediction_ = result.prediction
        alone = await stub.Predict(pb.PredictRequest(
            request_id=f"alone-{request.request_id}", entity_id=request.entity_id, model_name=request.model_name,
            attributes=request.attributes), timeout=10)
        assert decided(prediction_) == decided(alone), request.request_id
        if want == "invalid_output":
            assert prediction_.fallback and prediction_.reason_codes[0] == "MODEL_OUTPUT_INVALID"
            assert prediction_.degraded_reason == "MODEL_OUTPUT_INVALID" and prediction_.probability == 0.0
        else:
            assert not prediction_.fallback and 0.0 < prediction_.probability < 1.0
        ok += 1
    # every decided item (batch and alone) is on record once, in the CRM once
    assert ok == sum(1 for e in expected if isinstance(e, str))
    await crm_count(predictor)
    for request, want in zip(requests[:-1], expected[:-1]):
        recorded = await predictor.recorder.ledger.find(request.request_id)
        assert (recorded is not None) == isinstance(want, str), request.request_id


async def test_a_replayed_batch_returns_every_recorded_decision_and_records_nothing_new(prediction, credit_holdout):
    stub, predictor = prediction
    records = credit_holdout.records[200:240]
    first = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"replay-{i}", r) for i, r in enumerate(records)]), timeout=60)
    before = await crm_count(predictor)
    changed = dict(records[7], Age=records[7]["Age"] + 1)
    again = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"replay-{i}", changed if i == 7 else r) for i, r in enumerate(records)]), timeout=60)
    assert await crm_count(predictor) == before
    for i, (a, b) in enumerate(zip(first.results, again.results)):
        if i == 7:  # the same id with another payload: refused, this item alone
            assert b.WhichOneof("outcome") == "error" and b.error.code == code_pb2.ALREADY_EXISTS
            continue
        assert b.prediction.replayed and not a.prediction.replayed
        assert (b.prediction.decision_id, b.prediction.probability, list(b.prediction.reason_codes)) == \
            (a.prediction.decision_id, a.prediction.probability, list(a.prediction.reason_codes))
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Predict(item("replay-7", changed), timeout=10)
    assert excinfo.value.code() == grpc.StatusCode.ALREADY_EXISTS
