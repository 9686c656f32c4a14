"""Readiness follows what PredictionService cannot work without; dependencies are visible one by one."""

from __future__ import annotations

import sqlite3

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.rpc import error_info
from tests.fault_support import eventually, free_port, health_of, prediction_service, prediction_settings

SERVICE = "mlpair.prediction.v1.PredictionService"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def test_inference_down_is_degraded_but_ready_and_an_unwritable_ledger_is_not_ready(
        model_repository, credit_holdout, tmp_path):
    nobody = f"127.0.0.1:{free_port()}"  # no InferenceService at all
    settings = prediction_settings(tmp_path, model_repository, nobody, ledger_timeout_ms=200)
    async with prediction_service(settings) as (stub, _, _, address):
        async def statuses() -> dict[str, int]:
            names = {"": "", "service": SERVICE, **{d: f"{SERVICE}/{d}" for d in ("inference", "crm", "cache", "ledger")}}
            return {k: await health_of(address, name) for k, name in names.items()}

        assert await statuses() == {"": SERVING, "service": SERVING, "inference": NOT_SERVING, "crm": SERVING,
                                    "cache": SERVING, "ledger": SERVING}
        assert REGISTRY.get_sample_value("prediction_degraded") == 1
        reply = await stub.Predict(pb.PredictRequest(request_id="h1", entity_id="e",
                                                     attributes=to_attributes(credit_holdout.records[0])), timeout=5)
        assert reply.fallback and reply.decision == pb.DECISION_REVIEW

        holder = sqlite3.connect(tmp_path / "ledger.sqlite", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the ledger can no longer take writes
        try:
            async def not_ready() -> bool:
                s = await statuses()
                return s[""] == s["service"] == s["ledger"] == NOT_SERVING

            await eventually(not_ready)
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await stub.Predict(pb.PredictRequest(request_id="h2", entity_id="e",
                                                     attributes=to_attributes(credit_holdout.records[1])), timeout=5)
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(excinfo.value).reason == "DECISION_NOT_RECORDED"
        finally:
            holder.execute("ROLLBACK")
            holder.close()

        async def ready_again() -> bool:
            s = await statuses()
            return s[""] == s["ledger"] == SERVING

        await eventually(ready_again)
