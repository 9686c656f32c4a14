"""Priorities from PredictionService's RPCs to InferenceService's batch queue: the policy a caller's
``x-priority`` meets, the merger's order, the coalescer's lanes, and a Predict and a BatchPredict
carrying their levels to the real InferenceService (its per-level counters, exact counts)."""

from __future__ import annotations

import asyncio
import contextvars

import grpc
import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client.tables import chunk_result, request_chunks
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.errors import InvalidRequest
from mlpair.prediction.intake import priority
from mlpair.prediction.intake.merging import PredictMerger
from mlpair.prediction.intake.priority import PriorityPolicy
from mlpair.prediction.outcomes import PredictInput
from mlpair.prediction.scoring.client import InferenceClient
from mlpair.prediction.scoring.coalescer import InferenceCoalescer
from mlpair.prediction.scoring.resilience import CircuitBreaker, DeadlineBudget, ResilientCaller, RetryPolicy
from tests.fault_support import inference_forwarder, prediction_service, prediction_settings
from tests.support.e2e import predict_request

pytestmark = pytest.mark.timeout(60)


def queued_at(level: int, model: str = "credit-risk") -> float:
    """Requests InferenceService queued at ``level`` for ``model`` (every version), so far."""
    return sum(
        sample.value
        for family in REGISTRY.collect() if family.name == "inference_priority_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["model"] == model
        and sample.labels["priority"] == str(level) and sample.labels["result"] == "queued"
    )


def entered(policy: PriorityPolicy, metadata, default: int) -> tuple[int, int]:
    """(what enter returned, the context's level after it), in a context of its own."""
    context = contextvars.Context()
    returned = context.run(policy.enter, metadata, default)
    return returned, context.run(priority.current)


def test_a_caller_may_lower_its_priority_but_not_raise_it_unless_allowed():
    policy = PriorityPolicy(levels=3, online=1, bulk=2)
    assert entered(policy, (), 1) == (1, 1)
    assert entered(policy, [("x-priority", "3")], 2) == (3, 3)
    assert entered(policy, [("X-Priority", b"2")], 1) == (2, 2)
    with pytest.raises(InvalidRequest, match="higher than this call's default level 2") as excinfo:
        entered(policy, [("x-priority", "1")], 2)
    assert excinfo.value.code == "INVALID_ARGUMENT"
    assert entered(PriorityPolicy(levels=3, allow_raise=True), [("x-priority", "1")], 2) == (1, 1)
    for undefined in ("0", "4", "-1", "high", "", "1.5"):
        with pytest.raises(InvalidRequest, match="is not a priority level: send 1 \\(highest\\) to 3"):
            entered(policy, [("x-priority", undefined)], 1)
    assert priority.current() == 0  # nothing leaked into this context


def at_level(level: int, coro) -> asyncio.Task:
    """``coro`` as a task running at priority ``level``, as a servicer sets it for a call."""
    context = contextvars.copy_context()
    context.run(priority.use, level)
    return asyncio.get_running_loop().create_task(coro, context=context)


async def test_the_merger_sends_queued_online_predicts_before_bulk_ones_and_never_together():
    """While one call is being decided, two bulk-level and two online Predicts queue (bulk first);
    when it is done the online ones go first, as a batch of their own."""
    order: list[list[str]] = []
    gate = asyncio.Event()

    async def run(requests, callers):
        order.append([r.request_id for r in requests])
        if requests[0].request_id == "first":
            await gate.wait()
        return [r.request_id for r in requests]

    merger = PredictMerger(run, max_calls=8, max_delay_s=30.0, deadline_window_s=0.01, scoring_bound_s=1.0,
                           wait_from_calls=1)
    first = at_level(1, merger.decide(PredictInput("first", "e", {})))
    await asyncio.sleep(0)
    calls = [at_level(level, merger.decide(PredictInput(rid, "e", {})))
             for level, rid in ((2, "b-1"), (2, "b-2"), (1, "o-1"), (1, "o-2"))]
    await asyncio.sleep(0.01)
    assert order == [["first"]]
    gate.set()
    assert await asyncio.gather(first, *calls) == ["first", "b-1", "b-2", "o-1", "o-2"]
    assert order == [["first"], ["o-1", "o-2"], ["b-1", "b-2"]]


