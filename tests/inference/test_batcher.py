"""The dynamic batcher on the real model: rows, order, limits, deadlines and failures.

Cases: C11 (batching policy and tail latency), C22 (deadline passed while queued), plus the
batcher's own contract: rows never depend on batch-mates, scatter in order, a wrong row
count fails the whole batch with INTERNAL, a full queue is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from mlpair.inference.batcher import DynamicBatcher
from mlpair.inference.errors import DeadlineExpired, InvalidInput, ModelFailure, QueueFull
from mlpair.inference.runtimes.onnx import OnnxRuntime


@pytest.fixture(scope="module")
def runtime(credit_entry) -> OnnxRuntime:
    return OnnxRuntime(credit_entry.model_path, provider="cpu")


class Recording:
    """Wraps the real runtime: records each executed batch's row count, optionally slows or corrupts it."""

    def __init__(self, runtime: OnnxRuntime, *, delay_s: float = 0.0, corrupt=None) -> None:
        self.runtime, self.delay_s, self.corrupt = runtime, delay_s, corrupt
        self.batches: list[int] = []
        self.started = threading.Event()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.batches.append(x.shape[0])
        self.started.set()
        if self.delay_s:
            time.sleep(self.delay_s)
        logits = self.runtime.run(x)
        return self.corrupt(logits) if self.corrupt else logits


_names = iter(range(10_000))


def batcher(run, **kw) -> DynamicBatcher:
    """A started batcher with test defaults and a unique version label (metrics stay per test)."""
    options = dict(max_batch_size=32, max_queue_delay_ms=20, preferred_batch_sizes=[], max_queue_rows=1000)
    b = DynamicBatcher(run, model="credit-risk", version=f"t{next(_names)}", **{**options, **kw})
    b.start()
    return b


def metric(name: str, b: DynamicBatcher, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"model": b.model, "version": b.version, **labels}) or 0.0


async def test_rows_are_scattered_in_order_and_independent_of_batch_mates(runtime, holdout_x):
    """Every row's logits within 1e-5 of the same row run alone, whatever batch it landed in."""
    rec = Recording(runtime)
    b = batcher(rec, max_batch_size=64, max_queue_delay_ms=30)
    sizes = [1, 3, 2, 7, 1, 5, 11, 1, 4, 9, 2, 6]  # 52 rows from 12 callers
    starts = np.cumsum([0, *sizes[:-1]])
    try:
        results = await asyncio.gather(*(b.submit(holdout_x[s:s + n], None) for s, n in zip(starts, sizes)))
    finally:
        await b.close()
    assert max(rec.batches) > 1, "the callers were expected to share a batch"
    for (s, n), got in zip(zip(starts, sizes), results):
        alone = np.concatenate([runtime.run(holdout_x[i:i + 1]) for i in range(s, s + n)])
        assert got.shape == (n, 2)
        np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)


async def test_batches_never_exceed_max_batch_size_rows_and_big_requests_are_split(runtime, holdout_x):
    rec = Recording(runtime)
    b = batcher(rec, max_batch_size=16, max_queue_delay_ms=10)
    try:
        small = [b.submit(holdout_x[i:i + 5], None) for i in range(0, 40, 5)]
        big = b.submit(holdout_x[100:170], None)  # 70 rows > 16: split into 16-row chunks
        results = await asyncio.gather(*small, big)
    finally:
        await b.close()
    assert max(rec.batches) <= 16 and sum(rec.batches) == 40 + 70
    np.testing.assert_allclose(results[-1], runtime.run(holdout_x[100:170]), atol=1e-5)


async def test_a_wrong_row_count_from_the_runtime_fails_every_caller_with_internal(runtime, holdout_x):
    rec = Recording(runtime, corrupt=lambda logits: logits[:-1])  # one row short
    b = batcher(rec, max_queue_delay_ms=30)
    try:
        results = await asyncio.gather(*(b.submit(holdout_x[i:i + 2], None) for i in range(0, 8, 2)),
                                       return_exceptions=True)
    finally:
        await b.close()
    assert len(rec.batches) == 1
    assert all(isinstance(r, ModelFailure) and r.code == "INTERNAL" for r in results)
    assert "wrong number of rows" in results[0].message


async def test_c09_each_caller_gets_its_own_rows_whatever_a_batch_mate_produced(runtime, holdout_x):
    """The batcher hands every caller its own rows as computed; judging a non-finite row is the
    engine's, per request (tests/inference/test_isolation.py), so it can fail no batch-mate."""
    def poison_row_3(logits):
        logits = logits.copy()
        logits[3, 1] = np.nan
        return logits

    b = batcher(Recording(runtime, corrupt=poison_row_3), max_queue_delay_ms=30)
    try:
        results = await asyncio.gather(*(b.submit(holdout_x[i:i + 2], None) for i in range(0, 8, 2)))
    finally:
        await b.close()
    assert np.isnan(results[1][1, 1]) and np.isfinite(results[1][0]).all()  # rows 2-3: its own, as computed
    for i in (0, 2, 3):
        np.testing.assert_array_equal(results[i], runtime.run(holdout_x[2 * i:2 * i + 2]))


