"""What the end-to-end tests share: Predict requests, expected probabilities, trace headers, worker listeners."""

from __future__ import annotations

import contextlib
import secrets
import time

import grpc
import numpy as np
import onnxruntime as ort
import psutil
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import ModelEntry
from mlpair.observability.tracing import build_tracer_provider


def predict_request(request_id: str, record: dict) -> pb.PredictRequest:
    """A Predict of ``record`` (attribute name → Python value) for entity ``entity-<request_id>``."""
    from mlpair.client import to_attributes

    return pb.PredictRequest(request_id=request_id, entity_id=f"entity-{request_id}", attributes=to_attributes(record))


def expected_probabilities(entry: ModelEntry, records: list[dict]) -> np.ndarray:
    """What the served probability must be: assembly, ONNX Runtime and the manifest's calibration, offline."""
    x = FeatureAssembler(entry.preprocessing).assemble_many(records)
    logits = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]
    return entry.manifest.calibration.probabilities(logits, entry.manifest.positive_index)


def decided(reply: pb.PredictResponse) -> tuple:
    """What must not depend on other callers: decision, probability (bit for bit), reasons, how served."""
    return (reply.decision_label, reply.probability, list(reply.reason_codes), reply.model_version,
            reply.fallback, reply.stale, reply.degraded_reason)


@contextlib.asynccontextmanager
async def traced_prediction(settings):
    from mlpair.prediction.server import stop
    from tests.support import start_prediction

    spans = InMemorySpanExporter()
    provider = build_tracer_provider("mlpair-prediction", exporter=spans)
    server, port, health, predictor = await start_prediction(settings, tracer_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.PredictionServiceStub(channel), predictor, provider, spans
    finally:
        await stop(server, health, predictor, 0)
        provider.shutdown()


def big_tracestate() -> str:
    """32 members of 254 characters: 8,159 characters of tracestate, as the case sent."""
    return ",".join(f"k{i:02d}=" + "v" * 250 for i in range(32))


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


# a channel of its own per connection: gRPC would otherwise share one connection among channels to one target
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def listeners(supervisor: int, port: int) -> dict[int, int]:
    """Processes under ``supervisor`` (itself included) listening on ``port`` → their connections on it."""
    found = {}
    root = psutil.Process(supervisor)
    for process in (root, *root.children()):
        connections = getattr(process, "net_connections", process.connections)(kind="tcp")
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections):
            found[process.pid] = sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in connections)
    return found


def both_listening(supervisor: int, port: int, timeout_s: float = 60.0) -> list[int]:
    """The two workers' PIDs once both listen (SERVING through one does not mean the other has bound)."""
    deadline = time.monotonic() + timeout_s
    while len(found := listeners(supervisor, port)) < 2:
        assert time.monotonic() < deadline, f"workers listening: {found}"
        time.sleep(0.1)
    return list(found)


DEAD_INFERENCE = "127.0.0.1:1"  # nothing listens on port 1
