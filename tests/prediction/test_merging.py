"""Concurrent Predict calls decided together (services/prediction/mlpair/prediction/intake/merging.py), through the real
InferenceService behind a counting forwarder: exact batch counts, and every caller's outcome is
the one it gets alone.

Each test holds a first call in a slow Infer call, so the calls sent meanwhile queue up and go as
one batch when it is done (``merge_wait_from_calls=1``: a call waits while one call is being
decided; ``merge_max_delay_ms`` is long enough that nothing else sends them).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from tests.fault_support import inference_forwarder, prediction_service, prediction_settings
from tests.support.e2e import expected_probabilities, predict_request

HOLD_S = 0.3  # the forwarder's delay: how long the first batch keeps the next calls queued
TIMEOUT_S = 20.0


def merged() -> tuple[float, float]:
    """(batches sent, calls in them) so far: ``prediction_merged_calls`` count and sum."""
    return (REGISTRY.get_sample_value("prediction_merged_calls_count") or 0.0,
            REGISTRY.get_sample_value("prediction_merged_calls_sum") or 0.0)


def settings_for(tmp_path, model_repository, target, **overrides):
    return prediction_settings(tmp_path, model_repository, target, cache_backend="off", merge_max_delay_ms=10_000,
                               merge_wait_from_calls=1, **overrides)


async def hold_first_batch(stub, forwarder, record: dict) -> asyncio.Task:
    """Sends one call and waits until its Infer call is held by the forwarder."""
    forwarder.delay_s = HOLD_S
    first = asyncio.ensure_future(stub.Predict(predict_request("first", record), timeout=TIMEOUT_S))
    while forwarder.calls < 1:
        await asyncio.sleep(0.005)
    return first


async def test_concurrent_predicts_are_decided_as_one_batch_each_as_if_alone(
        inference_server, model_repository, credit_entry, credit_holdout, tmp_path):
    records = credit_holdout.records[:7]
    bad = dict(records[6], **{next(iter(records[6])): "not a number"})  # a value no conversion accepts
    async with (
        inference_forwarder(inference_server) as (target, forwarder),
        prediction_service(settings_for(tmp_path, model_repository, target)) as (stub, predictor, _, _),
    ):
        before = merged()
        first = await hold_first_batch(stub, forwarder, records[0])
        calls = [stub.Predict(predict_request(f"m-{i}", records[i]), timeout=TIMEOUT_S) for i in range(1, 6)]
        calls.append(stub.Predict(predict_request("m-bad", bad), timeout=TIMEOUT_S))
        outcomes = await asyncio.gather(first, *calls, return_exceptions=True)
        after = merged()
        ledger = predictor.recorder.ledger
        on_record = [await ledger.find(rid) for rid in ["first", *(f"m-{i}" for i in range(1, 6)), "m-bad"]]
    # two batches: the first call alone, then the six that queued behind it
    assert (after[0] - before[0], after[1] - before[1]) == (2, 7)
    # the five good calls' rows went out as one Infer call
    assert forwarder.rows == [1, 5]
    replies, refused = outcomes[:6], outcomes[6]
    assert all(isinstance(r, pb.PredictResponse) for r in replies), replies
    expected = expected_probabilities(credit_entry, records[:6])
    np.testing.assert_allclose([r.probability for r in replies], expected, rtol=1e-6, atol=1e-7)
    assert not any(r.replayed or r.fallback for r in replies)
    assert len({r.decision_id for r in replies}) == 6
    # the bad item got its own error, and nothing of it is on record
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert on_record[-1] is None
    assert [r.decision.decision_id for r in on_record[:6]] == [r.decision_id for r in replies]


async def test_two_concurrent_calls_with_one_request_id_never_share_a_batch_and_get_one_decision(
        inference_server, model_repository, credit_holdout, tmp_path):
    record = credit_holdout.records[1]
    async with (
        inference_forwarder(inference_server) as (target, forwarder),
        prediction_service(settings_for(tmp_path, model_repository, target)) as (stub, predictor, _, _),
    ):
        before = merged()
        first = await hold_first_batch(stub, forwarder, credit_holdout.records[0])
        same = [stub.Predict(predict_request("same-id", record), timeout=TIMEOUT_S) for _ in range(2)]
        replies = await asyncio.gather(first, *same)
        after = merged()
        recorded = await predictor.recorder.ledger.find("same-id")
    # the repeated id sent the queue ahead of it: three batches of one
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3)
    a, b = replies[1], replies[2]
    assert a.decision_id == b.decision_id == recorded.decision.decision_id
    assert (a.decision, a.probability) == (b.decision, b.probability)
    assert sorted([a.replayed, b.replayed]) == [False, True]


async def test_a_caller_that_leaves_a_merged_batch_takes_only_its_item(
        inference_server, model_repository, credit_holdout, tmp_path):
    records = credit_holdout.records
    async with (
        inference_forwarder(inference_server) as (target, forwarder),
        prediction_service(settings_for(tmp_path, model_repository, target)) as (stub, predictor, _, _),
    ):
        first = await hold_first_batch(stub, forwarder, records[0])
        calls = {rid: stub.Predict(predict_request(rid, records[i]), timeout=TIMEOUT_S)
                 for i, rid in enumerate(["stay-1", "leave", "stay-2"], start=1)}
        await first
        while forwarder.calls < 2:  # the batch of three is in its (held) Infer call
            await asyncio.sleep(0.005)
        calls["leave"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await calls["leave"]
        stayed = [await calls["stay-1"], await calls["stay-2"]]
        ledger = predictor.recorder.ledger
        gone, kept = await ledger.find("leave"), [await ledger.find(r) for r in ("stay-1", "stay-2")]
    assert forwarder.rows == [1, 3]
    assert forwarder.cancelled == 0  # the shared Infer call went on for the callers still waiting
    assert gone is None
    assert [k.decision.decision_id for k in kept] == [r.decision_id for r in stayed]
    assert not any(r.fallback for r in stayed)


async def test_a_short_deadline_is_not_merged_with_long_ones_and_gets_its_fallback_in_time(
        inference_server, model_repository, credit_holdout, tmp_path):
    records = credit_holdout.records
    async with inference_forwarder(inference_server) as (target, forwarder):
        # 100 ms kept back to record the fallback, as test_resilience's C22 tests keep 200: room on a busy CI machine
        settings = settings_for(tmp_path, model_repository, target, crm_reserve_ms=100)
        async with prediction_service(settings) as (stub, _, _, _):
            before = merged()
            first = await hold_first_batch(stub, forwarder, records[0])
            long_calls = [stub.Predict(predict_request(f"long-{i}", records[i]), timeout=TIMEOUT_S) for i in (1, 2)]
            short = stub.Predict(predict_request("short", records[3]), timeout=0.25)
            loop = asyncio.get_running_loop()
            started = loop.time()
            short_reply = await short
            short_s = loop.time() - started
            replies = await asyncio.gather(first, *long_calls)
            after = merged()
    # batches: the first, the short call alone (it did not wait for the first batch), the two long ones
    assert (after[0] - before[0], after[1] - before[1]) == (3, 4)
    assert short_reply.fallback and short_reply.degraded_reason == "INFERENCE_TIMEOUT"
    assert short_s < 0.25
    assert not any(r.fallback for r in replies)


async def test_near_deadlines_share_a_batch_only_within_the_window_and_batches_stop_at_max_calls():
    """The merger alone, with a stand-in for the pipeline: which calls go out together."""
    from mlpair.prediction.intake.merging import PredictMerger
    from mlpair.prediction.outcomes import PredictInput

    batches: list[list[str]] = []
    release = asyncio.Event()

    async def run(requests, callers):
        batches.append([r.request_id for r in requests])
        assert (callers is None) == (len(requests) == 1)
        if requests[0].request_id == "busy":
            await release.wait()
        return [f"outcome of {r.request_id}" for r in requests]

    merger = PredictMerger(run, max_calls=3, max_delay_s=10.0, deadline_window_s=0.01, scoring_bound_s=5.0,
                           wait_from_calls=1)

    def call(request_id: str, in_s: float | None) -> asyncio.Future:
        deadline = None if in_s is None else time.monotonic() + in_s
        return asyncio.ensure_future(merger.decide(PredictInput(request_id, "e", {}, deadline=deadline)))

    busy = call("busy", None)
    await asyncio.sleep(0)  # sent at once: nothing was being decided
    queued = [call("near-1", 1.0), call("near-2", 1.005), call("near-later", 1.5), call("none-1", None),
              call("far", 60.0), call("none-2", None), call("none-3", None)]
    await asyncio.sleep(0.01)  # all queued behind the busy batch (a tenth of 1 s is 100 ms)
    release.set()
    outcomes = await asyncio.gather(busy, *queued)
    assert outcomes[1] == "outcome of near-1" and outcomes[-1] == "outcome of none-3"
    # near deadlines 5 ms apart share a batch, 500 ms apart do not; no deadline and a far one share,
    # three at most (the third call filled the batch, which went at once, before the busy one was done)
    assert batches == [["busy"], ["none-1", "far", "none-2"], ["near-1", "near-2"], ["near-later"], ["none-3"]]


async def test_below_wait_from_calls_no_call_waits_for_company():
    from mlpair.prediction.intake.merging import PredictMerger
    from mlpair.prediction.outcomes import PredictInput

    batches: list[list[str]] = []
    release = asyncio.Event()

    async def run(requests, callers):
        batches.append([r.request_id for r in requests])
        await release.wait()
        return [r.request_id for r in requests]

    merger = PredictMerger(run, max_calls=64, max_delay_s=10.0, deadline_window_s=0.01, scoring_bound_s=5.0,
                           wait_from_calls=3)
    calls = []
    for i in range(4):  # one at a time: the first three go at once, the fourth waits (three being decided)
        calls.append(asyncio.ensure_future(merger.decide(PredictInput(f"c{i}", "e", {}))))
        await asyncio.sleep(0)
    calls.append(asyncio.ensure_future(merger.decide(PredictInput("c4", "e", {}))))
    await asyncio.sleep(0.01)
    assert batches == [["c0"], ["c1"], ["c2"]]
    release.set()
    assert await asyncio.gather(*calls) == ["c0", "c1", "c2", "c3", "c4"]
    assert batches == [["c0"], ["c1"], ["c2"], ["c3", "c4"]]


async def test_decided_calls_leave_nothing_for_the_cyclic_collector():
    """Once a merged batch is decided, its calls, requests and outcomes are freed by reference
    counting: a call linked to its batch and task forms cycles that only the cyclic collector
    frees, and under load those were a fifth of what each young collection scanned."""
    import gc

    from mlpair.prediction.intake.merging import MergedCall, PredictMerger
    from mlpair.prediction.outcomes import PredictInput

    class Outcome:
        pass

    batches: list[int] = []

    async def run(requests, callers):
        batches.append(len(requests))
        return [Outcome() for _ in requests]

    merger = PredictMerger(run, max_calls=8, max_delay_s=10.0, deadline_window_s=0.01, scoring_bound_s=5.0,
                           wait_from_calls=0)
    gc.collect()
    gc.disable()
    try:
        outcomes = await asyncio.gather(*(merger.decide(PredictInput(f"c{i}", "e", {})) for i in range(8)))
        await asyncio.sleep(0)  # the batch task's done callback
        assert batches == [8] and len(outcomes) == 8  # decided together
        del outcomes
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
        gc.collect()
        left = sorted(type(o).__name__ for o in gc.garbage if isinstance(o, (MergedCall, PredictInput, Outcome)))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