async def test_a_full_queue_answers_resource_exhausted_at_once(runtime, holdout_x):
    rec = Recording(runtime, delay_s=0.3)
    b = batcher(rec, max_batch_size=4, max_queue_delay_ms=0, max_queue_rows=8)
    try:
        first = asyncio.ensure_future(b.submit(holdout_x[:4], None))  # executing
        await asyncio.to_thread(rec.started.wait, 5)
        queued = [asyncio.ensure_future(b.submit(holdout_x[i:i + 4], None)) for i in (4, 8)]  # 8 rows wait
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as excinfo:
            await b.submit(holdout_x[:1], None)
        assert excinfo.value.code == "RESOURCE_EXHAUSTED"
        await asyncio.gather(first, *queued)
    finally:
        await b.close()
    assert metric("inference_queue_rejected_total", b) == 1


async def test_c22_requests_that_expire_in_the_queue_are_dropped_before_compute(runtime, holdout_x):
    rec = Recording(runtime, delay_s=0.3)
    b = batcher(rec, max_batch_size=1, max_queue_delay_ms=0)
    try:
        busy = asyncio.ensure_future(b.submit(holdout_x[:1], None))
        await asyncio.to_thread(rec.started.wait, 5)
        soon = time.monotonic() + 0.05
        late = await asyncio.gather(*(b.submit(holdout_x[i:i + 1], soon) for i in range(1, 6)), return_exceptions=True)
        await busy
    finally:
        await b.close()
    assert all(isinstance(r, DeadlineExpired) and r.code == "DEADLINE_EXCEEDED" for r in late)
    assert rec.batches == [1], "an expired request reached the model"
    assert metric("inference_queue_dropped_total", b, reason="expired") == 5
    assert b.queued_rows == 0 and metric("inference_queue_depth_rows", b) == 0


async def test_cancelled_callers_are_removed_from_the_queue(runtime, holdout_x):
    rec = Recording(runtime, delay_s=0.3)
    b = batcher(rec, max_batch_size=1, max_queue_delay_ms=0)
    try:
        busy = asyncio.ensure_future(b.submit(holdout_x[:1], None))
        await asyncio.to_thread(rec.started.wait, 5)
        waiting = [asyncio.ensure_future(b.submit(holdout_x[i:i + 1], None)) for i in range(1, 4)]
        await asyncio.sleep(0.01)
        assert b.queued_rows == 3
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert b.queued_rows == 0 and metric("inference_queue_depth_rows", b) == 0
        await busy
    finally:
        await b.close()
    assert rec.batches == [1]
    assert metric("inference_queue_dropped_total", b, reason="cancelled") == 3


async def test_preferred_batch_sizes_cut_batches_at_a_preferred_boundary(runtime, holdout_x):
    rec = Recording(runtime, delay_s=0.2)
    b = batcher(rec, max_batch_size=32, max_queue_delay_ms=5, preferred_batch_sizes=[4, 8])
    try:
        first = asyncio.ensure_future(b.submit(holdout_x[:1], None))
        await asyncio.to_thread(rec.started.wait, 5)
        rest = [asyncio.ensure_future(b.submit(holdout_x[i:i + 1], None)) for i in range(1, 11)]  # 10 rows queue up
        await asyncio.gather(first, *rest)
    finally:
        await b.close()
    assert rec.batches == [1, 8, 2]


async def test_batching_off_runs_each_request_alone(runtime, holdout_x):
    rec = Recording(runtime)
    b = batcher(rec, batching=False, max_queue_delay_ms=50)
    try:
        await asyncio.gather(*(b.submit(holdout_x[i:i + 3], None) for i in range(0, 30, 3)))
    finally:
        await b.close()
    assert rec.batches == [3] * 10


async def test_c11_trickle_pays_one_delay_and_burst_after_idle_one_delay_plus_one_execution(runtime, holdout_x):
    """With max_queue_delay_ms=5: a lone request waits about one delay, never more; a burst of
    10 after idle runs as one batch that waited one delay. Checked on the exported queue-time
    and batch-size histograms (bucket counts), not on wall-clock speed of the machine."""
    rec = Recording(runtime)
    b = batcher(rec, max_batch_size=64, max_queue_delay_ms=5)
    try:
        for i in range(3):  # a trickle: one request at a time, idle in between
            await b.submit(holdout_x[i:i + 1], None)
            await asyncio.sleep(0.2)
        burst = await asyncio.gather(*(b.submit(holdout_x[i:i + 1], None) for i in range(10, 20)))
    finally:
        await b.close()
    assert rec.batches == [1, 1, 1, 10] and len(burst) == 10
    count = metric("inference_queue_duration_seconds_count", b)
    assert count == 13
    # Queue time never exceeds one delay by more than scheduling slack: all 13 under 50 ms,
    # and none finished early (each waited for batch-mates about one delay: >= 5 ms bucket edge).
    assert metric("inference_queue_duration_seconds_bucket", b, le="0.05") == 13
    assert metric("inference_queue_duration_seconds_bucket", b, le="0.001") == 0
    assert metric("inference_batch_size_rows_bucket", b, le="1.0") == 3
    assert metric("inference_batch_size_rows_bucket", b, le="16.0") == 4


