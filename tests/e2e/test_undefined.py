"""What the contract does not define is refused, not ignored, on both services and both protocols.

Unknown fields at any depth (a newer client's field this server cannot honour) and conflicting
duplicate metadata get INVALID_ARGUMENT naming the item; unknown business attributes stay
tolerated but are named in the response's warnings, or refused with the strict setting.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.rpc import error_info
from tests.e2e.conftest import prediction_service
from tests.support.inference import oip_request

pytestmark = pytest.mark.timeout(60)
UNKNOWN_VARINT_99 = b"\x98\x06\x01"  # field 99, varint 1: no message of either service declares it


def with_unknown(message, extra: bytes = UNKNOWN_VARINT_99):
    """A copy of ``message`` carrying an unknown field, as a newer client's message would."""
    return type(message).FromString(message.SerializeToString() + extra)


async def refused(call, reason: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await call
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT, excinfo.value.details()
    assert error_info(excinfo.value).reason == reason
    return excinfo.value


@pytest.fixture(scope="module")
async def services(inference_server, model_repository, tmp_path_factory):
    """(default PredictionService, one with PREDICTION_UNKNOWN_ATTRIBUTES=refuse), each (stub, predictor)."""
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("undefined")) as served, \
            prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("strict"),
                               unknown_attributes="refuse") as strict:
        yield served, strict


@pytest.fixture(scope="module")
def prediction(services):
    return services[0]


@pytest.fixture(scope="module")
def infer_request(holdout_x) -> ipb.InferRequest:
    x = np.ascontiguousarray(holdout_x[:2])
    return ipb.InferRequest(model_name="credit-risk", inputs=ipb.Tensor(data_type=ipb.DATA_TYPE_FP32, shape=x.shape,
                                                                        content=x.tobytes()))


async def test_unknown_fields_in_the_own_api_are_refused_naming_each(inference_stub, infer_request, good_metadata):
    top = await refused(inference_stub.Infer(with_unknown(infer_request), metadata=good_metadata), "UNKNOWN_FIELD")
    assert "mlpair.inference.v1.InferRequest field 99" in top.details()
    nested = ipb.InferRequest()
    nested.CopyFrom(infer_request)
    nested.inputs.CopyFrom(with_unknown(infer_request.inputs, b"\x48\x01"))  # Tensor field 9
    error = await refused(inference_stub.Infer(nested, metadata=good_metadata), "UNKNOWN_FIELD")
    assert "inputs field 9" in error.details()
    assert (await inference_stub.Infer(infer_request, metadata=good_metadata)).logits.shape == [2, 2]


async def test_unknown_fields_in_oip_are_refused_unary_and_per_request_on_a_stream(inference_server, holdout_x,
                                                                                 feature_version):
    async with grpc.aio.insecure_channel(inference_server) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        good = oip_request(np.ascontiguousarray(holdout_x[:1]), feature_version=feature_version, id="a")
        bad = oip.ModelInferRequest()
        bad.CopyFrom(good)
        bad.id = "b"
        bad.inputs[0].CopyFrom(with_unknown(good.inputs[0]))
        error = await refused(stub.ModelInfer(bad), "UNKNOWN_FIELD")
        assert "inputs[0] field 99" in error.details()
        answers = [a async for a in stub.ModelStreamInfer(iter([good, bad, good]))]
    assert [a.error_message == "" for a in answers] == [True, False, True]
    assert answers[1].infer_response.parameters["error_reason"].string_param == "UNKNOWN_FIELD"


async def test_conflicting_duplicate_metadata_is_refused_on_both_services(inference_stub, inference_server,
                                                                         infer_request, feature_version, prediction,
                                                                         credit_holdout, holdout_x):
    twice = (("x-feature-version", feature_version), ("x-feature-version", feature_version + "-other"))
    error = await refused(inference_stub.Infer(infer_request, metadata=twice), "CONFLICTING_METADATA")
    assert error_info(error).metadata["key"] == "x-feature-version"
    same = (("x-feature-version", feature_version), ("x-feature-version", feature_version))
    assert (await inference_stub.Infer(infer_request, metadata=same)).logits.shape == [2, 2]  # one value, twice
    async with grpc.aio.insecure_channel(inference_server) as channel:
        await refused(oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            oip_request(np.ascontiguousarray(holdout_x[:1])), metadata=twice), "CONFLICTING_METADATA")
    stub, _ = prediction
    request = pb.PredictRequest(request_id="undefined-md", entity_id="e", attributes=to_attributes(credit_holdout.records[0]))
    before = invalid_predict_calls("credit-risk")
    error = await refused(stub.Predict(request, metadata=(("x-request-id", "a"), ("x-request-id", "b"))),
                          "CONFLICTING_METADATA")
    assert error_info(error).metadata["key"] == "x-request-id"
    assert invalid_predict_calls("credit-risk") == before + 1  # counted, under the family it named


async def test_an_attribute_value_of_a_kind_this_server_does_not_know_is_refused_not_read_as_missing(
        prediction, credit_holdout):
    stub, _ = prediction
    request = pb.PredictRequest(request_id="undefined-kind", entity_id="e", attributes=to_attributes(credit_holdout.records[0]))
    request.attributes["Income"].CopyFrom(pb.AttributeValue.FromString(b"\x20\x07"))  # a newer oneof member, field 4
    before = invalid_predict_calls("unknown")
    error = await refused(stub.Predict(request, timeout=10), "UNKNOWN_FIELD")
    assert "attributes['Income'] field 4" in error.details()
    batch = pb.BatchPredictRequest(requests=[request])
    await refused(stub.BatchPredict(batch, timeout=10), "UNKNOWN_FIELD")
    # refused before any family was read: counted under "unknown", once per call
    assert invalid_predict_calls("unknown") == before + 2


def invalid_predict_calls(model: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"model": model, "code": "INVALID_ARGUMENT"}
    return REGISTRY.get_sample_value("prediction_requests_total", labels) or 0.0


async def test_unknown_attributes_are_decided_and_named_or_refused_when_strict(services, credit_holdout):
    record = dict(credit_holdout.records[0])
    record["Incomee"] = record.pop("Income")  # a typo: Income is now missing
    (stub, _), (strict_stub, _) = services
    reply = await stub.Predict(pb.PredictRequest(request_id="undefined-typo", entity_id="e",
                                                 attributes=to_attributes(record)), timeout=10)
    assert [(w.code, w.field) for w in reply.warnings] == [("UNKNOWN_ATTRIBUTE", "Incomee")]
    assert reply.warnings[0].message.endswith("it was ignored (did you mean 'Income'?)")
    assert "INCOME_MISSING_DEFAULTED" in reply.reason_codes  # the attribute meant was treated as missing
    again = await stub.Predict(pb.PredictRequest(request_id="undefined-typo", entity_id="e",
                                                 attributes=to_attributes(record)), timeout=10)
    assert again.replayed and [w.field for w in again.warnings] == ["Incomee"]  # a replay names them too
    error = await refused(strict_stub.Predict(pb.PredictRequest(request_id="strict-typo", entity_id="e",
                                                                attributes=to_attributes(record)), timeout=10),
                          "UNKNOWN_ATTRIBUTE")
    assert "'Incomee'" in error.details() and error_info(error).metadata["attributes"] == "Incomee"
