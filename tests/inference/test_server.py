"""InferenceService's own API over real gRPC: logits, the version contract and input limits.

Cases: C01 (payload size vs shape), C03 (more rows than the batch limit), C06 (feature
version checked per request), C08 (wrong dtype), C09 (NaN/Inf), C25 (metadata key case).
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.inference.converters import feature_version as read_feature_version
from mlpair.rpc import error_info
from tests.inference.helpers import MODEL, VERSION_HEADER, channel_to, expect_error, make_settings, running
from tests.support.inference import logits_of, request, tensor

MAX_BATCH = 64
MAX_REQUEST_ROWS = 12_000


@pytest.fixture(scope="module")
async def server(model_repository):
    settings = make_settings(model_repository, max_batch_size=MAX_BATCH, max_request_rows=MAX_REQUEST_ROWS,
                             max_queue_rows=2 * MAX_REQUEST_ROWS, max_queue_delay_ms=2)
    async with running(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
async def channel(server):
    async with channel_to(server) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="module")
def session(credit_entry):
    return ort.InferenceSession(str(credit_entry.model_path), providers=["CPUExecutionProvider"])


async def health_status(channel, service: str = "") -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_health_is_serving_overall_per_service_and_per_model(channel):
    for service in ("", "mlpair.inference.v1.InferenceService", "inference.GRPCInferenceService", MODEL):
        assert await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING


async def test_logits_match_onnx_runtime_on_real_holdout(stub, credit_entry, holdout_x, good_metadata, session):
    x = holdout_x[:40]
    reply = await stub.Infer(request(x), metadata=good_metadata)
    np.testing.assert_allclose(logits_of(reply), session.run(None, {"features": x})[0], atol=1e-6)
    assert reply.model_name == MODEL and reply.model_version == credit_entry.manifest.model_version


async def test_model_metadata_states_the_version_triple(stub, credit_entry):
    reply = await stub.ModelMetadata(pb.ModelMetadataRequest(model_name=MODEL))
    triple = credit_entry.manifest.versions
    assert (reply.versions.model_version, reply.versions.feature_schema_version, reply.versions.preprocessing_hash) == (
        triple.model_version, triple.feature_schema_version, triple.preprocessing_hash)
    assert list(reply.inputs[0].shape) == [-1, credit_entry.manifest.n_features]
    assert list(reply.available_versions) == [triple.model_version]


@pytest.mark.parametrize("delta", [-4, +4])
async def test_c01_payload_size_mismatch_is_refused_before_batching(stub, holdout_x, good_metadata, delta):
    x = holdout_x[:1]
    content = x.tobytes() + b"\0" * 4 if delta > 0 else x.tobytes()[:-4]
    bad = pb.InferRequest(model_name=MODEL, inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=content))
    valid = holdout_x[7:8]
    results = await asyncio.gather(stub.Infer(bad, metadata=good_metadata),
                                   stub.Infer(request(valid), metadata=good_metadata), return_exceptions=True)
    err = results[0]
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"needs {x.nbytes} bytes, got {len(content)}" in err.details()
    assert error_info(err).reason == "INVALID_INPUT"
    alone = await stub.Infer(request(valid), metadata=good_metadata)
    assert logits_of(results[1]).tobytes() == logits_of(alone).tobytes()


async def test_c01_byte_count_not_a_multiple_of_four_names_both_sizes(stub, holdout_x, good_metadata):
    x = holdout_x[:1]
    bad = pb.InferRequest(model_name=MODEL, inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape,
                                                            content=x.tobytes()[:-1]))
    err = await expect_error(stub.Infer(bad, metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"{x.nbytes - 1} bytes is not a multiple of 4" in err.details() and f"needs {x.nbytes}" in err.details()


async def test_c06_feature_version_checked_per_request_in_one_batch_window(stub, holdout_x, good_metadata, feature_version):
    right = stub.Infer(request(holdout_x[:1]), metadata=good_metadata)
    stale = stub.Infer(request(holdout_x[1:2]), metadata=((VERSION_HEADER, "credit-risk/v0"),))
    missing = stub.Infer(request(holdout_x[2:3]))
    results = await asyncio.gather(right, stale, missing, return_exceptions=True)
    assert isinstance(results[0], pb.InferResponse)
    alone = await stub.Infer(request(holdout_x[:1]), metadata=good_metadata)
    assert logits_of(results[0]).tobytes() == logits_of(alone).tobytes()
    for err, received in ((results[1], "credit-risk/v0"), (results[2], None)):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert feature_version in err.details()
        if received:
            assert received in err.details()
        assert error_info(err).reason == "FEATURE_VERSION_MISMATCH"


def test_c25_metadata_key_is_matched_in_any_case():
    assert read_feature_version((("X-Feature-Version", "v1"),)) == "v1"
    assert read_feature_version((("x-feature-version", "v1"),)) == "v1"
    assert read_feature_version((("X-FEATURE-VERSION", b"v1"),)) == "v1"
    assert read_feature_version((("other", "v1"),)) is None


async def test_c25_missing_key_is_failed_precondition(stub, holdout_x):
    """gRPC's own clients refuse upper-case keys ("Illegal header key"), so the any-case lookup
    above is proven at the function the servicers call; the project's client is checked for
    lower-case keys in tests/prediction (test_c25_client_emits_only_lower_case_metadata_keys)."""
    err = await expect_error(stub.Infer(request(holdout_x[:1])), grpc.StatusCode.FAILED_PRECONDITION)
    assert "missing x-feature-version" in err.details()


@pytest.mark.parametrize("data_type,dtype,name", [(pb.DATA_TYPE_FP64, np.float64, "FP64"),
                                                  (pb.DATA_TYPE_INT64, np.int64, "INT64"),
                                                  (pb.DATA_TYPE_FP16, np.float16, "FP16")])
async def test_c08_wrong_dtype_is_refused(stub, holdout_x, good_metadata, data_type, dtype, name):
    x = holdout_x[:2].astype(dtype)
    err = await expect_error(stub.Infer(pb.InferRequest(model_name=MODEL, inputs=tensor(x, data_type)),
                                        metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"expected FP32, got {name}" in err.details()


async def test_c09_nan_and_inf_are_refused_naming_row_and_column(stub, holdout_x, good_metadata):
    x = holdout_x[:3].copy()
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    err = await expect_error(stub.Infer(request(x), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert "row 1 column 4" in err.details() and "row 2 column 0" in err.details()
    ok = await stub.Infer(request(holdout_x[:3]), metadata=good_metadata)
    assert np.isfinite(logits_of(ok)).all()


@pytest.mark.parametrize("shape", [(1,), (1, 3), (2, 1, 5)])
async def test_wrong_shape_is_refused(stub, good_metadata, shape):
    x = np.zeros(shape, dtype=np.float32)
    await expect_error(stub.Infer(request(x), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)


async def test_c03_rows_above_max_batch_are_split_with_correct_per_row_results(stub, channel, holdout_x,
                                                                              good_metadata, session):
    n = holdout_x.shape[1]
    exact = await stub.Infer(request(holdout_x[:MAX_BATCH]), metadata=good_metadata)
    assert tuple(exact.logits.shape) == (MAX_BATCH, 2)
    over = holdout_x[:MAX_BATCH + 1]
    reply = await stub.Infer(request(over), metadata=good_metadata)
    np.testing.assert_allclose(logits_of(reply), session.run(None, {"features": over})[0], atol=1e-5)
    big = np.resize(holdout_x, (10_000, n))  # real rows, repeated
    reply = await stub.Infer(request(big), metadata=good_metadata)
    got = logits_of(reply)
    assert got.shape == (10_000, 2)
    np.testing.assert_allclose(got, session.run(None, {"features": big})[0], atol=1e-5)
    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_c03_rows_above_the_request_limit_are_refused_and_the_server_keeps_serving(stub, channel, holdout_x,
                                                                                        good_metadata):
    n = holdout_x.shape[1]
    too_many = np.zeros((MAX_REQUEST_ROWS + 1, n), dtype=np.float32)
    err = await expect_error(stub.Infer(request(too_many), metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"limit of {MAX_REQUEST_ROWS} rows" in err.details()
    # A billion rows declared with a tiny payload: refused on the declared shape, nothing allocated.
    huge = pb.InferRequest(model_name=MODEL, inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=[10**9, n],
                                                             content=b"\0" * 4 * n))
    await expect_error(stub.Infer(huge, metadata=good_metadata), grpc.StatusCode.INVALID_ARGUMENT)
    ok = await stub.Infer(request(holdout_x[:MAX_BATCH]), metadata=good_metadata)
    assert tuple(ok.logits.shape) == (MAX_BATCH, 2)
    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_empty_batch_gives_an_empty_result(stub, holdout_x, good_metadata):
    reply = await stub.Infer(request(holdout_x[:0]), metadata=good_metadata)
    assert tuple(reply.logits.shape) == (0, 2) and reply.logits.content == b""


async def test_unknown_model_and_version_are_not_found_listing_available(stub, holdout_x, good_metadata, credit_entry):
    err = await expect_error(stub.Infer(pb.InferRequest(model_name="nope", inputs=tensor(holdout_x[:1])),
                                        metadata=good_metadata), grpc.StatusCode.NOT_FOUND)
    assert MODEL in err.details()
    err = await expect_error(stub.Infer(request(holdout_x[:1], model_version="99"), metadata=good_metadata),
                             grpc.StatusCode.NOT_FOUND)
    assert f"available: {credit_entry.manifest.model_version}" in err.details()
    assert error_info(err).metadata["available_versions"] == credit_entry.manifest.model_version


async def test_messages_above_the_size_limit_get_a_clear_error(model_repository, holdout_x, good_metadata):
    """The server's explicit limit refuses a larger request; the client's own limit refuses a larger reply."""
    settings = make_settings(model_repository, max_message_bytes=64 * 1024, max_request_rows=4096,
                             max_queue_rows=4096)
    async with running(settings) as srv:
        async with channel_to(srv) as ch:
            big = np.resize(holdout_x, (1000, holdout_x.shape[1]))  # ~120 KB > 64 KiB
            err = await expect_error(pb_grpc.InferenceServiceStub(ch).Infer(request(big), metadata=good_metadata),
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "larger than max" in err.details()
        async with channel_to(srv, max_receive_message_length=1024) as ch:
            x = holdout_x[:200]  # reply: 200 x 2 x 4 = 1,600 bytes > 1 KiB
            err = await expect_error(pb_grpc.InferenceServiceStub(ch).Infer(request(x), metadata=good_metadata),
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "larger than max" in err.details()
