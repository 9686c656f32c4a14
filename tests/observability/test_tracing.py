"""One trace across both real services: Predict → Infer → CRM write, W3C trace context throughout."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mlpair.observability.tracing import build_tracer_provider
from tests.observability.pair import predict_request

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
INFER = "/mlpair.inference.v1.InferenceService/Infer"


def _one(spans, name, kind):
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, f"expected one {kind.name} span {name}, got {[(s.name, s.kind.name) for s in spans]}"
    return found[0]


async def test_one_trace_spans_predict_infer_and_the_crm_write(pair, credit_holdout):
    pair.clear()
    reply = await pair.stub.Predict(predict_request("trace-1", credit_holdout.entity_ids[0], credit_holdout.records[0]))
    assert reply.decision_id
    predict = _one(pair.spans(), PREDICT, SpanKind.SERVER)
    trace_id = predict.context.trace_id
    spans = [s for s in pair.spans() if s.context.trace_id == trace_id]  # the relay traces its own work

    infer_client = _one(spans, INFER, SpanKind.CLIENT)
    infer_server = _one(spans, INFER, SpanKind.SERVER)
    ledger_write = _one(spans, "ledger INSERT", SpanKind.CLIENT)
    # Parent chain: Predict → Infer (client) → Infer (server, other process's provider); the
    # durable write the response waits for (the ledger commit) under Predict.
    assert predict.parent is None
    assert infer_client.parent.span_id == predict.context.span_id
    assert infer_server.parent.span_id == infer_client.context.span_id and infer_server.parent.is_remote
    assert ledger_write.parent.span_id == predict.context.span_id
    # Each service reports under its own name.
    assert predict.resource.attributes["service.name"] == "mlpair-prediction"
    assert infer_server.resource.attributes["service.name"] == "mlpair-inference"
    # The relay's delivery to the CRM database comes after the response, as its own spans; they
    # name the database but carry no statement parameters (personal data).
    assert await pair.predictor.recorder.wait_delivered(10)
    crm_writes = [s for s in pair.spans() if s.name == "crm INSERT"]
    assert crm_writes, [s.name for s in pair.spans()]
    assert crm_writes[0].attributes["db.system"] == "sqlite"
    assert not any("param" in key for s in crm_writes + [ledger_write] for key in s.attributes)


async def test_caller_trace_context_is_continued(pair, credit_holdout):
    pair.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    await pair.stub.Predict(predict_request("trace-2", credit_holdout.entity_ids[1], credit_holdout.records[1]),
                            metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),))
    spans = [s for s in pair.spans() if s.name in (PREDICT, INFER, "ledger INSERT")]
    predict = _one(spans, PREDICT, SpanKind.SERVER)
    assert format(predict.parent.span_id, "016x") == parent_id
    assert len(spans) == 4 and {format(s.context.trace_id, "032x") for s in spans} == {trace_id}


async def test_health_checks_are_not_traced(pair):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pair.clear()
    async with grpc.aio.insecure_channel(pair.target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert pair.spans() == []


def test_without_an_exporter_spans_are_unsampled_but_carry_ids():
    provider = build_tracer_provider("mlpair-test")
    with provider.get_tracer("t").start_as_current_span("call") as span:
        ctx = span.get_span_context()
        assert ctx.is_valid and not ctx.trace_flags.sampled and not span.is_recording()


def test_head_sampling_ratio_applies_to_new_traces_and_follows_the_caller():
    from opentelemetry.propagate import extract

    exporter = InMemorySpanExporter()
    provider = build_tracer_provider("mlpair-test", exporter=exporter, sample_ratio=0.0)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("new-trace"):
        pass  # ratio 0: a trace this service starts is not recorded
    sampled_caller = extract({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    with tracer.start_as_current_span("continued", context=sampled_caller):
        pass  # the caller sampled its trace: this service records its part
    provider.force_flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["continued"]
    with pytest.raises(ValueError):
        build_tracer_provider("mlpair-test", sample_ratio=1.5)


def test_otlp_endpoint_setting_builds_an_exporting_provider():
    provider = build_tracer_provider("mlpair-test", otlp_endpoint="http://127.0.0.1:4317", sample_ratio=0.5)
    try:
        processors = provider._active_span_processor._span_processors
        assert len(processors) == 1 and type(processors[0]).__name__ == "BatchSpanProcessor"
        assert "TraceIdRatioBased{0.5}" in provider.sampler.get_description()
    finally:
        provider.shutdown()  # nothing was recorded, so nothing is sent


async def test_server_spans_carry_rpc_attributes_and_a_refusal_is_not_a_server_fault(pair, credit_holdout):
    import grpc
    from opentelemetry.trace import StatusCode

    pair.clear()
    await pair.stub.Predict(predict_request("trace-3", credit_holdout.entity_ids[2], credit_holdout.records[2]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await pair.stub.Predict(predict_request("", credit_holdout.entity_ids[3], credit_holdout.records[3]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok, bad = [s for s in pair.spans() if s.name == PREDICT and s.kind == SpanKind.SERVER]
    for span in (ok, bad):
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.service"] == "mlpair.prediction.v1.PredictionService"
        assert span.attributes["rpc.method"] == "Predict"
    assert ok.attributes["rpc.grpc.status_code"] == 0 and ok.status.status_code == StatusCode.UNSET
    # a client's bad request is not the server's failure (OpenTelemetry's RPC conventions)
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.status_code == StatusCode.UNSET
    infer_client = [s for s in pair.spans() if s.name == INFER and s.kind == SpanKind.CLIENT]
    assert infer_client and infer_client[0].attributes["rpc.grpc.status_code"] == 0
