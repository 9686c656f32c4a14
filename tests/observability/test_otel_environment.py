"""The standard OpenTelemetry variables: a real ``mlpair serve inference`` exports its spans to a
local OTLP/gRPC receiver named only by ``OTEL_EXPORTER_OTLP_ENDPOINT``, under ``OTEL_SERVICE_NAME``;
the project's own settings win where both are given."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.observability.tracing import build_tracer_provider
from mlpair.rpc import wait_until_serving
from tests.support import REPO_ROOT


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, str]]:
        """(service.name, span name) of every span received."""
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    found += [(attributes.get("service.name", ""), span.name) for span in scope.spans]
        return found


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
async def test_spans_reach_a_collector_named_only_by_otel_exporter_otlp_endpoint(model_repository, holdout_x,
                                                                                good_metadata):
    receiver = Receiver()
    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    collector_port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERENCE_"))},
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}", "OTEL_SERVICE_NAME": "credit-scoring-gpu",
           "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_SHUTDOWN_ACCEPT_MS": "0"}
    process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert await asyncio.to_thread(wait_until_serving, f"127.0.0.1:{port}", 60, lambda: process.poll() is None)
        x = holdout_x[:1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await pb_grpc.InferenceServiceStub(channel).Infer(pb.InferRequest(
                model_name="credit-risk", inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=x.shape,
                                                           content=x.tobytes())), metadata=good_metadata, timeout=10)
        process.send_signal(signal.SIGTERM)  # the provider's shutdown flushes the batch to the collector
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        await collector.stop(0)
    assert ("credit-scoring-gpu", "/mlpair.inference.v1.InferenceService/Infer") in receiver.spans(), receiver.spans()


def test_the_projects_settings_win_over_the_standard_variables():
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SERVICE_NAME": "renamed",
               "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    providers = {
        "env only": build_tracer_provider("mlpair-test", sample_ratio=None, environ=environ),
        "own ratio": build_tracer_provider("mlpair-test", sample_ratio=0.5, environ=environ),
        "no env": build_tracer_provider("mlpair-test", sample_ratio=None, environ={}),
        "disabled": build_tracer_provider("mlpair-test", sample_ratio=None,
                                          environ={**environ, "OTEL_SDK_DISABLED": "true"}),
    }
    try:
        exporting = {name: bool(p._active_span_processor._span_processors) for name, p in providers.items()}
        assert exporting == {"env only": True, "own ratio": True, "no env": False, "disabled": False}
        assert providers["env only"].resource.attributes["service.name"] == "renamed"
        assert providers["no env"].resource.attributes["service.name"] == "mlpair-test"
        assert "TraceIdRatioBased{0.25}" in providers["env only"].sampler.get_description()
        assert "TraceIdRatioBased{0.5}" in providers["own ratio"].sampler.get_description()
    finally:
        for provider in providers.values():
            provider.shutdown()
