"""One model version's queue of requests' rows, and how a batch is cut from it.

The queue half of :mod:`mlpair.inference.batcher` (which runs the batches): items in arrival
order within each priority level, counted in rows; :meth:`RowQueue.take` forms the next batch by
the rules in the batcher's module docstring — the highest priority level's items first (level 1
is the highest), lower levels only fill the rows left, at most ``max_batch_size`` rows, a request
never split (the batcher chunks one larger than that before queueing), the batch cut back to a
preferred size at a request boundary when one is reachable, callers that left or whose deadline
passed dropped and counted. Single-threaded: every method runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np
from prometheus_client import Counter

from mlpair.inference.errors import DeadlineExpired, InvalidInput

QUEUED, TAKEN, DROPPED = 0, 1, 2
"""An item's state: waiting, in a batch, or given up by its caller (left in the deque, skipped)."""


class Item:
    """One queued request (or chunk): its rows ``[n, n_features] float32``, the caller's future
    (logits ``[n, n_classes]``), its deadline and arrival (``time.monotonic()`` seconds) and its
    priority level (1 = highest)."""

    __slots__ = ("rows", "n", "future", "deadline", "enqueued", "state", "level")

    def __init__(
        self, rows: np.ndarray, future: asyncio.Future, deadline: float | None, now: float, level: int = 1
    ) -> None:
        self.rows = rows
        self.n = rows.shape[0]
        self.future = future
        self.deadline = deadline
        self.enqueued = now
        self.state = QUEUED
        self.level = level


def resolve_priority(priority: int, levels: int, default_level: int) -> int:
    """The priority level a request asked for: ``priority`` 1..``levels`` (1 = highest) as it is,
    0 (absent) = ``default_level``.

    Raises:
        InvalidInput: ``priority`` is negative or above ``levels`` (an undefined level).
    """
    if priority == 0:
        return default_level
    if not 1 <= priority <= levels:
        raise InvalidInput(
            f"priority {priority} is not a defined level: this server has levels 1 (highest) to {levels}, "
            "0 = the default",
            metadata={"priority": str(priority)[:24], "priority_levels": str(levels)},
        )
    return priority


class RowQueue:
    """The waiting items of one model version, one deque per priority level, and the batches cut from them.

    Args:
        max_batch_size: most rows in one batch.
        levels: priority levels (1 = highest … ``levels``); a batch takes higher levels' items first.
        preferred_batch_sizes: row counts to cut a batch at when possible (empty: none).
        batching: False takes one item per batch.
        expired, cancelled: counters of items dropped for a passed deadline or a caller that left.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        levels: int = 1,
        preferred_batch_sizes: frozenset[int],
        batching: bool,
        expired: Counter,
        cancelled: Counter,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.rows = 0
        """Rows waiting (not counting those taken into a batch)."""
        self.level_rows = [0] * (levels + 1)
        """Rows waiting per priority level (index 0 unused)."""
        self._levels: list[deque[Item]] = [deque() for _ in range(levels + 1)]  # index 0 unused
        self._preferred = preferred_batch_sizes
        self._batching = batching
        self._expired = expired
        self._cancelled = cancelled

    def push(self, item: Item) -> None:
        """Queues ``item`` last in its priority level."""
        self._levels[item.level].append(item)
        self.rows += item.n
        self.level_rows[item.level] += item.n

    def discard(self, item: Item) -> None:
        """Removes a caller that gave up (cancelled or past its deadline) from the queue, counted."""
        if item.state != QUEUED:
            return
        item.state = DROPPED
        self.rows -= item.n
        self.level_rows[item.level] -= item.n
        expired = item.deadline is not None and time.monotonic() >= item.deadline
        (self._expired if expired else self._cancelled).inc()

    def oldest_arrival(self) -> float | None:
        """``time.monotonic()`` arrival of the oldest live item, any level; None when none waits."""
        self.prune()
        return min((items[0].enqueued for items in self._levels if items), default=None)

    def prune(self) -> None:
        """Forgets the given-up items at the front of each level (they hold their rows' memory until then)."""
        for items in self._levels:
            while items and items[0].state == DROPPED:
                items.popleft()

    def take(self) -> list[Item]:
        """Pops the next batch: live items up to max_batch_size rows (one item if not batching),
        level 1's in arrival order first, then each lower level's while rows are left; a level's
        item that does not fit ends the batch (no lower level's item overtakes it).

        Items whose deadline has passed are failed with DeadlineExpired and counted; cancelled
        ones are skipped.
        """
        now = time.monotonic()
        batch: list[Item] = []
        rows = 0
        full = False
        for queue in self._levels:
            while queue:
                item = queue[0]
                if item.state == DROPPED:
                    queue.popleft()
                    continue
                if item.future.done():  # cancelled; its caller has not run discard yet
                    queue.popleft()
                    self.discard(item)
                    continue
                if item.deadline is not None and item.deadline <= now:
                    queue.popleft()
                    self.discard(item)
                    item.future.set_exception(DeadlineExpired("the deadline passed while the request was queued"))
                    continue
                if batch and (rows + item.n > self.max_batch_size or not self._batching):
                    full = True
                    break
                queue.popleft()
                item.state = TAKEN
                batch.append(item)
                rows += item.n
                self.level_rows[item.level] -= item.n
            if full:
                break
        if self._preferred and len(batch) > 1 and rows not in self._preferred:
            batch = self._cut_at_preferred(batch)
            rows = sum(item.n for item in batch)
        self.rows -= rows
        return batch

    def _cut_at_preferred(self, batch: list[Item]) -> list[Item]:
        """The longest prefix whose row count is a preferred size; the rest goes back in front."""
        total, cut = 0, 0
        for i, item in enumerate(batch):
            total += item.n
            if total in self._preferred:
                cut = i + 1
        if cut == 0:
            return batch
        for item in reversed(batch[cut:]):
            item.state = QUEUED
            self._levels[item.level].appendleft(item)
            self.level_rows[item.level] += item.n
        return batch[:cut]
