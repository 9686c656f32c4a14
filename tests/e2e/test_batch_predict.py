"""BatchPredict against real servers: request order, per-item errors, packing into inference calls."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2, error_details_pb2
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests.e2e.conftest import crm_count, inference_service, prediction_service
from tests.support.e2e import expected_probabilities

SMALL_BATCH = 20  # InferenceService's max_batch_size here; churn explanations need 19 rows


@pytest.fixture(scope="module")
async def small_inference(model_repository):
    """An InferenceService that refuses any call above 20 rows: a packing mistake cannot hide."""
    async with inference_service(model_repository, max_batch_size=SMALL_BATCH) as target:
        yield target


@pytest.fixture(scope="module")
async def prediction(small_inference, model_repository, tmp_path_factory):
    async with prediction_service(small_inference, model_repository, tmp_path_factory.mktemp("crm"),
                                  inference_max_batch_rows=SMALL_BATCH, max_batch_items=100) as served:
        yield served


def item(request_id: str, entity_id: str, attributes: dict, model_name: str = "credit-risk", explain: bool = False):
    return pb.PredictRequest(request_id=request_id, entity_id=entity_id, attributes=to_attributes(attributes),
                             model_name=model_name, explain=explain)


def rows_metric(model: str) -> tuple[float, float]:
    """(Infer calls, rows sent) so far for ``model``, from PredictionService's own metrics."""
    labels = {"model": model}
    return (REGISTRY.get_sample_value("prediction_inference_call_rows_count", labels) or 0.0,
            REGISTRY.get_sample_value("prediction_inference_call_rows_sum", labels) or 0.0)


def error_info(status) -> error_details_pb2.ErrorInfo:
    [detail] = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


async def test_rows_are_packed_into_calls_no_larger_than_the_inference_max_batch(prediction, credit_holdout, credit_entry):
    stub, _ = prediction
    n = 40
    calls0, rows0 = rows_metric("credit-risk")
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"pack-{i}", eid, rec) for i, (eid, rec) in enumerate(zip(credit_holdout.entity_ids[:n], credit_holdout.records))]))
    calls, rows = rows_metric("credit-risk")
    # every item decided: InferenceService would have refused any call above SMALL_BATCH rows
    assert [r.WhichOneof("outcome") for r in reply.results] == ["prediction"] * n
    assert rows - rows0 == n
    assert calls - calls0 == -(-n // SMALL_BATCH)  # ceil(40 / 20) = 2 calls, not 40
    expected = expected_probabilities(credit_entry, credit_holdout.records[:n])
    got = np.array([r.prediction.probability for r in reply.results])
    np.testing.assert_allclose(got, expected, atol=1e-6)


async def test_explanations_in_a_batch_keep_each_item_in_one_call(prediction, credit_holdout):
    """Each explained credit item needs 14 rows: no two fit in 20, and none is split."""
    stub, _ = prediction
    calls0, rows0 = rows_metric("credit-risk")
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"pack-explain-{i}", eid, rec, explain=True)
        for i, (eid, rec) in enumerate(zip(credit_holdout.entity_ids[:5], credit_holdout.records))]))
    calls, rows = rows_metric("credit-risk")
    assert all(len(r.prediction.contributions) == 13 for r in reply.results)
    assert (calls - calls0, rows - rows0) == (5, 5 * 14)


