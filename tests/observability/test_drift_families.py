"""C64: one idle family does not hide another's verdict. A real PredictionService serving credit-risk
and churn; real credit-risk holdout applicants through Predict, none for churn; the drift monitors'
gauges served over HTTP and read by ``mlpair drift-report``."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.cli import main as cli_main
from mlpair.client import to_attributes
from tests.support import CONFIG_DIR, start_prediction

FAMILIES = ("credit-risk", "churn")
APPLICANTS = 400  # of the credit-risk holdout: twice the 200 decisions a verdict needs


class Families:
    """The drift gauges of ``FAMILIES`` alone, from the process's registry (other tests' families left out)."""

    def collect(self):
        for metric in REGISTRY.collect():
            if metric.name.startswith(("prediction_drift_", "prediction_score_drift_")):
                kept = Metric(metric.name, metric.documentation, metric.type)
                kept.samples = [s for s in metric.samples if s.labels.get("model") in FAMILIES]
                yield kept


@pytest.fixture(scope="module")
async def served(model_repository, tmp_path_factory):
    """PredictionService (both families, drift evaluated on demand) before an InferenceService, and the
    metrics URL of their drift gauges."""
    from mlpair.inference.server import start as start_inference
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.server import stop as stop_prediction
    from mlpair.prediction.settings import PredictionSettings

    inference, inference_port, _, engine = await start_inference(
        InferenceSettings(host="127.0.0.1", port=0, metrics_port=0, model_repository=model_repository,
                          tracing=False))
    crm = tmp_path_factory.mktemp("c64") / "crm.sqlite"
    settings = PredictionSettings(host="127.0.0.1", port=0, metrics_port=0, models=list(FAMILIES),
                                  inference_target=f"127.0.0.1:{inference_port}", crm_url=f"sqlite+aiosqlite:///{crm}",
                                  ledger_url=f"sqlite+aiosqlite:///{crm.with_name('ledger.sqlite')}",
                                  model_repository=model_repository, config_dir=CONFIG_DIR, drift_interval_s=0,
                                  drift_min_rows=200, tracing=False, cache_backend="off", inference_timeout_ms=10_000)
    server, port, health, predictor = await start_prediction(settings)
    registry = CollectorRegistry()
    registry.register(Families())
    http, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}", predictor, f"http://127.0.0.1:{http.server_port}/metrics"
    finally:
        http.shutdown()
        thread.join(timeout=5)
        await stop_prediction(server, health, predictor, 0)
        await inference.stop(0)
        await engine.close()


async def _report(url: str, capsys, *flags: str) -> tuple[int, str]:
    code = await asyncio.to_thread(cli_main, ["drift-report", "--metrics-url", url, *flags])
    return code, capsys.readouterr().out


async def test_c64_an_idle_family_does_not_hide_anothers_verdict(served, credit_holdout, capsys):
    target, predictor, url = served
    # No traffic yet anywhere: no family has a verdict.
    await predictor.drift.evaluate()
    code, out = await _report(url, capsys)
    assert code == 3, out
    assert "credit-risk: no verdict: no traffic" in out and "churn: no verdict: no traffic" in out
    assert "0 of 2 families with a verdict; no traffic: churn, credit-risk" in out  # sorted by name

    gate = asyncio.Semaphore(8)

    async def one(stub, i: int, entity_id: str, record: dict) -> None:
        async with gate:
            request = pb.PredictRequest(request_id=f"c64-{i}", entity_id=entity_id, model_name="credit-risk",
                                        attributes=to_attributes(record))
            await stub.Predict(request, timeout=30)

    pairs = list(zip(credit_holdout.entity_ids, credit_holdout.records, strict=True))[:APPLICANTS]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.PredictionServiceStub(channel)
        await asyncio.gather(*(one(stub, i, e, r) for i, (e, r) in enumerate(pairs)))
    reports = {r.model_name: r for r in await predictor.drift.evaluate()}
    assert (reports["credit-risk"].window_rows, reports["churn"].window_rows) == (APPLICANTS, 0)
    assert not reports["credit-risk"].drifted

    # credit-risk has its verdict (no drift on its own holdout); churn, never called, does not hide it.
    code, out = await _report(url, capsys)
    assert code == 0, out
    assert f"credit-risk: no drift over {APPLICANTS} decisions" in out
    assert "churn: no verdict: no traffic (no decision in the window)" in out
    assert out.rstrip().endswith("1 of 2 families with a verdict; no drift: credit-risk; no traffic: churn")

    code, out = await _report(url, capsys, "--json")
    assert code == 0
    verdicts = {r["model_name"]: (r["verdict"], r["judged"], r["window_rows"]) for r in json.loads(out)}
    assert verdicts == {"credit-risk": ("no drift", True, APPLICANTS), "churn": ("no traffic", False, 0)}
