"""Property-based fuzzing of InferenceService's requests, both protocols, against a real server process.

Hypothesis builds malformed and valid requests: tensors of any data type, shape and byte
count (raw bytes or typed contents), several or no inputs, requested outputs, request
parameters, metadata keys and values, very long and non-ASCII model names, versions and ids.
Whatever arrives, the answer is OK or a specific client-error status, never INTERNAL or
UNKNOWN; the process never dies and still reports SERVING.

``make test`` runs a short version (``MLPAIR_FUZZ_EXAMPLES``, default 40 per protocol, a few
seconds); for a long run: ``MLPAIR_FUZZ_EXAMPLES=3000 .venv/bin/python -m pytest -q
tests/inference/test_fuzz.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.rpc import wait_until_serving

EXAMPLES = int(os.environ.get("MLPAIR_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
# What a well-behaved server may answer to a bad request; INTERNAL and UNKNOWN are bugs.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
MAX_ROWS = 256  # the fuzzed server's max_request_rows: big enough for splits, small enough to be quick
OIP_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16",
             "FP32", "FP64", "BYTES"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory):
    """``mlpair serve inference`` in its own process on a free loopback port; stopped by PID."""
    port = _free_port()
    log = tmp_path_factory.mktemp("fuzz") / "inference.log"
    env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MAX_BATCH_SIZE": "64",
           "INFERENCE_MAX_REQUEST_ROWS": str(MAX_ROWS), "INFERENCE_LOG_LEVEL": "WARNING"}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", 60, lambda: process.poll() is None), \
            f"the server did not report SERVING: {log.read_text()[-2000:]}"
        yield process, channel, log
    finally:
        channel.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _assert_still_serving(server, credit_entry) -> None:
    process, channel, log = server
    assert process.poll() is None, f"the server died: {log.read_text()[-2000:]}"
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    x = np.zeros((2, credit_entry.manifest.n_features), np.float32)
    ok = pb_grpc.InferenceServiceStub(channel).Infer(
        pb.InferRequest(model_name="credit-risk", inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape,
                                                                   content=x.tobytes())),
        timeout=5, metadata=(("x-feature-version", credit_entry.manifest.versions.feature_schema_version),))
    assert list(ok.logits.shape) == [2, 2]
    assert "unexpected error" not in log.read_text()


def _call(method, request, metadata):
    """The call's status code (OK included); the property every example must hold."""
    try:
        method(request, timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, f"{exc.code().name}: {exc.details()}"
        assert "Traceback" not in (exc.details() or "")
        return exc.code()


# -- strategies -----------------------------------------------------------------------------------

names = st.one_of(st.sampled_from(["credit-risk", "churn", "", "CREDIT-RISK", "credit-risk "]),
                  st.text(max_size=40), st.text(min_size=300, max_size=2000))
versions = st.one_of(st.sampled_from(["", "1", "2", "0", "-1", "01", "999999999999999999999"]), st.text(max_size=30))
header_keys = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,30}", fullmatch=True).filter(
    lambda k: not k.startswith("grpc-") and not k.endswith("-bin") and k not in ("te", "content-type", "user-agent"))
header_values = st.from_regex(r"[ -~]{0,60}", fullmatch=True).map(str.strip)


@st.composite
def metadata(draw, feature_version: str):
    """Random metadata, with the feature version present, absent, wrong or in odd case."""
    pairs = draw(st.lists(st.tuples(header_keys, header_values), max_size=4))
    choice = draw(st.sampled_from(["right", "absent", "wrong", "upper", "binary"]))
    if choice == "right":
        pairs.append(("x-feature-version", feature_version))
    elif choice == "wrong":
        pairs.append(("x-feature-version", draw(header_values)))
    elif choice == "upper":
        pairs.append(("X-Feature-Version", feature_version))
    elif choice == "binary":
        pairs.append(("x-feature-version-bin", draw(st.binary(max_size=40))))
    return tuple((k.lower(), v) for k, v in pairs)


def shapes(n_features: int):
    dims = st.one_of(st.integers(-3, 5), st.integers(MAX_ROWS - 1, MAX_ROWS + 1), st.integers(-(2 ** 63), 2 ** 63 - 1))
    return st.one_of(st.lists(dims, max_size=4), st.tuples(st.integers(0, 70), st.just(n_features)).map(list),
                     st.tuples(st.integers(0, 4), st.integers(0, n_features + 2)).map(list))


