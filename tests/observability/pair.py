"""The running pair the observability tests use (started by ``conftest.pair``) and helpers."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import to_attributes


@dataclass
class Pair:
    """The running pair and what it emits."""

    stub: pb_grpc.PredictionServiceStub
    target: str  # PredictionService host:port
    inference_target: str  # InferenceService host:port
    predictor: object
    inference_provider: object
    prediction_provider: object
    inference_spans: InMemorySpanExporter
    prediction_spans: InMemorySpanExporter
    log_stream: io.StringIO

    def spans(self) -> list:
        """Every finished span of both services (flushed first)."""
        self.inference_provider.force_flush()
        self.prediction_provider.force_flush()
        return [*self.inference_spans.get_finished_spans(), *self.prediction_spans.get_finished_spans()]

    def clear(self) -> None:
        self.spans()
        self.inference_spans.clear()
        self.prediction_spans.clear()
        self.log_stream.seek(0)
        self.log_stream.truncate()

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_stream.getvalue().splitlines() if line.strip()]

    async def settled_log_lines(self, inference_lines: int = 1, timeout_s: float = 2.0) -> list[dict]:
        """The log lines once InferenceService has written ``inference_lines`` of them: it writes
        each as its handler unwinds, which may be just after the caller has the response."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            lines = self.log_lines()
            done = sum(line["layer"] == "inference" for line in lines) >= inference_lines
            if done or asyncio.get_running_loop().time() > deadline:
                return lines
            await asyncio.sleep(0.02)


def predict_request(request_id: str, entity_id: str, attributes: dict) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=entity_id, attributes=to_attributes(attributes))
