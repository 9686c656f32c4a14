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
from mlpair.startup import StartupError
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


def test_cuda_request_without_cuda_refuses_to_start_with_its_reason(credit_entry, caplog, tmp_path):
    assert choose_providers("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    assert choose_providers("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers("auto", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(StartupError, match="execution_provider=cuda but this ONNX Runtime has no CUDA"):
        choose_providers("cuda", ["CPUExecutionProvider"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: cuda starts")
    with pytest.raises(StartupError, match="execution_provider=cuda") as onnx_refusal:
        OnnxRuntime(credit_entry.model_path, provider="cuda")
    with pytest.raises(StartupError, match=r"torch sees no usable GPU") as torch_refusal:
        create_runtime(credit_entry, make_settings(tmp_path, runtime="torch", execution_provider="cuda"))
    for refusal in (onnx_refusal, torch_refusal):
        assert "\n" not in str(refusal.value) and "INFERENCE_EXECUTION_PROVIDER=auto" in str(refusal.value)
    with caplog.at_level(logging.INFO):  # auto still falls back, and says why the options are off
        program = create_runtime(credit_entry, make_settings(tmp_path, runtime="torch", execution_provider="auto",
                                                             half_precision=True, cuda_graphs=True))
    assert program.description == "torch:cpu"
    assert "half_precision ignored" in caplog.text and "cuda_graphs ignored" in caplog.text


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


def test_deterministic_torch_runtime_gives_a_row_the_same_logits_in_any_batch(credit_entry, holdout_x, tmp_path):
    """Deterministic kernels repeat a batch, but GEMM blocking (and so the summation order)
    follows the batch size: the torch runtime runs every batch at one padded size instead."""
    settings = make_settings(tmp_path, runtime="torch", deterministic=True, max_batch_size=64)
    rt = create_runtime(credit_entry, settings)
    x = holdout_x[:200]
    whole = rt.run(x)
    assert whole.shape == (200, 2)
    for size in (1, 7, 64, 150):
        parts = np.concatenate([rt.run(x[i : i + size]) for i in range(0, len(x), size)])
        assert parts.tobytes() == whole.tobytes(), size
    assert rt.run(x[:0]).shape == (0, 2)
    torch.use_deterministic_algorithms(False)  # process-wide switch; leave the rest of the suite as it was
