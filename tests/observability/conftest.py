"""Both real servers in-process on free ports, each with its own in-memory span exporter.

The pair is started once per module: InferenceService (own tracer provider) and
PredictionService (own tracer provider, SQLite CRM) in front of it, drift evaluation left to
the tests (``drift_interval_s=0``), log lines of the ``mlpair`` loggers captured as JSON.
"""

from __future__ import annotations

import io
import logging

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.logs import make_handler
from mlpair.observability.tracing import build_tracer_provider
from tests.observability.pair import Pair
from tests.support import CONFIG_DIR


@pytest.fixture(scope="module")
async def pair(model_repository, tmp_path_factory):
    from mlpair.inference.server import start as start_inference
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.server import stop as stop_prediction
    from mlpair.prediction.settings import PredictionSettings
    from tests.support import start_prediction

    inference_spans, prediction_spans = InMemorySpanExporter(), InMemorySpanExporter()
    inference_provider = build_tracer_provider("mlpair-inference", exporter=inference_spans)
    prediction_provider = build_tracer_provider("mlpair-prediction", exporter=prediction_spans)

    stream = io.StringIO()
    handler = make_handler("json", stream)
    mlpair_logger = logging.getLogger("mlpair")
    previous_level = mlpair_logger.level
    mlpair_logger.addHandler(handler)
    mlpair_logger.setLevel(logging.DEBUG)

    inference_settings = InferenceSettings(host="127.0.0.1", port=0, metrics_port=0,
                                           model_repository=model_repository, max_batch_size=64)
    inference_server, inference_port, _, engine = await start_inference(
        inference_settings, tracer_provider=inference_provider)
    crm = tmp_path_factory.mktemp("observability-crm") / "crm.sqlite"
    settings = PredictionSettings(host="127.0.0.1", port=0, metrics_port=0,
                                  inference_target=f"127.0.0.1:{inference_port}",
                                  crm_url=f"sqlite+aiosqlite:///{crm}",
                                  ledger_url=f"sqlite+aiosqlite:///{crm.with_name('ledger.sqlite')}",
                                  model_repository=model_repository,
                                  config_dir=CONFIG_DIR, drift_interval_s=0,
                                  cache_backend="off",  # every Predict reaches InferenceService and logs there
                                  inference_timeout_ms=10_000)  # a shared, loaded test machine: no spurious deadlines
    server, port, health, predictor = await start_prediction(settings, tracer_provider=prediction_provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Pair(pb_grpc.PredictionServiceStub(channel), f"127.0.0.1:{port}", f"127.0.0.1:{inference_port}",
                       predictor, inference_provider, prediction_provider,
                       inference_spans, prediction_spans, stream)
    finally:
        await stop_prediction(server, health, predictor, 0)
        await inference_server.stop(0)
        await engine.close()
        mlpair_logger.removeHandler(handler)
        mlpair_logger.setLevel(previous_level)
        inference_provider.shutdown()
        prediction_provider.shutdown()
