"""Runtimes: ONNX Runtime and PyTorch agree on the real holdout; provider choice and fallback;
deterministic mode; the torch runtime served end to end through the same server."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.inference.runtimes import create_runtime
from mlpair.inference.runtimes.onnx import OnnxRuntime, choose_providers

from tests.inference.helpers import MODEL, channel_to, make_settings, running

torch = pytest.importorskip("torch")


def test_onnx_and_torch_runtimes_agree_within_1e_4_on_the_real_holdout(credit_entry, holdout_x, tmp_path):
    onnx = create_runtime(credit_entry, make_settings(tmp_path, runtime="onnx"))
    program = create_runtime(credit_entry, make_settings(tmp_path, runtime="torch"))
    assert program.description == "torch:cpu" and program.platform == "pytorch_torchexport"
    a, b = onnx.run(holdout_x), program.run(holdout_x)
    assert a.shape == b.shape == (len(holdout_x), 2)
    assert float(np.max(np.abs(a - b))) <= 1e-4
    np.testing.assert_allclose(program.run(holdout_x[:1]), b[:1], atol=1e-5)  # batch-size independent


def test_deterministic_mode_repeats_bit_for_bit(credit_entry, holdout_x, tmp_path):
    for runtime in ("onnx", "torch"):
        rt = create_runtime(credit_entry, make_settings(tmp_path, runtime=runtime, deterministic=True))
        first = rt.run(holdout_x)
        assert all(rt.run(holdout_x).tobytes() == first.tobytes() for _ in range(3))
    torch.use_deterministic_algorithms(False)  # process-wide switch; leave the rest of the suite as it was


def test_cuda_request_without_cuda_falls_back_to_cpu_and_says_so(credit_entry, caplog, tmp_path):
    assert choose_providers("cuda", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    assert choose_providers("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with caplog.at_level(logging.WARNING):
        rt = OnnxRuntime(credit_entry.model_path, provider="cuda")
    if "CUDAExecutionProvider" not in rt.description:
        assert rt.description == "onnxruntime:CPUExecutionProvider"
        assert "CUDA execution provider requested but not available" in caplog.text
    with caplog.at_level(logging.INFO):
        program = create_runtime(credit_entry, make_settings(tmp_path, runtime="torch", execution_provider="cuda",
                                                             half_precision=True, cuda_graphs=True))
    if not torch.cuda.is_available():
        assert program.description == "torch:cpu"
        assert "torch sees no GPU" in caplog.text and "half_precision ignored" in caplog.text


async def test_the_torch_runtime_serves_through_the_same_server(model_repository, holdout_x, feature_version, credit_entry):
    settings = make_settings(model_repository, runtime="torch")
    x = holdout_x[:64]
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL))
        reply = await stub.ModelInfer(oip.ModelInferRequest(
            model_name=MODEL, parameters={"x-feature-version": oip.InferParameter(string_param=feature_version)},
            inputs=[oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))],
            raw_input_contents=[x.tobytes()]))
    assert meta.platform == "pytorch_torchexport"
    got = np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(64, 2)
    expected = OnnxRuntime(credit_entry.model_path, provider="cpu").run(x)
    assert float(np.max(np.abs(got - expected))) <= 1e-4
