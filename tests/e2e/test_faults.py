"""Faults between the real services: InferenceService stopped and restarted, the PostgreSQL CRM
connection cut and restored, a caller timing out after its decision was committed (C39).

Everything runs on 127.0.0.1, is bounded in requests and time, and ends only processes it started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sqlalchemy import func, make_url, select

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction.recording.models import DecisionRecord
from mlpair.prediction.recording.store import make_engine
from tests.e2e.replicas import crm_rows
from tests.fault_support import TcpProxy, eventually, free_port, health_of, prediction_service, prediction_settings

SERVICE = "mlpair.prediction.v1.PredictionService"


def predict(request_id: str, record: dict) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=request_id, attributes=to_attributes(record))


class InferenceProcess:
    """InferenceService as its own process on a fixed port, so it can be killed and restarted."""

    def __init__(self, model_repository, port: int, log_path) -> None:
        self.env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port),
                    "INFERENCE_METRICS_PORT": "0", "INFERENCE_MODEL_REPOSITORY": str(model_repository)}
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    async def start(self) -> None:
        with open(self.log_path, "a") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT)

        async def serving() -> bool:
            assert self.process.poll() is None, self.log_path.read_text()[-2000:]
            try:
                return await health_of(self.address, "") == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        await eventually(serving, timeout_s=60, interval_s=0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


async def test_inference_outage_goes_fresh_stale_fallback_and_recovers(model_repository, credit_holdout, tmp_path):
    inference = InferenceProcess(model_repository, free_port(), tmp_path / "inference.log")
    await inference.start()
    settings = prediction_settings(tmp_path, model_repository, inference.address, cache_fresh_ttl_s=0.5,
                                   cache_stale_ttl_s=600, breaker_failure_threshold=3, breaker_open_ms=300,
                                   inference_reconnect_backoff_max_ms=300)
    a, b, c = credit_holdout.records[:3]
    try:
        async with prediction_service(settings) as (stub, predictor, _, address):
            fresh = await stub.Predict(predict("out-a1", a), timeout=5)
            cached = await stub.Predict(predict("out-a2", a), timeout=5)
            assert not fresh.from_cache and not fresh.stale and not fresh.fallback and fresh.degraded_reason == ""
            assert cached.from_cache and not cached.stale and cached.probability == fresh.probability

            inference.kill()  # InferenceService stops mid-run
            await asyncio.sleep(0.6)  # past the fresh window
            stale = await stub.Predict(predict("out-a3", a), timeout=5)
            assert stale.stale and stale.from_cache and stale.cache_age_ms >= 500
            assert stale.degraded_reason in ("INFERENCE_UNAVAILABLE", "CIRCUIT_OPEN")
            assert (stale.decision, stale.probability) == (fresh.decision, fresh.probability)
            assert "STALE_CACHE_RESULT" in stale.reason_codes
            fallback = await stub.Predict(predict("out-b1", b), timeout=5)  # nothing cached for b
            assert fallback.fallback and fallback.decision == pb.DECISION_REVIEW and fallback.probability == 0
            assert fallback.reason_codes[0] == "INFERENCE_UNAVAILABLE" and not fallback.stale
            assert fallback.model_version == ""

            async def degraded_but_ready() -> bool:
                return (await health_of(address, f"{SERVICE}/inference") == health_pb2.HealthCheckResponse.NOT_SERVING
                        and await health_of(address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
                        and await health_of(address, "") == health_pb2.HealthCheckResponse.SERVING)

            await eventually(degraded_but_ready)

            await inference.start()  # InferenceService comes back on the same address
            attempt = 0

            async def recovered() -> pb.PredictResponse | None:
                nonlocal attempt
                attempt += 1
                reply = await stub.Predict(predict(f"out-c{attempt}", c), timeout=5)
                return reply if not reply.fallback else None

            await eventually(recovered, timeout_s=30, interval_s=0.2)
            again = await stub.Predict(predict("out-b2", b), timeout=5)
            assert not again.fallback and not again.stale and again.degraded_reason == ""
            retried = await stub.Predict(predict("out-b1", b), timeout=5)  # a retry gets the decision on record
            assert retried.fallback and retried.decision_id == fallback.decision_id
            await eventually(lambda: _serving(address, f"{SERVICE}/inference"))

            assert await predictor.recorder.wait_delivered(20)
            ids = ["out-a1", "out-a2", "out-a3", "out-b1", "out-b2"] + [f"out-c{i}" for i in range(1, attempt + 1)]
            rows = await crm_rows(settings.crm_url, ids)
    finally:
        inference.kill()
    assert sorted(rows) == sorted(ids) and all(len(r) == 1 for r in rows.values())
    assert rows["out-a3"][0].served_from == "stale_cache" and rows["out-a2"][0].served_from == "cache"
    assert rows["out-b1"][0].served_from == "fallback" and rows["out-b1"][0].probability is None


async def _serving(address: str, service: str) -> bool:
    return await health_of(address, service) == health_pb2.HealthCheckResponse.SERVING


N_PREDICTIONS = 90


async def test_crm_connection_cut_and_restored_every_decision_lands_exactly_once(
        inference_server, model_repository, credit_holdout, postgres_url, tmp_path):
    target = make_url(postgres_url)
    proxy = TcpProxy(target.host, target.port)
    await proxy.start()
    crm_via_proxy = target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    settings = prediction_settings(tmp_path, model_repository, inference_server, crm_url=crm_via_proxy,
                                   crm_timeout_ms=1000, relay_backoff_max_ms=200)
    records = credit_holdout.records[:N_PREDICTIONS]
    ids = [f"crm-cut-{i}-{time.monotonic_ns()}" for i in range(N_PREDICTIONS)]
    third = N_PREDICTIONS // 3
    try:
        async with prediction_service(settings) as (stub, predictor, _, address):
            async def send(indices) -> list[pb.PredictResponse]:
                return await asyncio.gather(*(stub.Predict(predict(ids[i], records[i]), timeout=10) for i in indices))

            replies = await send(range(third))
            await proxy.cut()  # the CRM database connection is cut mid-run
            replies += await send(range(third, 2 * third))  # decisions are still returned
            retried = await send(range(third, third + 5))  # and retries during the outage get the same ones
            assert [r.decision_id for r in retried] == [r.decision_id for r in replies[third:third + 5]]

            async def crm_down_but_ready() -> bool:
                return (await health_of(address, f"{SERVICE}/crm") == health_pb2.HealthCheckResponse.NOT_SERVING
                        and await health_of(address, SERVICE) == health_pb2.HealthCheckResponse.SERVING)

            await eventually(crm_down_but_ready)
            assert (await predictor.recorder.ledger.backlog())[0] > 0
            await proxy.restore()
            replies += await send(range(2 * third, N_PREDICTIONS))
            assert await predictor.recorder.wait_delivered(30)
            await eventually(lambda: _serving(address, f"{SERVICE}/crm"))
    finally:
        await proxy.close()
    rows = await crm_rows(postgres_url, ids)
    assert len(replies) == N_PREDICTIONS and len(rows) == N_PREDICTIONS
    assert all(len(found) == 1 for found in rows.values()), "a decision was written twice"
    assert all(rows[r.request_id][0].decision_id == r.decision_id for r in replies)
    engine = make_engine(postgres_url)
    try:
        async with engine.connect() as conn:
            total = await conn.scalar(select(func.count()).select_from(DecisionRecord)
                                      .where(DecisionRecord.request_id.like("crm-cut-%")))
    finally:
        await engine.dispose()
    assert total == N_PREDICTIONS


async def test_c39_a_retry_after_a_timeout_that_followed_the_commit_returns_the_same_decision(
        inference_server, model_repository, credit_holdout, tmp_path):
    settings = prediction_settings(tmp_path, model_repository, inference_server)
    async with prediction_service(settings) as (stub, predictor, _, _):
        ledger = predictor.recorder.ledger
        record_many = ledger.record_many
        slow = asyncio.Event()
        slow.set()

        async def record_then_stall(decisions, fingerprints):  # the commit happens; the answer is late
            recorded = await record_many(decisions, fingerprints)
            if slow.is_set():
                await asyncio.sleep(5)
            return recorded

        ledger.record_many = record_then_stall
        request = predict("c39-timeout", credit_holdout.records[0])
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await stub.Predict(request, timeout=0.5)
        assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        on_record = await ledger.find("c39-timeout")
        assert on_record is not None
        committed = on_record.decision
        slow.clear()
        retry = await stub.Predict(request, timeout=5)
        assert retry.decision_id == committed.decision_id and retry.probability == committed.probability
        assert await predictor.recorder.wait_delivered(10)
    rows = await crm_rows(settings.crm_url, ["c39-timeout"])
    assert len(rows["c39-timeout"]) == 1