class Labelled:
    """A runtime that records, per executed batch, the labels carried in feature 0 of its rows."""

    def __init__(self, runtime: OnnxRuntime, delay_s: float) -> None:
        self.runtime, self.delay_s = runtime, delay_s
        self.batches: list[list[int]] = []
        self.started = threading.Event()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.batches.append([int(v) for v in x[:, 0]])
        self.started.set()
        time.sleep(self.delay_s)
        return self.runtime.run(x)


def labelled(label: int, width: int, n: int = 1) -> np.ndarray:
    rows = np.zeros((n, width), dtype=np.float32)
    rows[:, 0] = label
    return rows


def level_count(b: DynamicBatcher, level: int, result: str) -> float:
    return metric("inference_priority_requests_total", b, priority=str(level), result=result)


async def test_higher_priority_rows_are_taken_into_the_next_batch_first(runtime, credit_entry):
    """Six bulk (level 2) requests queue, then three online (level 1): the next batch holds the
    three online rows and the oldest bulk one; bulk keeps its arrival order after them."""
    width = credit_entry.manifest.n_features
    rec = Labelled(runtime, delay_s=0.2)
    b = batcher(rec, max_batch_size=4, max_queue_delay_ms=0, priority_levels=2, default_priority_level=2)
    try:
        busy = asyncio.ensure_future(b.submit(labelled(100, width), None, 2))
        await asyncio.to_thread(rec.started.wait, 5)
        bulk = [asyncio.ensure_future(b.submit(labelled(i, width), None, 2)) for i in range(1, 7)]
        online = [asyncio.ensure_future(b.submit(labelled(i, width), None, 1)) for i in range(11, 14)]
        await asyncio.gather(busy, *bulk, *online)
    finally:
        await b.close()
    assert rec.batches == [[100], [11, 12, 13, 1], [2, 3, 4, 5], [6]]
    assert (level_count(b, 1, "queued"), level_count(b, 2, "queued")) == (3, 7)


async def test_the_default_level_takes_requests_without_a_priority_and_undefined_levels_are_refused(
    runtime, holdout_x
):
    b = batcher(runtime.run, priority_levels=3, default_priority_level=2)
    try:
        await b.submit(holdout_x[:2], None)
        await b.submit(holdout_x[:2], None, 0)
        for undefined in (4, -1):
            with pytest.raises(InvalidInput) as excinfo:
                await b.submit(holdout_x[:2], None, undefined)
            assert excinfo.value.code == "INVALID_ARGUMENT"
            assert f"priority {undefined} is not a defined level" in excinfo.value.message
    finally:
        await b.close()
    assert [level_count(b, level, "queued") for level in (1, 2, 3)] == [0, 2, 0]


async def test_a_full_bulk_level_refuses_bulk_requests_only(runtime, holdout_x):
    """Level 2 may hold 2 waiting rows, level 1 8: a third bulk row is refused at once while 8
    online rows still queue (and a ninth is refused by its own level's limit)."""
    rec = Recording(runtime, delay_s=0.3)
    b = batcher(rec, max_batch_size=16, max_queue_delay_ms=0, max_queue_rows=8, priority_levels=2,
                default_priority_level=2, priority_queue_rows=[8, 2])
    try:
        busy = asyncio.ensure_future(b.submit(holdout_x[:1], None, 2))
        await asyncio.to_thread(rec.started.wait, 5)
        bulk = [asyncio.ensure_future(b.submit(holdout_x[i:i + 1], None, 2)) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as excinfo:
            await b.submit(holdout_x[3:4], None, 2)
        assert excinfo.value.code == "RESOURCE_EXHAUSTED" and "at priority 2 (limit 2)" in excinfo.value.message
        online = [asyncio.ensure_future(b.submit(holdout_x[i:i + 2], None, 1)) for i in (4, 6, 8, 10)]
        await asyncio.sleep(0)
        assert b.queued_rows == 10
        with pytest.raises(QueueFull):
            await b.submit(holdout_x[:1], None, 1)
        await asyncio.gather(busy, *bulk, *online)
    finally:
        await b.close()
    assert rec.batches == [1, 10]  # the 8 online and 2 bulk rows waiting fit one batch of 16
    assert [level_count(b, 1, r) for r in ("queued", "rejected")] == [4, 1]
    assert [level_count(b, 2, r) for r in ("queued", "rejected")] == [3, 1]
    assert metric("inference_queue_rejected_total", b) == 2