def floats32():
    return st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def payload(draw, shape: list[int], item_size: int = 4) -> bytes:
    """Bytes of the size the shape implies (random values, NaN/Inf included), or of a wrong size."""
    count = int(np.prod(shape)) if shape and all(0 <= d <= 10_000 for d in shape) else 0
    if draw(st.booleans()) and count * item_size <= 70 * 64 * 4:
        values = draw(st.lists(floats32(), min_size=count, max_size=count)) if item_size == 4 else []
        if values:
            return np.asarray(values, "<f4").tobytes()
        return draw(st.binary(min_size=count * item_size, max_size=count * item_size))
    return draw(st.binary(max_size=2048))


@st.composite
def valid_rows(draw, n_features: int) -> np.ndarray:
    """A well-formed input: one random row repeated, any row count up to MAX_ROWS ``[rows, n] float32``."""
    row = np.asarray(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n_features, max_size=n_features)),
                     np.float32)
    return np.tile(row, (draw(st.integers(0, MAX_ROWS)), 1))


# -- the properties -------------------------------------------------------------------------------


def test_own_api_requests_never_fail_internally(server, credit_entry):
    n = credit_entry.manifest.n_features
    version = credit_entry.manifest.versions.feature_schema_version
    stub = pb_grpc.InferenceServiceStub(server[1])
    seen = set()

    @FUZZ
    @given(data=st.data())
    def check(data):
        if data.draw(st.integers(0, 4)) == 0:  # now and then a well-formed request, any row count
            x = data.draw(valid_rows(n))
            request = pb.InferRequest(model_name="credit-risk", inputs=pb.Tensor(
                data_type=pb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()))
            seen.add(_call(stub.Infer, request, (("x-feature-version", version),)))
            return
        shape = data.draw(shapes(n))
        data_type = data.draw(st.one_of(st.sampled_from(list(pb.DataType.values())), st.integers(-5, 1000)))
        request = pb.InferRequest(model_name=data.draw(names), model_version=data.draw(versions),
                                  inputs=pb.Tensor(data_type=data_type, shape=shape,
                                                   content=data.draw(payload(shape))))
        seen.add(_call(stub.Infer, request, data.draw(metadata(version))))

    check()
    _assert_still_serving(server, credit_entry)
    assert grpc.StatusCode.OK in seen and len(seen) > 2  # the strategies reach valid and refused requests


@st.composite
def oip_inputs(draw, n_features: int):
    count = draw(st.sampled_from([1, 1, 1, 0, 2]))
    tensors, raw = [], []
    for _ in range(count):
        shape = draw(shapes(n_features))
        datatype = draw(st.one_of(st.sampled_from(OIP_TYPES), st.text(max_size=12)))
        tensor = oip.ModelInferRequest.InferInputTensor(
            name=draw(st.one_of(st.sampled_from(["features", "logits", ""]), st.text(max_size=300))),
            datatype=datatype, shape=shape)
        kind = draw(st.sampled_from(["raw", "fp32", "int", "bytes", "none"]))
        if kind == "raw":
            raw.append(draw(payload(shape)))
        elif kind == "fp32":
            tensor.contents.fp32_contents.extend(draw(st.lists(floats32(), max_size=200)))
        elif kind == "int":
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-(2 ** 31), 2 ** 31 - 1), max_size=50)))
        elif kind == "bytes":
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=30), max_size=5)))
        tensors.append(tensor)
    if draw(st.booleans()):
        raw.extend(draw(st.lists(st.binary(max_size=200), max_size=2)))
    return tensors, raw


@st.composite
def oip_parameters(draw, feature_version: str):
    params = {}
    for key in draw(st.lists(st.one_of(st.just("x-feature-version"), st.text(max_size=40)), max_size=3, unique=True)):
        kind = draw(st.sampled_from(["string", "right", "bool", "int"]))
        if kind == "right":
            params[key] = oip.InferParameter(string_param=feature_version)
        elif kind == "string":
            params[key] = oip.InferParameter(string_param=draw(st.text(max_size=100)))
        elif kind == "bool":
            params[key] = oip.InferParameter(bool_param=draw(st.booleans()))
        else:
            params[key] = oip.InferParameter(int64_param=draw(st.integers(-(2 ** 63), 2 ** 63 - 1)))
    return params


