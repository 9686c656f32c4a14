"""Inline execution: a model faster than a thread hop runs its batches on the event loop.

The repository decides per version from the warm-up (the fastest of three ``max_batch_size``
batches against ``inline_execution_max_ms``); the batcher's contract is the same either way:
rows in order and independent of batch-mates, a failed batch fails its own callers only and
the next batch still runs.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mlpair.inference.batcher import DynamicBatcher
from mlpair.inference.errors import ModelFailure
from mlpair.inference.runtimes.onnx import OnnxRuntime
from tests.inference.helpers import MODEL, make_settings, running
from tests.support.inference import slow


@pytest.mark.parametrize("overrides, factory, inline", [
    ({}, None, True),  # the real credit-risk MLP: a 128-row batch takes tens of microseconds
    ({"inline_execution_max_ms": 0}, None, False),
    ({"execution_instances": 2}, None, False),
    ({}, slow(run_s=0.002), False),  # 2 ms per batch: the executor keeps the event loop free
])
async def test_the_repository_runs_fast_models_inline_and_slow_ones_in_the_executor(model_repository, overrides,
                                                                                   factory, inline):
    async with running(make_settings(model_repository, models=[MODEL], **overrides), factory) as server:
        served = server.engine.model(MODEL)
        assert served.batcher.executes_inline is inline


async def test_inline_batches_keep_rows_in_order_and_independent(credit_entry, holdout_x):
    runtime = OnnxRuntime(credit_entry.model_path, provider="cpu")
    b = DynamicBatcher(runtime.run, model=MODEL, version="inline-order", max_batch_size=16, max_queue_delay_ms=5,
                       preferred_batch_sizes=[], max_queue_rows=1000, inline=True)
    b.start()
    try:
        sizes = [1, 3, 2, 7, 1, 16, 20, 5] * 3  # 20 rows are split into chunks of 16
        offsets = np.cumsum([0, *sizes])
        results = await asyncio.gather(*(b.submit(holdout_x[o:o + n], None) for o, n in zip(offsets, sizes)))
    finally:
        await b.close()
    for o, n, logits in zip(offsets, sizes, results):
        np.testing.assert_allclose(logits, runtime.run(holdout_x[o:o + n]), atol=1e-5)


async def test_an_inline_batch_that_fails_fails_its_callers_and_the_next_batch_runs(credit_entry, holdout_x):
    runtime = OnnxRuntime(credit_entry.model_path, provider="cpu")
    calls = 0

    def flaky(x: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the model broke once")
        return runtime.run(x)

    b = DynamicBatcher(flaky, model=MODEL, version="inline-fail", max_batch_size=16, max_queue_delay_ms=5,
                       preferred_batch_sizes=[], max_queue_rows=1000, inline=True)
    b.start()
    try:
        first = await asyncio.gather(*(b.submit(holdout_x[i:i + 1], None) for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, ModelFailure) for r in first)
        again = await asyncio.gather(*(b.submit(holdout_x[i:i + 1], None) for i in range(4)))
    finally:
        await b.close()
    np.testing.assert_allclose(np.concatenate(again), runtime.run(holdout_x[:4]), atol=1e-5)
