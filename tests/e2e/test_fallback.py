"""Without InferenceService and without a cached result, every family falls back to a person."""

from __future__ import annotations

import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests.e2e.conftest import crm_count, prediction_service
from tests.support.e2e import DEAD_INFERENCE


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


@pytest.mark.parametrize("logging_as", ["sample_ratio_1", "debug"])
async def test_c46_10_of_10_fallbacks_are_answered_as_review_while_every_decision_is_logged(
        without_inference, credit_holdout, logging_as):
    """PREDICTION_LOG_SAMPLE_RATIO=1 (or DEBUG logs) with InferenceService unreachable: every
    fallback is answered, and logged, never turned into INTERNAL by its log line."""
    import io
    import json
    import logging

    from mlpair import logs

    stub, _ = without_inference
    stream = io.StringIO()
    handler = logs.make_handler("json", stream)
    mlpair_logger = logging.getLogger("mlpair")
    previous_level = mlpair_logger.level
    previous_ratio = logs.set_sample_ratio(1.0 if logging_as == "sample_ratio_1" else 0.0)
    mlpair_logger.addHandler(handler)
    mlpair_logger.setLevel(logging.INFO if logging_as == "sample_ratio_1" else logging.DEBUG)
    try:
        replies = [await stub.Predict(item(f"c46-{logging_as}-{i}", r, "credit-risk"), timeout=10)
                   for i, r in enumerate(credit_holdout.records[:10])]
        again = await stub.Predict(item(f"c46-{logging_as}-0", credit_holdout.records[0], "credit-risk"), timeout=10)
    finally:
        mlpair_logger.removeHandler(handler)
        mlpair_logger.setLevel(previous_level)
        logs.set_sample_ratio(previous_ratio)
    assert [(r.decision_label, r.fallback, r.reason_codes[0]) for r in replies] == \
        [("REVIEW", True, "INFERENCE_UNAVAILABLE")] * 10
    assert again.replayed and again.decision_id == replies[0].decision_id  # a retry answers the same
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    decisions = [line for line in lines if line.get("decision") == "REVIEW"]
    assert len(decisions) == 11 and all(line["probability"] is None for line in decisions)