async def test_a_bad_item_gets_its_own_error_and_results_keep_request_order(prediction, credit_holdout, churn_holdout):
    stub, predictor = prediction
    before = await crm_count(predictor)
    requests = [
        item("order-0", "a", credit_holdout.records[0]),
        item("order-1", "b", {"Age": "thirty", "Home": 4.0}),                      # unconvertible values
        item("order-2", "c", churn_holdout.records[0], model_name="churn"),        # another family
        item("order-3", "d", credit_holdout.records[1], model_name="fraud"),       # unknown family
        item("", "e", credit_holdout.records[2]),                                   # missing request id
        item("order-5", "f", credit_holdout.records[3]),
        item("order-5", "g", credit_holdout.records[4]),                            # duplicated request id
        item("order-7", "h", {**credit_holdout.records[5], "Income": 99999999}),   # guarded, still decided
    ]
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests))
    kinds = [r.WhichOneof("outcome") for r in reply.results]
    assert kinds == ["prediction", "error", "prediction", "error", "error", "prediction", "error", "prediction"]
    for request, result in zip(requests, reply.results):
        if result.WhichOneof("outcome") == "prediction":
            assert result.prediction.request_id == request.request_id
    errors = {i: reply.results[i].error for i in (1, 3, 4, 6)}
    assert errors[1].code == code_pb2.INVALID_ARGUMENT
    assert error_info(errors[1]).metadata["attributes"] == "Age,Home"
    assert errors[3].code == code_pb2.NOT_FOUND and error_info(errors[3]).reason == "UNKNOWN_MODEL"
    assert errors[4].code == code_pb2.INVALID_ARGUMENT and error_info(errors[4]).metadata["field"] == "request_id"
    assert errors[6].code == code_pb2.INVALID_ARGUMENT and "more than once" in errors[6].message
    assert all(error_info(e).domain == "prediction.mlpair" and "Traceback" not in e.message for e in errors.values())
    assert reply.results[2].prediction.decision_label in ("NO_ACTION", "RETAIN_OFFER")
    assert "INCOME_SENTINEL_DEFAULTED" in reply.results[7].prediction.reason_codes
    assert await crm_count(predictor) == before + 4


async def test_batch_items_are_idempotent_like_predict(prediction, credit_holdout):
    stub, predictor = prediction
    requests = [item(f"idem-{i}", eid, rec) for i, (eid, rec) in enumerate(zip(credit_holdout.entity_ids[:6], credit_holdout.records))]
    first = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests[:3]))
    count = await crm_count(predictor)
    second = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests))  # 3 retried, 3 new
    assert [r.prediction.decision_id for r in second.results[:3]] == [r.prediction.decision_id for r in first.results]
    assert await crm_count(predictor) == count + 3
    single = await stub.Predict(requests[4])
    assert single.decision_id == second.results[4].prediction.decision_id


async def test_an_inference_failure_fails_only_the_items_of_that_call(model_repository, credit_holdout, churn_holdout,
                                                                      tmp_path):
    """Churn is not loaded by this InferenceService: churn items fail alone, credit items succeed."""
    import shutil

    only_credit = tmp_path / "models"
    shutil.copytree(model_repository / "credit-risk", only_credit / "credit-risk")
    async with (
        inference_service(only_credit) as target,
        prediction_service(target, model_repository, tmp_path) as (stub, _),
    ):
        reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
            item("mixed-0", "a", credit_holdout.records[0]),
            item("mixed-1", "b", churn_holdout.records[0], model_name="churn"),
            item("mixed-2", "c", credit_holdout.records[1]),
        ]))
    assert [r.WhichOneof("outcome") for r in reply.results] == ["prediction", "error", "prediction"]
    assert reply.results[1].error.code == code_pb2.FAILED_PRECONDITION


async def test_empty_batch_and_too_many_items(prediction, credit_holdout):
    stub, _ = prediction
    assert len((await stub.BatchPredict(pb.BatchPredictRequest())).results) == 0
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.BatchPredict(pb.BatchPredictRequest(requests=[
            item(f"many-{i}", "e", credit_holdout.records[0]) for i in range(101)]))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT


COUNTED = ("prediction_feature_guard_total", "prediction_unknown_attributes_total", "prediction_requests_total",
           "prediction_decisions_total")


