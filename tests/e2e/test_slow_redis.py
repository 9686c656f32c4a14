"""Issue 36 C53: a Redis slower than the cache timeout opens no connection storm.

The real Redis on 127.0.0.1:6379 sits behind a TCP proxy (``tests.support.pair.TcpProxy``) that holds
every reply 80 ms, against PredictionService's 50 ms ``redis_timeout_ms``. A real PredictionService
(in this process, Redis cache backend, in front of the session's InferenceService) takes 200
concurrent Predict calls of distinct real applicants for a bounded time. The proxy counts the
connections the service opens: never more open than ``redis_max_connections``, none opened
once the pool is warm, and every call is answered, each Redis lookup that came too late a
counted miss (``prediction_cache_errors_total{reason}``), never a failure.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests.e2e.conftest import prediction_service
from tests.support import require_service
from tests.support.pair import TcpProxy, credit_workload

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_DELAY_S = 0.080
CONCURRENCY = 200
WARM_UP_S = 2.0
MEASURED_S = 4.0
MAX_CONNECTIONS = 16  # redis_max_connections' default
REASONS = ("no_connection", "timeout", "error")


def _rows_missed() -> float:
    return REGISTRY.get_sample_value("prediction_cache_requests_total", {"model": "credit-risk", "result": "miss"}) or 0.0


def _errors(operation: str) -> dict[str, float]:
    return {reason: REGISTRY.get_sample_value("prediction_cache_errors_total",
                                              {"backend": "redis", "operation": operation, "reason": reason}) or 0.0
            for reason in REASONS}


async def _redis_info() -> tuple[int, int]:
    """(total_connections_received, connected_clients) of the real Redis, from ``INFO``."""
    from redis import asyncio as aioredis

    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    try:
        stats, clients = await client.info("stats"), await client.info("clients")
    finally:
        await client.aclose()
    return int(stats["total_connections_received"]), int(clients["connected_clients"])


@pytest.mark.timeout(120)
async def test_c53_a_slow_redis_opens_no_connection_storm(inference_server, model_repository, credit_entry, tmp_path):
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    proxy = TcpProxy(REDIS_HOST, REDIS_PORT)
    await proxy.start()
    proxy.delay_s = REDIS_DELAY_S
    requests = credit_workload(credit_entry, f"c53-{uuid.uuid4().hex[:8]}")
    outcomes: dict[str, int] = {}
    marks: dict[str, tuple[float, int]] = {}
    gets_before, puts_before, rows_before = _errors("get"), _errors("put"), _rows_missed()
    received_before, _ = await _redis_info()
    try:
        async with prediction_service(
            inference_server, model_repository, tmp_path, cache_backend="redis",
            redis_url=f"redis://127.0.0.1:{proxy.port}/0", redis_key_prefix=f"mlpair-test:{uuid.uuid4().hex}:",
        ) as (stub, _):
            started = time.monotonic()
            warm_until, end = started + WARM_UP_S, started + WARM_UP_S + MEASURED_S

            async def caller() -> None:
                while (now := time.monotonic()) < end:
                    if now >= warm_until and "warm" not in marks:
                        marks["warm"] = (now, proxy.connections)
                    request_id, entity_id, attributes = next(requests)
                    reply = await stub.Predict(pb.PredictRequest(
                        request_id=request_id, entity_id=entity_id, model_name="credit-risk",
                        attributes=to_attributes(attributes)), timeout=30)
                    key = "from_cache" if reply.from_cache else "fallback" if reply.fallback else "inferred"
                    outcomes[key] = outcomes.get(key, 0) + 1

            await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))  # any failed call fails the test
            marks["end"] = (time.monotonic(), proxy.connections)
            peak_open = proxy.peak_open
            _, clients_during = await _redis_info()
    finally:
        await proxy.close()
    received_after, _ = await _redis_info()
    gets, puts, rows_missed = _errors("get"), _errors("put"), _rows_missed() - rows_before
    missed = {reason: gets[reason] - gets_before[reason] for reason in REASONS}
    (t_warm, opened_warm), (t_end, opened_end) = marks["warm"], marks["end"]
    new_per_s = (opened_end - opened_warm) / (t_end - t_warm)
    calls = sum(outcomes.values())
    print(f"C53: {calls} calls {outcomes}; connections opened {opened_warm} in the first {WARM_UP_S:.0f} s, "
          f"{opened_end - opened_warm} in the next {t_end - t_warm:.1f} s ({new_per_s:.2f}/s); peak open {peak_open}; "
          f"lookups missed {missed}, writes failed "
          f"{ {reason: puts[reason] - puts_before[reason] for reason in REASONS} }; Redis INFO: "
          f"total_connections_received +{received_after - received_before}, connected_clients {clients_during}")
    assert calls >= CONCURRENCY and outcomes.get("from_cache", 0) == 0  # distinct rows, all answered
    assert peak_open <= MAX_CONNECTIONS
    assert opened_warm <= MAX_CONNECTIONS
    assert new_per_s <= 0.5
    assert rows_missed == calls  # each call's row a counted miss, none served from the cache
    assert 0 < missed["timeout"] + missed["no_connection"] <= calls and missed["error"] == 0
