"""The project's own inference client: lower-case metadata keys (C25) and typed errors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.errors import InferenceContractError, InferenceUnavailable
from mlpair.prediction.scoring.client import InferenceClient


class RecordingServicer(pb_grpc.InferenceServiceServicer):
    """Answers with zero logits and remembers the metadata keys it received."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def Infer(self, request, context):
        self.keys += [k for k, _ in context.invocation_metadata()]
        rows = request.inputs.shape[0]
        return pb.InferResponse(model_name=request.model_name, model_version="7", logits=pb.Tensor(
            data_type=pb.DATA_TYPE_FP32, shape=[rows, 2], content=np.zeros((rows, 2), np.float32).tobytes()))


@pytest.fixture
async def recording_server():
    servicer = RecordingServicer()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(0)


async def test_c25_client_emits_only_lower_case_metadata_keys(recording_server):
    target, servicer = recording_server
    client = InferenceClient(target, timeout_ms=2000, max_message_bytes=1 << 20)
    try:
        logits, version = await client.infer(ModelTarget("m", "", "schema/v1"), np.zeros((3, 5), np.float32))
    finally:
        await client.close()
    assert logits.shape == (3, 2) and version == "7"
    assert "x-feature-version" in servicer.keys
    assert all(k == k.lower() for k in servicer.keys)


async def test_unreachable_inference_is_unavailable():
    client = InferenceClient("127.0.0.1:1", timeout_ms=300, max_message_bytes=1 << 20)
    try:
        with pytest.raises(InferenceUnavailable):
            await client.infer(ModelTarget("m", "", "v"), np.zeros((1, 5), np.float32))
    finally:
        await client.close()


async def test_missing_header_at_the_real_server_is_a_contract_error(inference_server, credit_entry):
    client = InferenceClient(inference_server, timeout_ms=2000, max_message_bytes=1 << 20)
    try:
        with pytest.raises(InferenceContractError):
            await client.infer(ModelTarget("credit-risk", "", "credit-risk/v0"), np.zeros((1, credit_entry.manifest.n_features), np.float32))
    finally:
        await client.close()


def rpc_error(code: grpc.StatusCode, details: str = "", *, reason: str = "", trailing=()) -> grpc.aio.AioRpcError:
    """A failed call as the client sees it: code, details, and the server's ErrorInfo or reply headers."""
    from mlpair.rpc import to_status

    metadata = list(trailing)
    if reason:
        metadata += list(to_status(code.name, details, reason, "inference.mlpair", {}).trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), details)


@pytest.mark.parametrize("error, cause, kind, breaker_failure", [
    (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), "unavailable", "InferenceUnavailable", True),
    (rpc_error(grpc.StatusCode.CANCELLED, "server shutdown"), "cancelled", "InferenceUnavailable", True),
    (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), "timeout", "InferenceTimeout", True),
    (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue", reason="QUEUE_FULL"), "queue_full", "InferenceOverloaded", False),
    (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "local_rate_limited", trailing=[("x-mlpair-rate-limited", "true")]),
     "rate_limited", "InferenceOverloaded", False),
    (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests"), "resource_exhausted", "InferenceOverloaded", False),
    (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5000000 vs. 4194304)"),
     "message_size", "InferenceFailed", False),
    (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "received initial metadata size exceeds limit"),
     "metadata_size", "InferenceFailed", False),
    (rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad tensor", reason="INVALID_INPUT"), "invalid_argument",
     "InferenceFailed", False),
    (rpc_error(grpc.StatusCode.INTERNAL, "model", reason="MODEL_FAILURE"), "model_failure", "InferenceFailed", False),
    (rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "version", reason="FEATURE_VERSION_MISMATCH"), "contract",
     "InferenceContractError", False),
], ids=lambda v: v if isinstance(v, str) else None)
def test_errors_are_classified_by_cause_and_only_unavailability_counts_for_the_breaker(error, cause, kind,
                                                                                      breaker_failure):
    from mlpair.prediction.scoring.client import classify

    found, mapped = classify(error)
    assert (found, type(mapped).__name__) == (cause, kind)
    assert isinstance(mapped, InferenceUnavailable) == breaker_failure  # what ResilientCaller counts as a failure
