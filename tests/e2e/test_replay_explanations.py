"""C62: an explanation asked for on a replay is never dropped without a word.

A request id already on record, sent again with ``explain``, gets the explanation of the recorded
decision when the model version that made it gives the same probability now; otherwise the
replay carries the warning EXPLANATION_NOT_RECORDED. Predict and BatchPredict.
"""

from __future__ import annotations

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests.e2e.conftest import crm_count, prediction_service
from tests.support.e2e import DEAD_INFERENCE


def item(request_id: str, record: dict, explain: bool) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=request_id, model_name="credit-risk",
                             attributes=to_attributes(record), explain=explain)


def contributions(reply: pb.PredictResponse) -> list[tuple[str, float]]:
    return [(c.feature, round(c.contribution, 6)) for c in reply.contributions]


async def test_c62_a_replay_asked_to_explain_gets_the_recorded_decisions_explanation(
        inference_server, model_repository, tmp_path, credit_holdout):
    records = credit_holdout.records[:3]
    async with prediction_service(inference_server, model_repository, tmp_path) as (stub, predictor):
        first = [await stub.Predict(item(f"c62-{i}", r, explain=False)) for i, r in enumerate(records)]
        fresh = [await stub.Predict(item(f"c62-fresh-{i}", r, explain=True)) for i, r in enumerate(records)]
        count = await crm_count(predictor)
        single = await stub.Predict(item("c62-0", records[0], explain=True))
        batch = await stub.BatchPredict(pb.BatchPredictRequest(
            requests=[item(f"c62-{i}", r, explain=True) for i, r in enumerate(records)]))
        assert await crm_count(predictor) == count  # replays write nothing
    replays = [single] + [r.prediction for r in batch.results]
    for replay, original, explained in zip(replays, [first[0], *first], [fresh[0], *fresh]):
        assert replay.replayed and replay.decision_id == original.decision_id
        assert replay.probability == original.probability
        assert len(replay.contributions) == 13 and contributions(replay) == contributions(explained)
        assert list(replay.top_reasons) == list(explained.top_reasons) and not replay.warnings


async def test_c62_a_replay_that_cannot_be_explained_again_says_so(
        inference_server, model_repository, tmp_path, credit_holdout):
    """Decided first without model output (InferenceService unreachable): nothing to explain it by."""
    records = credit_holdout.records[:2]
    async with prediction_service(DEAD_INFERENCE, model_repository, tmp_path, inference_timeout_ms=300,
                                  inference_max_attempts=1) as (stub, _):
        first = [await stub.Predict(item(f"c62-fb-{i}", r, explain=False), timeout=10) for i, r in enumerate(records)]
    assert all(r.fallback for r in first)
    async with prediction_service(inference_server, model_repository, tmp_path) as (stub, _):  # the same ledger
        single = await stub.Predict(item("c62-fb-0", records[0], explain=True))
        batch = await stub.BatchPredict(pb.BatchPredictRequest(
            requests=[item(f"c62-fb-{i}", r, explain=True) for i, r in enumerate(records)]))
        plain = await stub.Predict(item("c62-fb-1", records[1], explain=False))
    replays = [single] + [r.prediction for r in batch.results]
    for replay, original in zip(replays, [first[0], *first]):
        assert replay.replayed and replay.decision_id == original.decision_id and replay.fallback
        assert not replay.contributions and not replay.top_reasons
        [warning] = replay.warnings
        assert (warning.code, warning.field) == ("EXPLANATION_NOT_RECORDED", "explain")
        assert "not recorded" in warning.message and "new request id" in warning.message
    assert plain.replayed and not plain.warnings  # not asked to explain: nothing to say
