"""Without InferenceService and without a cached result, every family falls back to a person."""

from __future__ import annotations

import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.converters import to_attributes
from tests.e2e.conftest import crm_count, prediction_service

DEAD_INFERENCE = "127.0.0.1:1"  # nothing listens on port 1


@pytest.fixture(scope="module")
async def without_inference(model_repository, tmp_path_factory):
    async with prediction_service(DEAD_INFERENCE, model_repository, tmp_path_factory.mktemp("fallback"),
                                  inference_timeout_ms=300, inference_max_attempts=1) as served:
        yield served


def item(request_id: str, record: dict, family: str, explain: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=request_id, model_name=family,
                             attributes=to_attributes(record), explain=explain)


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_fallback_is_review_with_inference_unavailable_for_every_family(without_inference, family,
                                                                             credit_holdout, churn_holdout):
    stub, predictor = without_inference
    holdout = credit_holdout if family == "credit-risk" else churn_holdout
    before = await crm_count(predictor)
    reply = await stub.Predict(item(f"fb-{family}", holdout.records[0], family, explain=True), timeout=10)
    assert (reply.decision_label, reply.decision) == ("REVIEW", pb.DECISION_REVIEW)
    assert reply.reason_codes[0] == "INFERENCE_UNAVAILABLE" and reply.fallback and not reply.stale
    assert reply.probability == 0.0 and not reply.contributions  # no model output, nothing to explain
    batch = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"fb-{family}-b{i}", rec, family) for i, rec in enumerate(holdout.records[1:4])]), timeout=10)
    assert [r.prediction.decision_label for r in batch.results] == ["REVIEW"] * 3
    assert all(r.prediction.fallback for r in batch.results)
    assert await crm_count(predictor) == before + 4  # fallbacks are recorded like any decision
