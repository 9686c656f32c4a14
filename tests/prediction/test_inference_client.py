"""The project's own inference client: lower-case metadata keys (C25) and typed errors."""

from __future__ import annotations

import asyncio

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


def rpc_error(code: grpc.StatusCode, details: str = "", *, reason: str = "", metadata: dict | None = None,
              trailing=()) -> grpc.aio.AioRpcError:
    """A failed call as the client sees it: code, details, and the server's ErrorInfo (reason and
    metadata) or reply headers."""
    from mlpair.rpc import to_status

    trailers = list(trailing)
    if reason:
        trailers += list(to_status(code.name, details, reason, "inference.mlpair", metadata or {}).trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


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
    # Inference-side faults: another replica may answer (retried), else the fallback; the breaker counts them.
    (rpc_error(grpc.StatusCode.INTERNAL, "model", reason="MODEL_FAILURE"), "model_failure", "InferenceUnavailable", True),
    (rpc_error(grpc.StatusCode.UNAVAILABLE, "unhealthy", reason="MODEL_UNHEALTHY"), "model_unhealthy",
     "InferenceUnavailable", True),
    (rpc_error(grpc.StatusCode.INTERNAL, "internal error", reason="INTERNAL"), "internal", "InferenceUnavailable", True),
    (rpc_error(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"), "internal", "InferenceUnavailable",
     True),
    (rpc_error(grpc.StatusCode.UNKNOWN, "Unexpected <class 'RuntimeError'>"), "unknown", "InferenceUnavailable", True),
    # Non-finite output is about these rows under this version, the same on every replica: never retried.
    (rpc_error(grpc.StatusCode.INTERNAL, "row 0", reason="MODEL_FAILURE", metadata={"reason": "NON_FINITE_OUTPUT"}),
     "non_finite_output", "InferenceFailed", False),
    (rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "version", reason="FEATURE_VERSION_MISMATCH"), "contract",
     "InferenceContractError", False),
], ids=lambda v: v if isinstance(v, str) else None)
def test_errors_are_classified_by_cause_and_only_inference_side_faults_count_for_the_breaker(error, cause, kind,
                                                                                             breaker_failure):
    from mlpair.prediction.scoring.client import classify

    found, mapped = classify(error)
    assert (found, type(mapped).__name__) == (cause, kind)
    assert isinstance(mapped, InferenceUnavailable) == breaker_failure  # what ResilientCaller counts as a failure


class Replica(pb_grpc.InferenceServiceServicer):
    """One InferenceService replica stand-in: zero logits, or every call answered with ``failure``
    (code, ErrorInfo reason) as a replica whose model batches fail answers; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.failure: tuple[grpc.StatusCode, str] | None = None

    async def Infer(self, request, context):
        self.calls += 1
        if self.failure is not None:
            from mlpair.rpc import to_status

            code, reason = self.failure
            status = to_status(code.name, "the model failed", reason, "inference.mlpair", {})
            await context.abort(status.code, status.details, status.trailing_metadata)
        rows = request.inputs.shape[0]
        return pb.InferResponse(model_name=request.model_name, model_version="1", logits=pb.Tensor(
            data_type=pb.DATA_TYPE_FP32, shape=[rows, 2], content=np.zeros((rows, 2), np.float32).tobytes()))


@pytest.fixture
async def replicas():
    """Three gRPC servers on loopback, each a :class:`Replica` with its own grpc.health.v1 servicer."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    started = []
    for _ in range(3):
        replica, server, checks = Replica(), grpc.aio.server(), health.aio.HealthServicer()
        pb_grpc.add_InferenceServiceServicer_to_server(replica, server)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        for name in ("", "mlpair.inference.v1.InferenceService"):
            await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.append((replica, checks, f"127.0.0.1:{port}", server))
    yield started
    for *_, server in started:
        await server.stop(0)


async def test_round_robin_retries_a_failing_replica_s_call_on_another_and_health_takes_it_out(replicas):
    """A replica answering INTERNAL MODEL_FAILURE to every call: each of its calls is retried once on
    the next replica (every logical call succeeds); once its health is NOT_SERVING no call reaches it;
    SERVING again, it is back in the rotation."""
    from grpc_health.v1 import health_pb2

    from mlpair.prediction.scoring.resilience import CircuitBreaker, DeadlineBudget, ResilientCaller, RetryPolicy

    target = "ipv4:" + ",".join(address for _, _, address, _ in replicas)
    client = InferenceClient(target, timeout_ms=2000, max_message_bytes=1 << 20, load_balancing="round_robin")
    caller = ResilientCaller(CircuitBreaker("rr", failure_threshold=5, open_s=60), DeadlineBudget(),
                             RetryPolicy(max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.002))
    failing, failing_health = replicas[0][0], replicas[0][1]
    x = np.zeros((1, 5), np.float32)
    model = ModelTarget("m", "", "v")

    async def call():
        return await caller.call(lambda timeout: client.infer(model, x, timeout_s=timeout), None, model="m")

    try:
        assert await client.ready(2)
        for _ in range(6):  # every replica connected and answering before the fault
            await call()
        failing.failure = (grpc.StatusCode.INTERNAL, "MODEL_FAILURE")
        before = [r.calls for r, *_ in replicas]
        for _ in range(30):
            logits, version = await call()  # sequential: round_robin's next pick is the next replica
            assert logits.shape == (1, 2) and version == "1"
        made = [r.calls - b for (r, *_), b in zip(replicas, before)]
        # Each call answered once by a healthy replica; the failing one took every call that began at it
        # (picks cycle 0, 1, 2: a call starting at 0 takes 0 then 1, so calls alternate between starting at
        # 0 and at 2: 15 of 30, or 14 when the rotation stood at 1), and each of those was retried on the next.
        assert made[1] + made[2] == 30 and made[0] in (14, 15)
        assert caller.breaker.state.name == "CLOSED"

        await failing_health.set("mlpair.inference.v1.InferenceService", health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(0.2)  # one Watch update
        out = failing.calls
        for _ in range(30):
            await call()
        assert failing.calls == out  # out of the rotation: no call reached it

        failing.failure = None
        await failing_health.set("mlpair.inference.v1.InferenceService", health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.2)
        back = failing.calls
        for _ in range(30):
            await call()
        assert failing.calls - back == 10  # back: one call in three
    finally:
        await client.close()


async def test_a_plain_host_port_target_keeps_one_connection(replicas):
    """pick_first (the default) on a host:port: every call to that one server, as before."""
    replica, _, address, _ = replicas[1]
    client = InferenceClient(address, timeout_ms=2000, max_message_bytes=1 << 20)
    try:
        for _ in range(5):
            await client.infer(ModelTarget("m", "", "v"), np.zeros((1, 5), np.float32))
    finally:
        await client.close()
    assert [r.calls for r, *_ in replicas] == [0, 5, 0]
