"""Background tasks of the serving processes (samplers, refreshers, relays): stopping one."""

from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancels ``task`` and waits until it has ended (None: nothing to stop). What the task raised
    is not raised again here: stopping a background task never fails its owner's shutdown."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
