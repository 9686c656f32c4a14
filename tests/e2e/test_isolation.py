"""No caller changes another caller's outcome, in one PredictionService process (C43, C44, C45).

Real servers in process: InferenceService serving a credit-risk entry whose logits are NaN for
applicants of 95+ (``tests.nonfinite``), PredictionService in front of it with the cache off, so
every answer comes from an Infer call that other callers' rows may share. Each example of the
cases is a test with its exact count; the same isolation with several processes is in
``test_isolation_replicas.py``.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.converters import to_attributes
from tests import nonfinite
from tests.e2e.conftest import crm_count, inference_service, prediction_service

pytestmark = pytest.mark.timeout(120)
MODEL = "credit-risk"


@pytest.fixture(scope="module")
async def inference(nonfinite_repository):
    async with inference_service(nonfinite_repository) as target:
        yield target


@pytest.fixture(scope="module")
async def prediction(inference, nonfinite_repository, tmp_path_factory):
    async with prediction_service(inference, nonfinite_repository, tmp_path_factory.mktemp("isolation"),
                                  cache_backend="off") as served:
        yield served


def item(request_id: str, record: dict, explain: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=f"entity-{request_id}", model_name=MODEL,
                             attributes=to_attributes(record), explain=explain)


def decided(reply: pb.PredictResponse) -> tuple:
    """What must not depend on other callers: decision, probability (bit for bit), reasons, how served."""
    return (reply.decision_label, reply.probability, list(reply.reason_codes), reply.model_version,
            reply.fallback, reply.stale, reply.degraded_reason)


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
