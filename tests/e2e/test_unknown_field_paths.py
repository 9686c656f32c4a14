"""C59: a refusal of a field the contract does not define names the path to that field.

Real processes (``conftest.replicas``: PredictionService and InferenceService processes), called
over gRPC with hand-made wire bytes: a newer client's field inside a map entry, inside a map's
value, inside a repeated message or sent with another wire type than its declared field. Each is
refused INVALID_ARGUMENT ``UNKNOWN_FIELD`` naming exactly its path, in PredictionService's Predict
and BatchPredict and InferenceService's own protocol and Open Inference Protocol (unary and
stream); the same request without the field is answered.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.rpc import error_info
from tests.e2e.replicas import request
from tests.support.inference import oip_request

pytestmark = pytest.mark.timeout(120)


def varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def field(number: int, data: bytes | int) -> bytes:
    """One field on the wire: length-delimited for bytes, a varint for an int."""
    if isinstance(data, int):
        return varint(number << 3) + varint(data)
    return varint(number << 3 | 2) + varint(len(data)) + data


def entry(key: str, value: bytes, *extra: bytes) -> bytes:
    """A map entry (key field 1, value field 2) with ``extra`` fields of its own."""
    return field(1, key.encode()) + field(2, value) + b"".join(extra)


def unary(channel: grpc.aio.Channel, method: str, data: bytes):
    """Calls ``method`` with ``data`` as the request's wire bytes, as they are; the reply's bytes."""
    return channel.unary_unary(method)(data, timeout=30)


async def refusal(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await call
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_info(excinfo.value).reason == "UNKNOWN_FIELD"
    return excinfo.value.details()


def named(details: str) -> str:
    """The fields an UNKNOWN_FIELD refusal names."""
    return details.split("cannot honour them: ")[1].split("; upgrade the server first")[0]


@pytest.fixture(scope="module")
async def inference_channel(replicas):
    """A channel to the cluster's InferenceService process."""
    async with grpc.aio.insecure_channel(replicas.pair.inference.address) as channel:
        yield channel


def in_batch_item(path: str) -> str:
    """A PredictRequest's path as the second item of a BatchPredictRequest."""
    top = "mlpair.prediction.v1.PredictRequest"
    return path.replace(top, "requests[1]") if path.startswith(top) else f"requests[1].{path}"


async def test_c59_predictionservice_names_the_path_inside_a_map_entry_its_value_and_a_batch_item(
        replicas, credit_holdout):
    channel = replicas.channels[0]
    good = request("c59-good", credit_holdout.records[0], model_name="credit-risk")
    income = pb.AttributeValue(number_value=129.0).SerializeToString()
    newer_kind = income + field(4, 7)  # an AttributeValue with a newer oneof member
    cases = [  # (extra bytes appended to a good PredictRequest, the paths named)
        (field(3, entry("Income", income, field(3, 1))), ["attributes['Income'] entry field 3"]),
        (field(3, entry("Income", newer_kind)), ["attributes['Income'] field 4"]),
        (field(3, entry("Income", newer_kind, field(7, b"x"))),
         ["attributes['Income'] entry field 7", "attributes['Income'] field 4"]),
        (field(3, 5), ["mlpair.prediction.v1.PredictRequest field 3 (attributes) sent as a varint, not as its declared type"]),
        (field(99, 1), ["mlpair.prediction.v1.PredictRequest field 99"]),
    ]
    answers = []
    for extra, paths in cases:
        data = good.SerializeToString() + extra
        answers.append(named(await refusal(unary(channel, "/mlpair.prediction.v1.PredictionService/Predict", data))))
        assert answers[-1] == ", ".join(paths)
        batch = field(1, request("c59-b0", credit_holdout.records[1]).SerializeToString()) + field(1, data)
        answers.append(named(await refusal(unary(channel, "/mlpair.prediction.v1.PredictionService/BatchPredict", batch))))
        assert answers[-1] == ", ".join(map(in_batch_item, paths))
    assert len(answers) == 10
    reply = pb.PredictResponse.FromString(
        await unary(channel, "/mlpair.prediction.v1.PredictionService/Predict", good.SerializeToString()))
    assert reply.decision_label


async def test_c59_inferenceservice_names_the_path_in_oip_parameters_tensors_and_its_own_protocol(
        inference_channel, holdout_x, feature_version):
    channel = inference_channel
    x = np.ascontiguousarray(holdout_x[:1])
    good = oip_request(x, feature_version=feature_version, id="c59")
    parameter = oip.InferParameter(string_param="v").SerializeToString()
    tensor = good.inputs[0].SerializeToString()
    cases = {  # extra bytes appended to a good ModelInferRequest → the path named
        field(4, entry("priority", parameter, field(3, 1))): "parameters['priority'] entry field 3",
        field(4, entry("priority", parameter + field(9, 1))): "parameters['priority'] field 9",
        field(5, tensor + field(4, entry("k", parameter, field(5, 2)))): "inputs[1].parameters['k'] entry field 5",
        field(5, tensor + field(99, 1)): "inputs[1] field 99",
    }
    answers = []
    for extra, path in cases.items():
        data = good.SerializeToString() + extra
        answers.append(named(await refusal(unary(channel, "/inference.GRPCInferenceService/ModelInfer", data))))
        assert answers[-1] == path
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=None,
                                   response_deserializer=oip.ModelStreamInferResponse.FromString)
    bad = good.SerializeToString() + field(4, entry("priority", parameter, field(3, 1)))
    streamed = [a async for a in stream(iter([good.SerializeToString(), bad]), timeout=30)]
    assert [a.error_message == "" for a in streamed] == [True, False]
    assert "parameters['priority'] entry field 3" in streamed[1].error_message
    infer = ipb.InferRequest(model_name="credit-risk", inputs=ipb.Tensor(
        data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes())).SerializeToString()
    metadata = (("x-feature-version", feature_version),)
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await channel.unary_unary("/mlpair.inference.v1.InferenceService/Infer")(infer + field(3, 1),
                                                                                metadata=metadata, timeout=30)
    assert named(excinfo.value.details()) == \
        "mlpair.inference.v1.InferRequest field 3 (inputs) sent as a varint, not as its declared type"
    assert len(answers) == 4
    assert oip.ModelInferResponse.FromString(
        await unary(channel, "/inference.GRPCInferenceService/ModelInfer", good.SerializeToString())).outputs