def counted() -> dict[tuple, float]:
    """The counters a decision moves, by sample name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in REGISTRY.collect() for s in metric.samples if s.name in COUNTED}


def moved(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def test_a_batch_decides_and_counts_exactly_as_the_same_predict_calls(prediction, credit_holdout, churn_holdout):
    """Batch-wide assembly and metrics: every item's decision, reason codes and counter increments
    are those of a Predict call with the same attributes (guards, unknown attributes, errors)."""
    stub, _ = prediction
    cases = [
        (credit_holdout.records[10], "credit-risk"),
        ({**credit_holdout.records[11], "Income": 99999999, "Age": None, "FavouriteColour": "blue"}, "credit-risk"),
        ({"Age": "thirty", "Home": 4.0}, "credit-risk"),                                   # unconvertible values
        ({**churn_holdout.records[3], "tenure": -5, "Zodiac": "leo"}, "churn"),
        ({**credit_holdout.records[12], "Home": "castle", "Job": ""}, "credit-risk"),
        (credit_holdout.records[13], "fraud"),                                             # unknown family
        (churn_holdout.records[4], "churn"),
    ]

    before = counted()
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"same-batch-{i}", f"e{i}", attrs, model_name=model) for i, (attrs, model) in enumerate(cases)]))
    by_batch = moved(before, counted())

    before = counted()
    singles = []
    for i, (attrs, model) in enumerate(cases):
        try:
            singles.append(await stub.Predict(item(f"same-single-{i}", f"e{i}", attrs, model_name=model)))
        except grpc.aio.AioRpcError as exc:
            singles.append(exc.code())
    by_predict = moved(before, counted())

    assert by_batch == by_predict
    assert any(k[0] == "prediction_feature_guard_total" for k in by_batch)
    assert any(k[0] == "prediction_unknown_attributes_total" for k in by_batch)
    for result, single in zip(reply.results, singles):
        if isinstance(single, grpc.StatusCode):
            assert result.WhichOneof("outcome") == "error" and result.error.code == single.value[0]
            continue
        p = result.prediction
        assert (p.decision_label, p.probability, list(p.reason_codes), p.model_version) == \
            (single.decision_label, single.probability, list(single.reason_codes), single.model_version)


async def test_responses_read_from_the_columns_equal_the_ones_built_from_each_result(prediction, credit_holdout,
                                                                                     churn_holdout):
    """``converters.batch_response`` reads fresh decisions straight from their columns; on a call
    with every kind of outcome (fresh, warned, explained, replayed, refused, two families) the
    response equals the one built from each item's result object, as Predict encodes it."""
    from mlpair.prediction.intake import converters
    from mlpair.prediction.outcomes import PredictInput, PredictionResult

    predictor = prediction[1].predictor

    def inputs(prefix: str) -> list[PredictInput]:
        credit = [PredictInput(f"{prefix}-c{i}", eid, rec, "credit-risk")
                  for i, (eid, rec) in enumerate(zip(credit_holdout.entity_ids[:24], credit_holdout.records))]
        credit[3] = PredictInput(credit[3].request_id, "e3", {**credit[3].attributes, "not_in_schema": 1.0}, "credit-risk")
        credit[5] = PredictInput(credit[5].request_id, "e5", credit[5].attributes, "credit-risk", explain=True)
        churn = [PredictInput(f"{prefix}-h{i}", eid, rec, "churn")
                 for i, (eid, rec) in enumerate(zip(churn_holdout.entity_ids[:10], churn_holdout.records))]
        return [*credit, PredictInput("", "e", {}, "credit-risk"), *churn, PredictInput(f"{prefix}-x", "e", {}, "fraud")]

    await predictor.predict_batch(inputs("written")[:4])  # on record before: replayed below
    outcomes = await predictor.predict_batch(inputs("written"))
    built = converters.batch_response(outcomes)  # before any item is read: from the columns
    expected = pb.BatchPredictResponse(results=[
        pb.BatchPredictResult(prediction=converters.predict_response(o)) if isinstance(o, PredictionResult)
        else pb.BatchPredictResult(error=converters.error_status(o)) for o in outcomes])
    assert built == expected
    assert built.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    kinds = [r.WhichOneof("outcome") for r in built.results]
    assert kinds.count("error") == 2 and kinds.count("prediction") == len(kinds) - 2
    predictions = [r.prediction for r in built.results if r.WhichOneof("outcome") == "prediction"]
    assert sum(p.replayed for p in predictions) == 4
    assert any(p.warnings for p in predictions) and any(p.contributions for p in predictions)
    assert all(p.HasField("decided_at") for p in predictions)
