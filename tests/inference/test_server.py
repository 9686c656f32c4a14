"""InferenceService over real gRPC: logits, the version contract (C06, C25) and input checks."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.inference.converters import feature_version
from mlpair.rpc import error_info

MODEL = "credit-risk"
VERSION_HEADER = "x-feature-version"


def tensor(x: np.ndarray, data_type=pb.DATA_TYPE_FP32) -> pb.Tensor:
    return pb.Tensor(data_type=data_type, shape=x.shape, content=x.tobytes())


def request(x: np.ndarray, **kw) -> pb.InferRequest:
    return pb.InferRequest(model_name=MODEL, inputs=tensor(np.ascontiguousarray(x, dtype=np.float32)), **kw)


def logits_of(reply: pb.InferResponse) -> np.ndarray:
    return np.frombuffer(reply.logits.content, dtype="<f4").reshape(tuple(reply.logits.shape))


@pytest.fixture(scope="module")
def holdout_x(credit_entry, credit_holdout) -> np.ndarray:
    return FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records)[:40]


@pytest.fixture(scope="module")
def good_metadata(credit_entry):
    return ((VERSION_HEADER, credit_entry.manifest.versions.feature_schema_version),)


async def expect_error(call, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await call
    assert excinfo.value.code() == code, excinfo.value.details()
    return excinfo.value


async def test_health_is_serving_overall_and_per_service(inference_server):
    async with grpc.aio.insecure_channel(inference_server) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mlpair.inference.v1.InferenceService"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_logits_match_onnx_runtime_on_real_holdout(inference_stub, credit_entry, holdout_x, good_metadata):
    reply = await inference_stub.Infer(request(holdout_x), metadata=good_metadata)
    session = ort.InferenceSession(str(credit_entry.model_path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"features": holdout_x})[0]
    np.testing.assert_allclose(logits_of(reply), expected, atol=1e-6)
    assert reply.model_name == MODEL and reply.model_version == credit_entry.manifest.model_version


async def test_model_metadata_states_the_version_triple(inference_stub, credit_entry):
    reply = await inference_stub.ModelMetadata(pb.ModelMetadataRequest(model_name=MODEL))
    triple = credit_entry.manifest.versions
    assert (reply.versions.model_version, reply.versions.feature_schema_version, reply.versions.preprocessing_hash) == (
        triple.model_version, triple.feature_schema_version, triple.preprocessing_hash)
    assert list(reply.inputs[0].shape) == [-1, credit_entry.manifest.n_features]
    assert list(reply.available_versions) == [triple.model_version]


async def test_c06_feature_version_checked_per_request(inference_stub, holdout_x, good_metadata, credit_entry):
    expected = credit_entry.manifest.versions.feature_schema_version
    right = inference_stub.Infer(request(holdout_x[:1]), metadata=good_metadata)
    stale = inference_stub.Infer(request(holdout_x[1:2]), metadata=((VERSION_HEADER, "credit-risk/v0"),))
    missing = inference_stub.Infer(request(holdout_x[2:3]))
    results = await asyncio.gather(right, stale, missing, return_exceptions=True)
    assert isinstance(results[0], pb.InferResponse)
    alone = await inference_stub.Infer(request(holdout_x[:1]), metadata=good_metadata)
    assert logits_of(results[0]).tobytes() == logits_of(alone).tobytes()
    for err, received in ((results[1], "credit-risk/v0"), (results[2], None)):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert expected in err.details()
        if received:
            assert received in err.details()
        assert error_info(err).reason == "FEATURE_VERSION_MISMATCH"


def test_c25_metadata_key_is_matched_in_any_case():
    assert feature_version((("X-Feature-Version", "v1"),)) == "v1"
    assert feature_version((("x-feature-version", "v1"),)) == "v1"
    assert feature_version((("X-FEATURE-VERSION", b"v1"),)) == "v1"
    assert feature_version((("other", "v1"),)) is None


@pytest.mark.parametrize("data_type,dtype,name", [(pb.DATA_TYPE_FP64, np.float64, "FP64"),
                                                  (pb.DATA_TYPE_INT64, np.int64, "INT64"),
                                                  (pb.DATA_TYPE_FP16, np.float16, "FP16")])
async def test_wrong_dtype_is_refused(inference_stub, holdout_x, good_metadata, data_type, dtype, name):
    x = holdout_x[:2].astype(dtype)
    err = await expect_error(inference_stub.Infer(pb.InferRequest(model_name=MODEL, inputs=tensor(x, data_type)),
                                                  metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"expected FP32, got {name}" in err.details()


@pytest.mark.parametrize("delta", [-4, +4, -1])
async def test_payload_size_must_match_shape(inference_stub, holdout_x, good_metadata, delta):
    x = holdout_x[:1]
    content = x.tobytes() + b"\0" * max(delta, 0)
    content = content[:len(content) + min(delta, 0)]
    bad = pb.InferRequest(model_name=MODEL, inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=content))
    err = await expect_error(inference_stub.Infer(bad, metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"needs {x.nbytes} bytes, got {len(content)}" in err.details()


async def test_nan_and_inf_are_refused_naming_row_and_column(inference_stub, holdout_x, good_metadata):
    x = holdout_x[:3].copy()
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    err = await expect_error(inference_stub.Infer(request(x), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert "row 1 column 4" in err.details() and "row 2 column 0" in err.details()


@pytest.mark.parametrize("shape", [(1,), (1, 3), (2, 1, 5)])
async def test_wrong_shape_is_refused(inference_stub, good_metadata, shape):
    x = np.zeros(shape, dtype=np.float32)
    await expect_error(inference_stub.Infer(request(x), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)


async def test_rows_above_the_limit_are_refused_and_the_server_keeps_serving(inference_stub, holdout_x, good_metadata):
    big = np.zeros((65, holdout_x.shape[1]), dtype=np.float32)  # fixture's max_batch_size is 64
    err = await expect_error(inference_stub.Infer(request(big), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert "limit of 64" in err.details()
    ok = await inference_stub.Infer(request(big[:64]), metadata=good_metadata)
    assert tuple(ok.logits.shape) == (64, 2)


async def test_empty_batch_gives_an_empty_result(inference_stub, holdout_x, good_metadata):
    reply = await inference_stub.Infer(request(holdout_x[:0]), metadata=good_metadata)
    assert tuple(reply.logits.shape) == (0, 2) and reply.logits.content == b""


async def test_unknown_model_and_version_are_not_found(inference_stub, holdout_x, good_metadata, credit_entry):
    await expect_error(inference_stub.Infer(pb.InferRequest(model_name="nope", inputs=tensor(holdout_x[:1])),
                                            metadata=good_metadata), grpc.StatusCode.NOT_FOUND)
    err = await expect_error(inference_stub.Infer(request(holdout_x[:1], model_version="99"), metadata=good_metadata),
                             grpc.StatusCode.NOT_FOUND)
    assert f"available: {credit_entry.manifest.model_version}" in err.details()
