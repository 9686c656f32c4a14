"""Coalescing across the hop: concurrent requests' rows share one Infer call (real InferenceService).

Every test drives the real InferenceService through a counting forwarder, which sees each
Infer call that crosses the hop, its rows and its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import numpy as np
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.errors import DeadlineTooShort, InferenceTimeout, InferenceUnavailable
from mlpair.prediction.scoring.client import InferenceClient
from mlpair.prediction.scoring.coalescer import InferenceCoalescer
from mlpair.prediction.scoring.resilience import (
    CircuitBreaker,
    CircuitState,
    DeadlineBudget,
    ResilientCaller,
    RetryPolicy,
)
from tests.fault_support import inference_forwarder, prediction_service, prediction_settings
from tests.support.e2e import expected_probabilities

LONG_S = 30.0  # a max delay or model delay no test waits out: only the behaviour under test ends the wait


@pytest.fixture(scope="module")
def rows(credit_entry, credit_holdout) -> np.ndarray:
    """Real holdout applicants as ``[n, n_features] float32``."""
    return FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records[:64])


@pytest.fixture(scope="module")
async def expected(inference_server, credit_entry, rows) -> np.ndarray:
    """The logits of every row, from one direct call (no coalescing)."""
    client = InferenceClient(inference_server, timeout_ms=10_000, max_message_bytes=1 << 22)
    try:
        logits, _ = await client.infer(target_of(credit_entry), rows)
    finally:
        await client.close()
    return logits


@contextlib.asynccontextmanager
async def coalescer(target: str, *, max_delay_s: float = LONG_S, max_rows: int = 64, threshold: int = 5):
    client = InferenceClient(target, timeout_ms=60_000, max_message_bytes=1 << 22)
    caller = ResilientCaller(CircuitBreaker("inference", failure_threshold=threshold, open_s=60),
                             DeadlineBudget(reserve_s=0.02, max_call_s=60.0), RetryPolicy(max_attempts=1))
    merged = InferenceCoalescer(client, caller, max_delay_s=max_delay_s, max_rows=max_rows)
    try:
        yield merged, caller
    finally:
        await merged.close()
        await client.close()


def call(merged: InferenceCoalescer, entry, rows: np.ndarray, deadline: float | None = None):
    return asyncio.ensure_future(merged.infer(target_of(entry), rows, deadline))


def target_of(entry) -> ModelTarget:
    return ModelTarget("credit-risk", entry.manifest.model_version, entry.manifest.versions.feature_schema_version)


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_requests_queued_behind_a_call_share_the_next_one_and_get_their_own_rows(
        inference_server, credit_entry, rows, expected):
    async with inference_forwarder(inference_server) as (target, forwarder), coalescer(target) as (merged, _):
        forwarder.delay_s = 0.2
        first = call(merged, credit_entry, rows[:1])
        await until(lambda: forwarder.calls == 1)
        queued = [call(merged, credit_entry, rows[i:i + 1]) for i in range(1, 21)]
        results = await asyncio.gather(first, *queued)
    assert forwarder.calls == 2 and forwarder.rows == [1, 20]  # 21 requests, two calls across the hop
    for i, (logits, version) in enumerate(results):
        assert version == credit_entry.manifest.model_version
        np.testing.assert_allclose(logits, expected[i:i + 1], atol=1e-6)


async def test_a_lone_request_is_sent_at_once_not_after_the_max_delay(inference_server, credit_entry, rows, expected):
    async with inference_forwarder(inference_server) as (target, forwarder), coalescer(target) as (merged, _):
        async with asyncio.timeout(10):  # the max delay is 30 s: only an immediate send ends in time
            logits, _ = await call(merged, credit_entry, rows[:3])
    assert forwarder.rows == [3]
    np.testing.assert_allclose(logits, expected[:3], atol=1e-6)


async def test_calls_never_exceed_max_rows_and_one_requests_rows_are_never_split(
        inference_server, credit_entry, rows, expected):
    async with inference_forwarder(inference_server) as (target, forwarder), \
            coalescer(target, max_rows=8) as (merged, _):
        forwarder.delay_s = 0.2
        first = call(merged, credit_entry, rows[:1])
        await until(lambda: forwarder.calls == 1)
        parts = [call(merged, credit_entry, rows[1 + 5 * k:6 + 5 * k]) for k in range(3)]
        results = await asyncio.gather(first, *parts)
    assert sorted(forwarder.rows) == [1, 5, 5, 5]  # 5 + 5 > 8: each request's 5 rows travel whole
    for k, (logits, _) in enumerate(results[1:]):
        np.testing.assert_allclose(logits, expected[1 + 5 * k:6 + 5 * k], atol=1e-6)


async def test_a_merged_call_gets_the_latest_deadline_and_spent_budgets_are_left_out(
        inference_server, credit_entry, rows):
    async with inference_forwarder(inference_server) as (target, forwarder), coalescer(target) as (merged, _):
        forwarder.delay_s = 0.2
        first = call(merged, credit_entry, rows[:1])
        await until(lambda: forwarder.calls == 1)
        now = time.monotonic()
        near = call(merged, credit_entry, rows[1:3], deadline=now + 3.0)
        far = call(merged, credit_entry, rows[3:4], deadline=now + 8.0)
        spent = call(merged, credit_entry, rows[4:8], deadline=now + 0.01)  # less than the CRM reserve
        await asyncio.gather(first, near, far)
        with pytest.raises(DeadlineTooShort):  # the caller's deadline, not inference's fault: no fallback
            await spent
    assert forwarder.rows == [1, 3]  # the spent request's 4 rows never crossed the hop
    assert 3.0 < forwarder.deadlines[1] < 8.0  # the later deadline, less the time spent queued


async def test_a_short_deadline_times_out_alone_and_never_trips_the_breaker(inference_server, credit_entry, rows):
    async with inference_forwarder(inference_server) as (target, forwarder), \
            coalescer(target, threshold=1) as (merged, caller):
        forwarder.delay_s = 0.3  # slower than the short caller's budget, well inside the others'
        now = time.monotonic()
        short = call(merged, credit_entry, rows[:1], deadline=now + 0.1)
        others = [call(merged, credit_entry, rows[i:i + 1], deadline=now + 10.0) for i in range(1, 6)]
        results = await asyncio.gather(short, *others, return_exceptions=True)
    assert forwarder.rows == [6]  # one merged call
    assert isinstance(results[0], InferenceTimeout)
    assert all(isinstance(r, tuple) for r in results[1:]) and caller.breaker.state is CircuitState.CLOSED


async def test_the_breaker_counts_a_merged_call_once(inference_server, credit_entry, rows):
    async with inference_forwarder(inference_server) as (target, forwarder), \
            coalescer(target, threshold=2) as (merged, caller):
        forwarder.fail_first = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
        together = await asyncio.gather(*(call(merged, credit_entry, rows[i:i + 1]) for i in range(10)),
                                        return_exceptions=True)
        assert forwarder.calls == 1 and all(isinstance(r, InferenceUnavailable) for r in together)
        assert caller.breaker.state is CircuitState.CLOSED  # ten requests, one failed call
        again = await asyncio.gather(*(call(merged, credit_entry, rows[i:i + 1]) for i in range(10)),
                                     return_exceptions=True)
        assert forwarder.calls == 2 and all(isinstance(r, InferenceUnavailable) for r in again)
        assert caller.breaker.state is CircuitState.OPEN


async def test_c22_a_merged_call_is_cancelled_only_when_every_request_in_it_has_gone(
        inference_server, credit_entry, rows):
    async with inference_forwarder(inference_server) as (target, forwarder), coalescer(target) as (merged, _):
        forwarder.delay_s = LONG_S
        a, b = call(merged, credit_entry, rows[:1]), call(merged, credit_entry, rows[1:2])
        await until(lambda: forwarder.calls == 1)
        assert forwarder.rows == [2]  # made together, sent together
        a.cancel()
        await asyncio.sleep(0.2)
        assert forwarder.cancelled == 0  # b still waits on the call
        b.cancel()
        await until(lambda: forwarder.cancelled == 1)
        await asyncio.gather(a, b, return_exceptions=True)


async def test_a_request_that_leaves_while_queued_is_not_sent(inference_server, credit_entry, rows, expected):
    async with inference_forwarder(inference_server) as (target, forwarder), coalescer(target) as (merged, _):
        forwarder.delay_s = 0.2
        first = call(merged, credit_entry, rows[:1])
        await until(lambda: forwarder.calls == 1)
        gone, stays = call(merged, credit_entry, rows[1:5]), call(merged, credit_entry, rows[5:6])
        await asyncio.sleep(0)
        gone.cancel()
        await first
        logits, _ = await stays
    assert forwarder.rows == [1, 1]
    np.testing.assert_allclose(logits, expected[5:6], atol=1e-6)


async def test_concurrent_predicts_share_infer_calls_across_the_hop(
        inference_server, model_repository, credit_entry, credit_holdout, tmp_path):
    n = 48
    records = credit_holdout.records[100:100 + n]
    async with inference_forwarder(inference_server) as (target, forwarder):
        forwarder.delay_s = 0.05  # a slow hop: requests pile up behind each call
        # the one-second cap on an Infer attempt is not under test here: a scheduling pause of the
        # shared test process must not turn a row into a fallback (as it once did in CI, row 0)
        settings = prediction_settings(tmp_path, model_repository, target, coalesce_max_delay_ms=LONG_S * 1000,
                                       inference_timeout_ms=LONG_S * 1000)
        async with prediction_service(settings) as (stub, predictor, _, _):
            replies = await asyncio.gather(*(stub.Predict(pb.PredictRequest(
                request_id=f"coalesce-{i}", entity_id=f"e{i}", attributes=to_attributes(record)), timeout=30)
                for i, record in enumerate(records)))
            assert await predictor.recorder.wait_delivered(20) and await predictor.crm.count() == n
    assert forwarder.calls < n / 4 and sum(forwarder.rows) == n  # every row sent once, in a few calls
    assert [(i, list(r.reason_codes)) for i, r in enumerate(replies) if r.fallback or r.stale or r.from_cache] == []
    got = np.array([r.probability for r in replies])
    np.testing.assert_allclose(got, expected_probabilities(credit_entry, records), atol=1e-6)