async def test_the_coalescer_never_merges_rows_of_different_levels_and_sends_each_level(
        inference_server, credit_entry, credit_holdout):
    rows = FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records[:6])
    target = ModelTarget("credit-risk", credit_entry.manifest.model_version,
                         credit_entry.manifest.versions.feature_schema_version)
    async with inference_forwarder(inference_server) as (address, forwarder):
        client = InferenceClient(address, timeout_ms=10_000, max_message_bytes=1 << 22)
        caller = ResilientCaller(CircuitBreaker("inference", failure_threshold=5, open_s=60),
                                 DeadlineBudget(reserve_s=0.02, max_call_s=30.0), RetryPolicy(max_attempts=1))
        merged = InferenceCoalescer(client, caller, max_delay_s=0.001, max_rows=64)
        before = {level: queued_at(level) for level in (1, 2)}
        try:
            results = await asyncio.gather(*(at_level(level, merged.infer(target, rows[i:i + 1], None))
                                             for i, level in enumerate((1, 2, 1, 2, 1, 2))))
        finally:
            await merged.close()
            await client.close()
    sent = sorted((request.priority, request.inputs.shape[0]) for _, request in forwarder.received)
    assert sent == [(1, 3), (2, 3)]
    assert {level: queued_at(level) - before[level] for level in (1, 2)} == {1: 1, 2: 1}
    direct = InferenceClient(inference_server, timeout_ms=10_000, max_message_bytes=1 << 22)
    try:
        expected, _ = await direct.infer(target, rows)
    finally:
        await direct.close()
    np.testing.assert_array_equal(np.concatenate([logits for logits, _ in results]), expected)


async def test_predict_and_batch_predict_carry_their_levels_to_inference_service(
        inference_server, model_repository, credit_holdout, tmp_path):
    records = credit_holdout.records
    settings = prediction_settings(tmp_path, model_repository, inference_server, cache_backend="off")
    async with prediction_service(settings) as (stub, _, _, _):
        before = {level: queued_at(level) for level in (1, 2)}

        def counted() -> dict[int, float]:
            return {level: queued_at(level) - before[level] for level in (1, 2)}

        await stub.Predict(predict_request("prio-online", records[0]), timeout=20)
        assert counted() == {1: 1, 2: 0}
        batch = pb.BatchPredictRequest(requests=[predict_request(f"prio-bulk-{i}", records[i]) for i in range(1, 4)])
        reply = await stub.BatchPredict(batch, timeout=20)
        assert [r.WhichOneof("outcome") for r in reply.results] == ["prediction"] * 3
        assert counted() == {1: 1, 2: 1}  # the three items' rows in one Infer call at the bulk level
        await stub.Predict(predict_request("prio-lowered", records[4]), metadata=(("x-priority", "2"),), timeout=20)
        assert counted() == {1: 1, 2: 2}
        for call, metadata in ((stub.BatchPredict(batch, metadata=(("x-priority", "1"),), timeout=20), "raise"),
                               (stub.Predict(predict_request("prio-bad", records[5]),
                                             metadata=(("x-priority", "3"),), timeout=20), "undefined")):
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await call
            assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT, metadata
            assert "x-priority" in excinfo.value.details()
        assert counted() == {1: 1, 2: 2}  # refused calls reached no queue
        chunk = pa.table({"request_id": ["prio-col-1", "prio-col-2"], "entity_id": ["c1", "c2"],
                          **{name: [records[6].get(name), records[7].get(name)]
                             for name in dict.fromkeys([*records[6], *records[7]])}})
        replies = [chunk_result(r) async for r in stub.PredictColumns(iter(request_chunks([chunk], "credit-risk")),
                                                                       timeout=20)]
        assert [(r.error, r.decided) for r in replies] == [(None, 2)]
        assert counted() == {1: 1, 2: 3}  # the table's two rows in one Infer call at the bulk level


def test_settings_refuse_levels_that_do_not_exist():
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.settings import PredictionSettings

    assert InferenceSettings().default_level == 2 and InferenceSettings(default_priority_level=1).default_level == 1
    for bad in ({"priority_levels": 0}, {"default_priority_level": 3}, {"priority_queue_rows": [16384, 100]},
                {"priority_queue_rows": [16384, 16384, 16384]}):
        with pytest.raises(ValueError, match="priority"):
            InferenceSettings(**bad)
    with pytest.raises(ValueError, match="priority_online and priority_bulk must be levels"):
        PredictionSettings(priority_bulk=3)
