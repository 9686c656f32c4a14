"""Deadline budget, retries and circuit breaker; C22 through the real InferenceService."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.errors import (
    CircuitOpen,
    DeadlineTooShort,
    InferenceContractError,
    InferenceTimeout,
    InferenceUnavailable,
)
from mlpair.prediction.pipeline import PredictInput
from mlpair.prediction.scoring.resilience import (
    CircuitBreaker,
    CircuitState,
    DeadlineBudget,
    ResilientCaller,
    RetryPolicy,
)
from tests.fault_support import inference_forwarder, prediction_service, prediction_settings
from tests.support import Clock, migrate_for
from tests.support.e2e import predict_request


def unavailable(retryable: bool = True) -> InferenceUnavailable:
    error = InferenceUnavailable("down")
    error.retryable = retryable
    return error


def test_breaker_opens_after_consecutive_failures_and_probes_half_open():
    clock = Clock(50.0)
    breaker = CircuitBreaker("t", failure_threshold=3, open_s=2.0, half_open_probes=1, clock=clock)
    for _ in range(2):
        breaker.acquire()
        breaker.record_failure()
    breaker.acquire()
    breaker.record_success()  # a success resets the count
    for _ in range(3):
        breaker.acquire()
        breaker.record_failure()
    assert breaker.state is CircuitState.OPEN
    with pytest.raises(CircuitOpen):
        breaker.acquire()
    clock.now += 2.0
    assert breaker.state is CircuitState.HALF_OPEN
    breaker.acquire()  # the one probe
    with pytest.raises(CircuitOpen):
        breaker.acquire()  # no second probe at once
    breaker.record_failure()
    assert breaker.state is CircuitState.OPEN  # a failed probe reopens at once
    clock.now += 2.0
    breaker.acquire()
    breaker.release()  # a cancelled probe frees its slot
    breaker.acquire()
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED
    breaker.acquire()


def test_budget_is_the_callers_remaining_time_minus_the_reserve():
    budget = DeadlineBudget(reserve_s=0.02, max_call_s=1.0)
    assert budget.call_timeout_s(None, 10.0) == 1.0
    assert budget.call_timeout_s(10.5, 10.0) == pytest.approx(0.48)
    assert budget.call_timeout_s(20.0, 10.0) == 1.0  # capped
    assert budget.call_timeout_s(10.01, 10.0) < 0  # less than the reserve left: no call


def caller(max_attempts: int = 3, threshold: int = 10) -> ResilientCaller:
    return ResilientCaller(CircuitBreaker("t", failure_threshold=threshold, open_s=60),
                           DeadlineBudget(reserve_s=0.01, max_call_s=1.0, min_attempt_s=0.002),
                           RetryPolicy(max_attempts=max_attempts, backoff_base_s=0.001, backoff_max_s=0.002))


async def test_only_unavailable_is_retried_and_only_within_the_attempts():
    attempts = []

    async def flaky(timeout):
        attempts.append(timeout)
        if len(attempts) < 3:
            raise unavailable()
        return "ok"

    assert await caller().call(flaky, None, model="m") == "ok" and len(attempts) == 3
    for error in (unavailable(retryable=False), InferenceTimeout("slow"), InferenceContractError("refused")):
        calls = []

        async def fails(timeout, error=error, calls=calls):
            calls.append(timeout)
            raise error

        with pytest.raises(type(error)):
            await caller().call(fails, None, model="m")
        assert len(calls) == 1, type(error).__name__


async def test_no_attempt_or_retry_without_budget():
    calls = []

    async def down(timeout):
        calls.append(timeout)
        raise unavailable()

    # The caller's own deadline, with nothing known against inference: refused, not a fallback.
    with pytest.raises(DeadlineTooShort):
        await caller().call(down, time.monotonic() + 0.005, model="m")  # under the 10 ms reserve
    assert calls == []
    # While the circuit is open inference is known to be down: the caller falls back, as any caller.
    opened = caller(threshold=1)
    with pytest.raises(InferenceUnavailable):
        await opened.call(down, time.monotonic() + 5.0, model="m")
    assert opened.breaker.state is CircuitState.OPEN and len(calls) == 1
    with pytest.raises(CircuitOpen):
        await opened.call(down, time.monotonic() + 0.005, model="m")
    assert len(calls) == 1
    calls.clear()

    class OneSecondBackoff(RetryPolicy):
        def backoff_s(self, attempt: int) -> float:
            return 1.0

    slow_backoff = ResilientCaller(CircuitBreaker("t", failure_threshold=10, open_s=60),
                                   DeadlineBudget(reserve_s=0.01, max_call_s=1.0), OneSecondBackoff(max_attempts=5))
    with pytest.raises(InferenceUnavailable):
        await slow_backoff.call(down, time.monotonic() + 0.5, model="m")  # the 1 s wait cannot fit in 0.5 s
    assert len(calls) == 1


async def test_breaker_fails_fast_once_open():
    calls = []

    async def down(timeout):
        calls.append(timeout)
        raise unavailable(retryable=False)

    resilient = caller(max_attempts=1, threshold=3)
    for _ in range(3):
        with pytest.raises(InferenceUnavailable):
            await resilient.call(down, None, model="m")
    with pytest.raises(CircuitOpen):
        await resilient.call(down, None, model="m")
    assert len(calls) == 3


async def test_c22_inference_gets_the_callers_remaining_deadline_minus_the_crm_reserve(
        inference_server, model_repository, credit_holdout, tmp_path):
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, crm_reserve_ms=500, cache_backend="off")
        async with prediction_service(settings) as (stub, _, _, _):
            reply = await stub.Predict(predict_request("c22-budget", credit_holdout.records[0]), timeout=1.0)
    assert not reply.fallback and forwarder.calls == 1
    # gRPC rounds a propagated deadline up by a few ms; without the reserve it would be ~1.0 s
    assert forwarder.deadlines[0] is not None and forwarder.deadlines[0] <= 1.0 - 0.5 + 0.05


async def test_c22_slow_model_ends_in_a_recorded_fallback_before_the_callers_deadline_and_is_cancelled(
        inference_server, model_repository, credit_holdout, tmp_path):
    async with inference_forwarder(inference_server) as (target, forwarder):
        forwarder.delay_s = 30.0
        settings = prediction_settings(tmp_path, model_repository, target, crm_reserve_ms=200)
        async with prediction_service(settings) as (stub, predictor, _, _):
            reply = await stub.Predict(predict_request("c22-slow", credit_holdout.records[0]), timeout=1.5)
            assert reply.fallback and reply.decision == pb.DECISION_REVIEW
            assert reply.degraded_reason == "INFERENCE_TIMEOUT" and reply.reason_codes[0] == "INFERENCE_UNAVAILABLE"
            recorded = (await predictor.recorder.ledger.find("c22-slow")).decision
            assert recorded.decision_id == reply.decision_id and recorded.probability is None
            for _ in range(100):  # the Infer call's own deadline has passed: InferenceService stops working on it
                if forwarder.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert forwarder.cancelled == 1


async def test_c22_no_inference_call_when_the_budget_is_already_spent(
        inference_server, model_repository, credit_holdout, tmp_path):
    from mlpair.prediction.composition import build_components

    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, crm_reserve_ms=50)
        components = build_components(settings)
        predictor = components.predictor
        await migrate_for(settings)
        await components.start()
        try:
            with pytest.raises(DeadlineTooShort):
                await predictor.predict(PredictInput("c22-spent", "e", credit_holdout.records[0],
                                                     deadline=time.monotonic() + 0.01))
            assert await components.recorder.ledger.find("c22-spent") is None
            # the same request id with time enough: the model decides it
            result = await predictor.predict(PredictInput("c22-spent", "e", credit_holdout.records[0],
                                                          deadline=time.monotonic() + 5.0))
        finally:
            await components.close()
    assert forwarder.calls == 1
    assert result.stored.served_from == "inference" and result.stored.probability is not None


async def test_c22_a_deadline_too_short_to_score_is_refused_and_records_nothing(
        inference_server, model_repository, credit_holdout, tmp_path):
    # A healthy InferenceService and a caller whose deadline leaves no time to call it: a
    # fallback decision would blame inference and stay the request id's decision for good.
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, crm_reserve_ms=500)
        async with prediction_service(settings) as (stub, predictor, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Predict(predict_request("c22-tight", credit_holdout.records[0]), timeout=0.4)
            assert refused.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "DEADLINE_TOO_SHORT" in str(refused.value.trailing_metadata())
            assert await predictor.recorder.ledger.find("c22-tight") is None
            reply = await stub.Predict(predict_request("c22-tight", credit_holdout.records[0]), timeout=5.0)
    assert forwarder.calls == 1 and not reply.fallback and not reply.replayed and reply.probability > 0


async def test_c22_a_caller_that_gives_up_cancels_the_inference_call_and_nothing_is_recorded(
        inference_server, model_repository, credit_holdout, tmp_path):
    async with inference_forwarder(inference_server) as (target, forwarder):
        forwarder.delay_s = 30.0
        settings = prediction_settings(tmp_path, model_repository, target)
        async with prediction_service(settings) as (stub, predictor, _, _):
            call = stub.Predict(predict_request("c22-gone", credit_holdout.records[0]), timeout=20)
            while forwarder.calls < 1:
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(100):
                if forwarder.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert forwarder.cancelled == 1
            assert await predictor.recorder.ledger.find("c22-gone") is None


async def test_unavailable_is_retried_once_and_the_decision_is_fresh(
        inference_server, model_repository, credit_holdout, tmp_path):
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, cache_backend="off")
        async with prediction_service(settings) as (stub, _, _, _):
            forwarder.fail_first = [grpc.StatusCode.UNAVAILABLE]
            retried = await stub.Predict(predict_request("retry-unavailable", credit_holdout.records[0]), timeout=5)
            assert forwarder.calls == 2 and not retried.fallback
            forwarder.fail_first = [grpc.StatusCode.RESOURCE_EXHAUSTED]
            with pytest.raises(grpc.aio.AioRpcError) as shed:  # load shed: not retried, not a fallback
                await stub.Predict(predict_request("no-retry-exhausted", credit_holdout.records[0]), timeout=5)
            assert forwarder.calls == 3 and shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_open_circuit_stops_calling_inference_and_a_probe_closes_it(
        inference_server, model_repository, credit_holdout, tmp_path):
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, cache_backend="off",
                                       breaker_failure_threshold=3, breaker_open_ms=300, inference_max_attempts=1)
        async with prediction_service(settings) as (stub, _, _, _):
            forwarder.fail_first = [grpc.StatusCode.UNAVAILABLE] * 3
            replies = [await stub.Predict(predict_request(f"breaker-{i}", credit_holdout.records[i]), timeout=5)
                       for i in range(5)]
            assert forwarder.calls == 3  # the 4th and 5th never reached InferenceService
            assert [r.degraded_reason for r in replies] == ["INFERENCE_UNAVAILABLE"] * 3 + ["CIRCUIT_OPEN"] * 2
            await asyncio.sleep(0.35)
            probe = await stub.Predict(predict_request("breaker-probe", credit_holdout.records[5]), timeout=5)
            after = await stub.Predict(predict_request("breaker-after", credit_holdout.records[6]), timeout=5)
            assert not probe.fallback and not after.fallback and forwarder.calls == 5


async def test_load_shed_by_the_mesh_or_a_full_queue_is_the_callers_retryable_error_never_a_breaker_failure(
        inference_server, model_repository, credit_holdout, tmp_path):
    """The deployment review's "the mesh rate limit trips the prediction breaker": it must not."""
    from prometheus_client import REGISTRY

    from mlpair.prediction.errors import InferenceOverloaded
    from mlpair.rpc import error_info, to_status

    def shed_count(cause: str) -> float:
        return REGISTRY.get_sample_value("prediction_inference_errors_total", {"model": "credit-risk", "cause": cause}) or 0.0

    queue_full = to_status("RESOURCE_EXHAUSTED", "queue full", "QUEUE_FULL", "inference.mlpair", {})
    rate_limit = (grpc.StatusCode.RESOURCE_EXHAUSTED, "local_rate_limited", (("x-mlpair-rate-limited", "true"),))
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, cache_backend="off",
                                       breaker_failure_threshold=2, inference_max_attempts=2)
        async with prediction_service(settings) as (stub, predictor, _, _):
            breaker = predictor.scorer.caller.breaker
            before = {c: shed_count(c) for c in ("rate_limited", "queue_full")}
            forwarder.fail_first = [rate_limit] * 3 + [(queue_full.code, queue_full.details, queue_full.trailing_metadata)] * 3
            refused = []
            for i in range(6):
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await stub.Predict(predict_request(f"shed-{i}", credit_holdout.records[i]), timeout=5)
                refused.append(excinfo.value)
            assert [(e.code(), error_info(e).reason) for e in refused] == \
                [(grpc.StatusCode.RESOURCE_EXHAUSTED, InferenceOverloaded.reason)] * 6
            assert [error_info(e).metadata["cause"] for e in refused] == ["rate_limited"] * 3 + ["queue_full"] * 3
            assert forwarder.calls == 6  # never retried: a retry adds load where there is too much
            assert breaker.state is CircuitState.CLOSED  # 6 sheds in a row, threshold 2
            assert {c: shed_count(c) - n for c, n in before.items()} == {"rate_limited": 3, "queue_full": 3}
            assert await predictor.recorder.ledger.find("shed-0") is None  # nothing recorded
            again = await stub.Predict(predict_request("shed-0", credit_holdout.records[0]), timeout=5)
            assert not again.replayed and not again.fallback  # the caller's retry is decided fresh


async def test_a_timeout_counts_for_the_breaker_only_when_the_call_had_its_whole_allowance():
    """A caller's own tight deadline says nothing about the service: it must not open the circuit for all."""
    async def slow(timeout):
        raise InferenceTimeout("deadline")

    resilient = caller(max_attempts=1, threshold=2)  # max_call_s 1.0, reserve 10 ms
    for _ in range(5):  # 5 calls cut short by their caller's deadline (0.2 s left)
        with pytest.raises(InferenceTimeout):
            await resilient.call(slow, time.monotonic() + 0.2, model="m")
    assert resilient.breaker.state is CircuitState.CLOSED
    for _ in range(2):  # 2 calls that had the whole second
        with pytest.raises(InferenceTimeout):
            await resilient.call(slow, None, model="m")
    assert resilient.breaker.state is CircuitState.OPEN
