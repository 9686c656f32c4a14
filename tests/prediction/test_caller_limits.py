"""Per-caller rate limits (intake/limits.py): GCRA in this process and in Redis (one atomic script
per call, shared by every replica); a refused call is RESOURCE_EXHAUSTED with RetryInfo, counted
per caller, and never decided nor recorded."""

from __future__ import annotations

import sqlite3
import uuid

import grpc
import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction.errors import CallerRateLimited, LimitUnavailable
from mlpair.prediction.intake.limits import Limit, MemoryLimiter, RedisLimiter, parse_limits
from mlpair.rpc.status import error_info, retry_delay_s
from tests.fault_support import eventually, free_port, prediction_service, prediction_settings
from tests.support import require_service

pytestmark = pytest.mark.timeout(120)
REDIS = ("127.0.0.1", 6379)


def label(caller: str) -> str:
    return caller


def counted(caller: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("prediction_caller_decisions_total", {"caller": caller, "outcome": outcome}) or 0.0


def test_limits_are_parsed_per_caller_with_a_burst_of_at_least_one():
    assert parse_limits({"a": 50, "*": 0.5}, 0.2) == {"a": Limit(50.0, 10.0), "*": Limit(0.5, 1.0)}
    with pytest.raises(ValueError, match="'a'"):
        parse_limits({"a": 0}, 1.0)


async def take_all(limiter, caller: str, calls: list[int]) -> list[float | None]:
    """Per call of ``calls`` decisions: None when admitted, else its retry delay in seconds."""
    out: list[float | None] = []
    for n in calls:
        try:
            await limiter.take(caller, n)
            out.append(None)
        except CallerRateLimited as exc:
            out.append(exc.retry_after_s)
    return out


async def test_memory_limiter_admits_the_burst_then_refuses_with_the_time_to_wait():
    limiter = MemoryLimiter({"a": Limit(10.0, 5.0)}, label)  # 10 decisions/s, burst 5; b is not limited
    before = counted("a", "limited")
    outcomes = await take_all(limiter, "a", [6, 2, 3, 1])
    assert outcomes[0] == pytest.approx(0.1, abs=0.01)  # 6 > burst: refused whole, nothing taken
    assert outcomes[1:3] == [None, None]  # then 2 + 3: the burst
    assert outcomes[3] is not None and 0.05 < outcomes[3] <= 0.1  # one decision every 0.1 s
    assert counted("a", "limited") - before == 7
    assert await take_all(limiter, "b", [1000] * 3) == [None] * 3


@pytest.fixture
async def redis_limiters():
    """Two limiters on one Redis key prefix: two replicas sharing the limits."""
    require_service("Redis", *REDIS)
    prefix = f"mlpair-test:{uuid.uuid4().hex}:"
    limits = {"a": Limit(10.0, 5.0)}
    made = [RedisLimiter(limits, label, f"redis://{REDIS[0]}:{REDIS[1]}/0", prefix, 1.0) for _ in range(2)]
    yield made
    keys = [k async for k in made[0]._redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await made[0]._redis.delete(*keys)
    for limiter in made:
        await limiter.close()


async def test_redis_limits_are_shared_by_every_replica(redis_limiters):
    one, two = redis_limiters
    [over, admitted] = await take_all(one, "a", [6, 3])
    assert over is not None and admitted is None
    assert await take_all(two, "a", [2]) == [None]
    [refused] = await take_all(two, "a", [1])
    assert refused is not None and 0.05 < refused <= 0.1
    [also] = await take_all(one, "a", [1])
    assert also is not None


async def test_redis_unreachable_fails_open_or_closed_as_set_and_is_counted():
    limits, url = {"*": Limit(1.0, 1.0)}, f"redis://127.0.0.1:{free_port()}/0"
    opened = RedisLimiter(limits, label, url, "mlpair-test:", 0.2, "open")
    closed = RedisLimiter(limits, label, url, "mlpair-test:", 0.2, "closed")
    errors = {f: REGISTRY.get_sample_value("prediction_caller_limit_errors_total", {"failure": f}) or 0.0
              for f in ("open", "closed")}
    try:
        assert await take_all(opened, "x", [5, 5]) == [None, None]
        with pytest.raises(LimitUnavailable):
            await closed.take("x", 1)
    finally:
        await opened.close()
        await closed.close()
    assert REGISTRY.get_sample_value("prediction_caller_limit_errors_total", {"failure": "open"}) - errors["open"] == 2
    assert REGISTRY.get_sample_value("prediction_caller_limit_errors_total", {"failure": "closed"}) - errors["closed"] == 1


def ledger_rows(path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT count(*) FROM decision_ledger").fetchone()[0]


async def test_a_refused_call_is_resource_exhausted_with_retry_info_and_never_recorded(
        tmp_path, model_repository, inference_server, credit_holdout):
    settings = prediction_settings(tmp_path, model_repository, inference_server, caller_source="header",
                                   caller_limits={"prober": 2, "*": 1000}, caller_burst_s=1.0)
    prober, other = (("x-caller-id", "prober"),), (("x-caller-id", "someone"),)
    records = credit_holdout.records

    def ask(i: int) -> pb.PredictRequest:
        return pb.PredictRequest(request_id=f"lim-{i}", entity_id=f"e-{i}", attributes=to_attributes(records[i]))

    limited_before = counted("prober", "limited")
    async with prediction_service(settings) as (stub, predictor, _, _):
        for i in range(2):
            assert (await stub.Predict(ask(i), timeout=20, metadata=prober)).decision_label
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Predict(ask(2), timeout=20, metadata=prober)
        with pytest.raises(grpc.aio.AioRpcError) as batch_refused:
            await stub.BatchPredict(pb.BatchPredictRequest(requests=[ask(3), ask(4)]), timeout=20, metadata=prober)
        other_batch = await stub.BatchPredict(pb.BatchPredictRequest(requests=[ask(5), ask(6)]), timeout=20,
                                              metadata=other)
        for error in (refused.value, batch_refused.value):
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info(error).reason == "CALLER_RATE_LIMITED"
            assert 0.0 < retry_delay_s(error) <= 1.0
        assert [r.WhichOneof("outcome") for r in other_batch.results] == ["prediction"] * 2
        await eventually(lambda: predictor.recorder.wait_delivered(0.5))
        assert [await predictor.recorder.ledger.find(f"lim-{i}") is not None for i in range(7)] == \
            [True, True, False, False, False, True, True]
        assert [await predictor.crm.find(f"lim-{i}") is not None for i in range(7)] == \
            [True, True, False, False, False, True, True]
    assert ledger_rows(tmp_path / "ledger.sqlite") == 4
    assert counted("prober", "limited") - limited_before == 3
