"""The Open Inference Protocol v2 on the same server, engine, batcher and checks.

Cases: C07 (malformed requests), C08 (wrong dtype), C09 (NaN/Inf), C25 (missing version),
plus NVIDIA's tritonclient driving the server and wire compatibility with its protocol.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.rpc import error_info
from tests.inference.helpers import MODEL, expect_error
from tests.support.inference import Tensor, oip_logits, oip_request


async def own_api_logits(channel, x: np.ndarray, feature_version: str) -> np.ndarray:
    reply = await pb_grpc.InferenceServiceStub(channel).Infer(
        pb.InferRequest(model_name=MODEL, inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes())),
        metadata=(("x-feature-version", feature_version),))
    return np.frombuffer(reply.logits.content, dtype="<f4").reshape(tuple(reply.logits.shape))


async def test_health_and_metadata_rpcs(stub, credit_entry):
    assert (await stub.ServerLive(oip.ServerLiveRequest())).live
    assert (await stub.ServerReady(oip.ServerReadyRequest())).ready
    assert (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL))).ready
    assert (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL, version="1"))).ready
    assert not (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL, version="7"))).ready
    assert not (await stub.ModelReady(oip.ModelReadyRequest(name="nope"))).ready
    meta = await stub.ServerMetadata(oip.ServerMetadataRequest())
    assert meta.name == "mlpair-inference" and meta.version
    model = await stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL))
    n = credit_entry.manifest.n_features
    assert (model.name, list(model.versions), model.platform) == (MODEL, ["1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("features", "FP32", [-1, n])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [("logits", "FP32", [-1, 2])]


async def test_raw_and_typed_contents_give_the_project_api_logits(stub, channel, holdout_x, feature_version):
    x = holdout_x[:32]
    expected = await own_api_logits(channel, x, feature_version)
    raw = await stub.ModelInfer(oip_request(x, feature_version=feature_version, id="r1"))
    assert raw.id == "r1" and raw.model_version == "1"
    assert oip_logits(raw).tobytes() == expected.tobytes()
    typed = oip.ModelInferRequest(
        model_name=MODEL, parameters={"x-feature-version": oip.InferParameter(string_param=feature_version)},
        inputs=[Tensor(name="features", datatype="FP32", shape=list(x.shape),
                       contents=oip.InferTensorContents(fp32_contents=x.ravel().tolist()))])
    assert oip_logits(await stub.ModelInfer(typed)).tobytes() == expected.tobytes()
    by_metadata = await stub.ModelInfer(oip_request(x), metadata=(("x-feature-version", feature_version),))
    assert oip_logits(by_metadata).tobytes() == expected.tobytes()


async def test_c25_feature_version_is_required_and_checked(stub, holdout_x, feature_version):
    x = holdout_x[:1]
    err = await expect_error(stub.ModelInfer(oip_request(x)), grpc.StatusCode.FAILED_PRECONDITION)
    assert "missing x-feature-version" in err.details()
    err = await expect_error(stub.ModelInfer(oip_request(x, feature_version="credit-risk/v0")),
                             grpc.StatusCode.FAILED_PRECONDITION)
    assert feature_version in err.details() and "credit-risk/v0" in err.details()
    err = await expect_error(stub.ModelInfer(oip_request(x, feature_version=feature_version),
                                             metadata=(("x-feature-version", "credit-risk/v0"),)),
                             grpc.StatusCode.INVALID_ARGUMENT)
    assert "send one" in err.details()


@pytest.mark.parametrize("case,message", [
    ("odd_bytes", "7 bytes is not a multiple of 4"),
    ("fp128", "unknown datatype 'FP128'"),
    ("negative", "must be non-negative"),
    ("duplicate", "input 'features' appears more than once"),
    ("unknown_input", "unknown input 'pixels'"),
    ("unknown_output", "unknown output 'probabilities'"),
    ("raw_and_typed", "both raw and typed contents"),
    ("typed_count", "needs 60 FP32 values, got 3"),
])
async def test_c07_malformed_requests_get_specific_errors(stub, holdout_x, feature_version, case, message):
    x = holdout_x[:2]
    n = x.shape[1]
    fv = feature_version
    requests = {
        "odd_bytes": oip_request(x[:1], raw=b"\0" * 7, feature_version=fv),
        "fp128": oip_request(x, datatype="FP128", feature_version=fv),
        "negative": oip_request(x, shape=[-1, n], feature_version=fv),
        "duplicate": oip.ModelInferRequest(model_name=MODEL, inputs=[Tensor(name="features", datatype="FP32", shape=[1, n])] * 2,
                                           raw_input_contents=[x[:1].tobytes()] * 2),
        "unknown_input": oip_request(x, name="pixels", feature_version=fv),
        "unknown_output": oip_request(x, feature_version=fv,
                                      outputs=[oip.ModelInferRequest.InferRequestedOutputTensor(name="probabilities")]),
        "raw_and_typed": oip.ModelInferRequest(
            model_name=MODEL, parameters={"x-feature-version": oip.InferParameter(string_param=fv)},
            inputs=[Tensor(name="features", datatype="FP32", shape=[2, n],
                           contents=oip.InferTensorContents(fp32_contents=[1.0]))], raw_input_contents=[x.tobytes()]),
        "typed_count": oip.ModelInferRequest(
            model_name=MODEL, parameters={"x-feature-version": oip.InferParameter(string_param=fv)},
            inputs=[Tensor(name="features", datatype="FP32", shape=[2, n],
                           contents=oip.InferTensorContents(fp32_contents=[1.0, 2.0, 3.0]))]),
    }
    err = await expect_error(stub.ModelInfer(requests[case]), grpc.StatusCode.INVALID_ARGUMENT)
    assert message in err.details()
    assert error_info(err).reason == "INVALID_INPUT"
    ok = await stub.ModelInfer(oip_request(x, feature_version=fv))  # the server is unharmed
    assert oip_logits(ok).shape == (2, 2)


async def test_c07_zero_rows_give_a_documented_empty_result(stub, holdout_x, feature_version):
    reply = await stub.ModelInfer(oip_request(holdout_x[:0], feature_version=feature_version))
    assert oip_logits(reply).shape == (0, 2)


@pytest.mark.parametrize("datatype,dtype", [("FP64", np.float64), ("INT64", np.int64), ("FP16", np.float16)])
async def test_c08_wrong_dtype_is_refused(stub, holdout_x, feature_version, datatype, dtype):
    x = holdout_x[:2].astype(dtype)
    err = await expect_error(stub.ModelInfer(oip_request(x, datatype=datatype, feature_version=feature_version)),
                             grpc.StatusCode.INVALID_ARGUMENT)
    assert f"expected FP32, got {datatype}" in err.details()


async def test_c09_nan_and_inf_are_refused_naming_row_and_column(stub, holdout_x, feature_version):
    x = holdout_x[:3].copy()
    x[0, 2] = np.nan
    x[2, 5] = -np.inf
    err = await expect_error(stub.ModelInfer(oip_request(x, feature_version=feature_version)),
                             grpc.StatusCode.INVALID_ARGUMENT)
    assert "row 0 column 2" in err.details() and "row 2 column 5" in err.details()


async def test_unknown_version_is_not_found_listing_available(stub, holdout_x, feature_version):
    err = await expect_error(stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version,
                                                         model_version="5")), grpc.StatusCode.NOT_FOUND)
    assert "available: 1" in err.details()


async def test_model_control_rpcs_are_refused_unless_explicit(stub):
    err = await expect_error(stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL)),
                             grpc.StatusCode.FAILED_PRECONDITION)
    assert "model_control=explicit" in err.details()
    index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
    # every model of the session's repository (credit-risk and churn), each at version 1, ready
    assert [(m.name, m.version, m.state) for m in index.models] == [("churn", "1", "READY"), (MODEL, "1", "READY")]


@pytest.mark.timeout(90)
async def test_tritonclient_gets_the_same_logits_as_the_project_api(server, channel, holdout_x, feature_version, tmp_path):
    """NVIDIA's tritonclient (a subprocess: it registers the same protobuf names) against this server."""
    x = holdout_x[:50]
    np.save(tmp_path / "rows.npy", x)
    script = Path(__file__).with_name("triton_client_check.py")
    # Asynchronously: the server runs on this event loop and must keep answering.
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), f"127.0.0.1:{server.port}", MODEL, feature_version, str(tmp_path / "rows.npy"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()[-3000:]
    report = json.loads(stdout)
    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["metadata"]["name"] == MODEL and report["metadata"]["versions"] == ["1"]
    expected = await own_api_logits(channel, x, feature_version)
    for how in ("by_parameter", "by_header"):
        got = np.asarray(report[how]["logits"], dtype=np.float32)
        assert got.tobytes() == expected.tobytes(), how
        assert report[how]["version"] == "1" and report[how]["id"] == "req-1"
    assert report["stale_error"]["status"] == "StatusCode.FAILED_PRECONDITION"

    # Wire compatibility: every field this server's proto shares with Triton's has the same
    # number, type and cardinality, and every RPC the same request/response types.
    ours = {}
    for name in oip.DESCRIPTOR.message_types_by_name:
        stack = [oip.DESCRIPTOR.message_types_by_name[name]]
        while stack:
            desc = stack.pop()
            stack.extend(desc.nested_types)
            ours.update({f"{desc.full_name}.{f.name}": [f.number, f.type, f.is_repeated] for f in desc.fields})
    theirs = report["wire"]
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 150
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    subsets = {"inference.ModelConfig", "inference.ModelInstanceGroup"}  # declared in part (proto comments)
    assert {k for k in theirs if k.rsplit(".", 1)[0] in {m.rsplit(".", 1)[0] for m in ours} - subsets} \
        <= ours.keys(), "a field Triton has on a shared message is missing here"
    assert report["data_types"] == {v.name: v.number for v in oip.DataType.DESCRIPTOR.values}
    service = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        assert report["methods"][method.name] == [method.input_type.full_name, method.output_type.full_name]


async def test_unexpected_errors_become_internal_without_internal_text(caplog):
    """The servicer guard maps anything unexpected to INTERNAL with a generic message (logged in full)."""
    from mlpair.inference.errors import DOMAIN
    from mlpair.inference.servicer import OpenInferenceServicer
    from mlpair.rpc import guard_servicer

    class Broken(OpenInferenceServicer):
        async def ServerMetadata(self, request, context):
            raise RuntimeError("secret internal detail at 0xdeadbeef")

    server = grpc.aio.server()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(guard_servicer(Broken(engine=None), DOMAIN), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            err = await expect_error(oip_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(oip.ServerMetadataRequest()),
                                     grpc.StatusCode.INTERNAL)
    finally:
        await server.stop(0)
    assert err.details() == "internal error" and "secret" not in str(err.trailing_metadata())
    assert error_info(err).reason == "INTERNAL" and "secret internal detail" in caplog.text
