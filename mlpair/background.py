"""Background tasks of the serving processes (samplers, refreshers, relays): stopping one, and the
wait between a retrying task's failed attempts."""

from __future__ import annotations

import asyncio
import random


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancels ``task`` and waits until it has ended (None: nothing to stop). What the task raised
    is not raised again here: stopping a background task never fails its owner's shutdown."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def backoff_s(failures: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after ``failures`` consecutive failed attempts: full jitter,
    ``uniform(0, min(max_s, base_s · 2^failures))`` (Brooker, "Exponential Backoff And Jitter",
    AWS Architecture Blog, 2015); the exponent is capped so an outage of any length never overflows."""
    return random.uniform(0.0, min(max_s, base_s * 2 ** min(failures, 30)))