def test_open_inference_protocol_requests_never_fail_internally(server, credit_entry):
    n = credit_entry.manifest.n_features
    version = credit_entry.manifest.versions.feature_schema_version
    stub = oip_grpc.GRPCInferenceServiceStub(server[1])
    seen = set()

    @FUZZ
    @given(data=st.data())
    def check(data):
        if data.draw(st.integers(0, 4)) == 0:  # now and then a well-formed request, any row count
            x = data.draw(valid_rows(n))
            tensor = oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
            request = oip.ModelInferRequest(model_name="credit-risk", id=data.draw(st.text(max_size=500)),
                                            inputs=[tensor], raw_input_contents=[x.tobytes()])
            seen.add(_call(stub.ModelInfer, request, (("x-feature-version", version),)))
            return
        tensors, raw = data.draw(oip_inputs(n))
        outputs = [oip.ModelInferRequest.InferRequestedOutputTensor(name=name)
                   for name in data.draw(st.lists(st.one_of(st.just("logits"), st.text(max_size=50)), max_size=2))]
        request = oip.ModelInferRequest(
            model_name=data.draw(names), model_version=data.draw(versions), id=data.draw(st.text(max_size=500)),
            parameters=data.draw(oip_parameters(version)), inputs=tensors, outputs=outputs, raw_input_contents=raw)
        seen.add(_call(stub.ModelInfer, request, data.draw(metadata(version))))
        metadata_request = oip.ModelMetadataRequest(name=data.draw(names), version=data.draw(versions))
        seen.add(_call(stub.ModelMetadata, metadata_request, ()))
        ready = stub.ModelReady(oip.ModelReadyRequest(name=data.draw(names), version=data.draw(versions)), timeout=5)
        assert ready.ready in (True, False)

    check()
    _assert_still_serving(server, credit_entry)
    assert grpc.StatusCode.OK in seen and len(seen) > 2


def test_valid_requests_in_any_row_count_match_the_model(server, credit_entry, holdout_x):
    """The positive side: well-formed requests of any row count (split above max batch) are
    answered with the model's own logits."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(credit_entry.model_path), providers=["CPUExecutionProvider"])
    version = credit_entry.manifest.versions.feature_schema_version
    stub = oip_grpc.GRPCInferenceServiceStub(server[1])

    @settings(max_examples=max(10, EXAMPLES // 4), deadline=None, suppress_health_check=list(HealthCheck))
    @given(start=st.integers(0, len(holdout_x) - 1), rows=st.integers(0, MAX_ROWS))
    def check(start, rows):
        x = np.resize(np.roll(holdout_x, -start, axis=0), (rows, holdout_x.shape[1])).astype(np.float32)
        tensor = oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
        reply = stub.ModelInfer(oip.ModelInferRequest(
            model_name="credit-risk", inputs=[tensor], raw_input_contents=[x.tobytes()],
            parameters={"x-feature-version": oip.InferParameter(string_param=version)}), timeout=10)
        assert list(reply.outputs[0].shape) == [rows, 2]
        got = np.frombuffer(reply.raw_output_contents[0], "<f4").reshape(rows, 2)
        if rows:
            np.testing.assert_allclose(got, session.run(None, {"features": x})[0], atol=1e-5)

    check()


def test_bytes_that_are_not_a_message_are_invalid_argument(server, credit_entry):
    """Raw request bytes, both protocols: a valid message of some shape or INVALID_ARGUMENT with
    reason MALFORMED_REQUEST — never UNKNOWN with the protobuf parser's text."""
    from mlpair.rpc import error_info

    channel = server[1]
    methods = ["/mlpair.inference.v1.InferenceService/Infer", "/inference.GRPCInferenceService/ModelInfer",
               "/inference.GRPCInferenceService/ModelMetadata"]
    refused = 0

    @FUZZ
    @given(raw=st.one_of(st.binary(max_size=2048), st.sampled_from([b"\xff", b"\x0a\x05ab", b"\x08\x80"])))
    def check(raw):
        nonlocal refused
        for method in methods:
            try:
                channel.unary_unary(method)(raw, timeout=10)  # raw bytes out and in
            except grpc.RpcError as exc:
                assert exc.code() in CLIENT_ERRORS, f"{method}: {exc.code().name}: {exc.details()}"
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT and error_info(exc).reason == "MALFORMED_REQUEST":
                    assert "Error parsing" not in exc.details() and "DecodeError" not in exc.details()
                    refused += 1

    check()
    _assert_still_serving(server, credit_entry)
    assert refused > 0  # the sampled cases are truncated messages: each is refused as malformed
