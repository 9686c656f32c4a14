"""Server-side dynamic batching: requests' rows queue per model version and run together.

One :class:`DynamicBatcher` per loaded model version. Callers ``await submit(rows, deadline)``;
a scheduler task waits until a batch is due, takes it from the version's queue
(:class:`~mlpair.inference.batch_queue.RowQueue`, which cuts batches by the rules below) and
hands it to the runtime through the executor (one thread hop per batch, never per request),
then scatters the logits back in row order.

Batch formation (Triton's dynamic-batcher semantics, counted in rows, never requests):

* a batch holds at most ``max_batch_size`` rows; a request is never split across batches
  unless it alone exceeds ``max_batch_size`` (then :meth:`submit` splits it into
  ``max_batch_size`` chunks, each queued as its own item, and reassembles the logits);
* the scheduler runs a batch as soon as the queued rows reach ``max_batch_size`` (or the
  largest preferred batch size), otherwise when the oldest queued request has waited
  ``max_queue_delay_ms``; with preferred sizes, the batch is cut at the largest request
  boundary that is a preferred size, if any, and the rest runs next;
* with batching off, each request (or chunk) runs alone, through the same queue;
* priority levels (Triton's ``priority_levels``): each request has a level, 1 the highest to
  ``priority_levels``, 0 (absent) taking ``default_priority_level``; a batch takes the waiting
  items of higher levels first, in arrival order within a level, and lower levels only fill the
  rows left (strict priority: under a sustained higher-level load a lower level waits); an
  undefined level is refused (:class:`InvalidInput`);
* the queue is bounded per level: more than that level's limit (``priority_queue_rows``, else
  ``max_queue_rows``) of waiting rows at the request's level → :class:`QueueFull`
  (RESOURCE_EXHAUSTED) at once, before anything is queued; other levels are not affected;
* a request whose deadline passes while queued is dropped before compute
  (:class:`DeadlineExpired`, counted); a cancelled caller's rows are removed (counted) and
  never computed — also when a cancelled ``ModelStreamInfer`` stream cancels its requests;
* a runtime that raises, or returns the wrong number of rows, fails every request of that
  batch with :class:`ModelFailure` (INTERNAL) — never an empty success. Each request gets its
  own rows' logits as computed; what one row's values mean (non-finite output) is judged per
  request by the engine, so one request's bad row never reaches its batch-mates;
* each batch's outcome goes to the version's health (:mod:`mlpair.inference.model_health`): only
  the first failure of a streak is logged (with its traceback), the rest are counted; while the
  version is unhealthy, a batch without its self-test is answered :class:`ModelUnhealthy`
  (UNAVAILABLE) and never run.

Tuned by ``INFERENCE_MAX_BATCH_SIZE``, ``INFERENCE_MAX_QUEUE_DELAY_MS``, ``INFERENCE_PREFERRED_BATCH_SIZES``,
``INFERENCE_BATCHING``, ``INFERENCE_MAX_QUEUE_ROWS`` and the priority settings (``settings.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from mlpair.inference import metrics
from mlpair.inference.batch_queue import Item, RowQueue, resolve_priority
from mlpair.inference.errors import ModelFailure, ModelNotReady, ModelUnhealthy, QueueFull
from mlpair.inference.model_health import WRONG_OUTPUT
from mlpair.inference.statistics import VersionStatistics

if TYPE_CHECKING:
    from mlpair.inference.model_health import VersionHealth

logger = logging.getLogger(__name__)

QUEUE_DEPTH_SAMPLE_S = 0.5  # how often a supervisor's worker writes its queue depth (scrapes are 15-30 s apart)


class DynamicBatcher:
    """Queues rows for one model version and runs them in batches on its runtime.

    Args:
        run: the runtime's blocking ``[batch, n_features] float32 → [batch, n_classes] float32``.
        model, version: metric labels.
        max_batch_size: most rows per execution.
        max_queue_delay_ms: longest wait for batch-mates, from the oldest request's arrival.
        preferred_batch_sizes: row counts to cut batches at when possible (may be empty).
        max_queue_rows: waiting rows of one priority level beyond which :meth:`submit` refuses with QueueFull.
        priority_levels, default_priority_level: levels 1 (highest) … ``priority_levels``, and the level
            of a request that names none.
        priority_queue_rows: per level (index 0 = level 1), its own ``max_queue_rows``; a level beyond
            the list's end takes ``max_queue_rows``.
        batching: False runs every request (chunk) alone.
        instances: executions that may run at once (threads of the executor).
        inline: run batches on the event-loop thread instead of the executor; for models whose
            largest batch takes less time than a thread hop (one instance only).
        health: the version's health after start, told every batch's outcome (None: not tracked).
    """

    def __init__(
        self,
        run: Callable[[np.ndarray], np.ndarray],
        *,
        model: str,
        version: str,
        max_batch_size: int,
        max_queue_delay_ms: float,
        preferred_batch_sizes: list[int],
        max_queue_rows: int,
        priority_levels: int = 1,
        default_priority_level: int = 1,
        priority_queue_rows: list[int] | None = None,
        batching: bool = True,
        instances: int = 1,
        inline: bool = False,
        health: VersionHealth | None = None,
    ) -> None:
        self._run = run
        self._health = health
        self._self_tests: set[asyncio.Future] = set()  # futures of self-test items now queued or running
        self.model, self.version = model, version
        self.max_batch_size = max_batch_size
        self._delay_s = max_queue_delay_ms / 1000.0 if batching else 0.0
        self._flush_rows = max(preferred_batch_sizes) if batching and preferred_batch_sizes else max_batch_size
        self.priority_levels, self.default_priority_level = priority_levels, default_priority_level
        own = list(priority_queue_rows or ())[:priority_levels]
        self._limits = [0, *own, *[max_queue_rows] * (priority_levels - len(own))]  # index = level
        self._inline = inline and instances == 1
        self._wakeup: asyncio.Future | None = None
        self._wake_rows = 1
        self._closing = False
        self._slots = asyncio.Semaphore(instances)
        self._executor = ThreadPoolExecutor(max_workers=instances, thread_name_prefix=f"run-{model}-{version}")
        self._running: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        # Metric children resolved once: label lookups are not free on the hot path.
        # Queue depth is read at scrape time, so the hot path pays nothing for it; a supervisor's
        # worker is scraped from another process, which cannot call back into this one: there a task
        # writes the depth every QUEUE_DEPTH_SAMPLE_S instead (start()).
        self._depth = metrics.QUEUE_DEPTH.labels(model, version)
        self._sampler: asyncio.Task | None = None
        if not metrics.shared_across_processes():
            self._depth.set_function(lambda: self._queue.rows)
        self._m_queue = metrics.QUEUE_DURATION.labels(model, version)
        self._m_compute = metrics.COMPUTE_DURATION.labels(model, version)
        self._m_batch = metrics.BATCH_SIZE.labels(model, version)
        self._queue = RowQueue(
            max_batch_size=max_batch_size,
            levels=priority_levels,
            preferred_batch_sizes=frozenset(preferred_batch_sizes) if batching else frozenset(),
            batching=batching,
            expired=metrics.QUEUE_DROPPED.labels(model, version, "expired"),
            cancelled=metrics.QUEUE_DROPPED.labels(model, version, "cancelled"),
        )
        self._m_rejected = metrics.QUEUE_REJECTED.labels(model, version)
        self._m_levels = {
            level: {r: metrics.PRIORITY_REQUESTS.labels(model, version, str(level), r) for r in ("queued", "rejected")}
            for level in range(1, priority_levels + 1)
        }
        self.statistics = VersionStatistics()
        """This version's OIP statistics, recorded beside the metrics above (same values)."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the scheduler task on the running event loop."""
        name = f"batcher-{self.model}-{self.version}"
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name=name)
        if metrics.shared_across_processes():
            self._sampler = asyncio.get_running_loop().create_task(self._sample_depth(), name=f"depth-{name}")

    async def _sample_depth(self) -> None:
        while True:
            self._depth.set(self._queue.rows)
            await asyncio.sleep(QUEUE_DEPTH_SAMPLE_S)

    async def close(self) -> None:
        """Runs everything already queued (without waiting out the delay), then stops."""
        self._closing = True
        self._wake()
        if self._task is not None:
            await self._task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self._sampler is not None:
            self._sampler.cancel()
            self._depth.set(0)  # multiprocess mode cannot remove a series
        else:
            metrics.QUEUE_DEPTH.remove(self.model, self.version)  # drop the scrape-time callback with us

    @property
    def executes_inline(self) -> bool:
        """Whether batches run on the event-loop thread rather than in the executor."""
        return self._inline

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch (not counting those executing)."""
        return self._queue.rows

    # -- callers ---------------------------------------------------------------------------

    async def submit(self, rows: np.ndarray, deadline: float | None, priority: int = 0) -> np.ndarray:
        """Logits ``[n, n_classes] float32`` for ``rows`` ``[n, n_features] float32``, in row order.

        Args:
            rows: at least one row.
            deadline: ``time.monotonic()`` instant after which the caller no longer waits.
            priority: level 1 (highest) … ``priority_levels``; 0 = ``default_priority_level``.

        Raises:
            InvalidInput: ``priority`` is not a defined level.
            QueueFull: the request's level already holds its limit of waiting rows.
            DeadlineExpired: the deadline passed before the rows were computed.
            ModelFailure: the runtime failed for the whole batch (raised, or the wrong row count).
            ModelNotReady: this version is being unloaded.
        """
        if self._closing:
            raise ModelNotReady(f"model {self.model!r} version {self.version} is being unloaded; retry")
        level = resolve_priority(priority, self.priority_levels, self.default_priority_level)
        n = rows.shape[0]
        if self._queue.level_rows[level] + n > self._limits[level]:
            self._m_rejected.inc()
            self._m_levels[level]["rejected"].inc()
            raise QueueFull(
                f"model {self.model!r} version {self.version} has {self._queue.level_rows[level]} rows queued "
                f"at priority {level} (limit {self._limits[level]}); retry with backoff"
            )
        self._m_levels[level]["queued"].inc()
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if n <= self.max_batch_size:
            item = Item(rows, loop.create_future(), deadline, now, level)
            self._enqueue(item)
            try:
                return await item.future
            except asyncio.CancelledError:
                self._queue.discard(item)
                raise
        items = [
            Item(rows[i : i + self.max_batch_size], loop.create_future(), deadline, now, level)
            for i in range(0, n, self.max_batch_size)
        ]
        for item in items:
            self._enqueue(item)
        try:
            parts = [await item.future for item in items]
        except BaseException:
            for item in items:  # one chunk failed or the caller left: the others are not wanted
                self._queue.discard(item)
                if not item.future.done():
                    item.future.cancel()
                elif not item.future.cancelled():
                    item.future.exception()  # retrieved: no "never retrieved" warning
            raise
        return np.concatenate(parts)

    async def submit_self_test(self, rows: np.ndarray) -> np.ndarray:
        """As :meth:`submit` (no deadline, the highest priority level), for the version's known-answer
        self-test: its batch runs even while the version is unhealthy.

        Raises:
            QueueFull, ModelFailure, ModelNotReady: as :meth:`submit`.
        """
        if self._closing:
            raise ModelNotReady(f"model {self.model!r} version {self.version} is being unloaded; retry")
        if self._queue.level_rows[1] + rows.shape[0] > self._limits[1]:
            raise QueueFull(f"model {self.model!r} version {self.version}: queue full")
        item = Item(rows, asyncio.get_running_loop().create_future(), None, time.monotonic())
        self._self_tests.add(item.future)
        try:
            self._enqueue(item)
            return await item.future
        except asyncio.CancelledError:
            self._queue.discard(item)
            raise
        finally:
            self._self_tests.discard(item.future)

    def _enqueue(self, item: Item) -> None:
        self._queue.push(item)
        if self._queue.rows >= self._wake_rows:
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    # -- scheduler -------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            held = False  # whether this loop still owns an execution slot
            try:
                await self._slots.acquire()
                held = True
                batch = await self._next_batch()
                if batch is None:
                    self._slots.release()
                    return
                if not batch:
                    self._slots.release()
                    continue
                held = False  # _execute releases the slot, whatever happens
                if self._inline:
                    await self._execute(batch)  # runs to completion without suspending
                    continue
                task = asyncio.get_running_loop().create_task(self._execute(batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            except Exception:  # the scheduler must outlive any single bad batch
                logger.exception("batch scheduler error for %s version %s", self.model, self.version)
                if held:
                    self._slots.release()

    async def _next_batch(self) -> list[Item] | None:
        """Waits until a batch is due and takes it; None once closing with nothing queued."""
        while self._queue.rows == 0:
            self._queue.prune()
            if self._closing:
                return None
            await self._wait(1, None)
        if self._delay_s > 0 and self._queue.rows < self._flush_rows and not self._closing:
            oldest = self._queue.oldest_arrival()
            if oldest is not None:
                until = oldest + self._delay_s
                if time.monotonic() < until:
                    await self._wait(self._flush_rows, until)
        return self._queue.take()

    async def _wait(self, rows: int, until: float | None) -> None:
        """Sleeps until ``rows`` rows are queued, ``until`` (monotonic) passes, or close()."""
        loop = asyncio.get_running_loop()
        self._wakeup = loop.create_future()
        self._wake_rows = rows
        timer = loop.call_later(until - time.monotonic(), self._wake) if until is not None else None
        try:
            await self._wakeup
        finally:
            self._wakeup = None
            self._wake_rows = 1 << 62  # nobody is waiting: enqueue need not wake anyone
            if timer is not None:
                timer.cancel()

    async def _execute(self, batch: list[Item]) -> None:
        """Runs one batch on the executor and scatters its logits, releasing the slot."""
        stats = self.statistics
        health = self._health
        try:
            if health is not None and not health.healthy and not any(i.future in self._self_tests for i in batch):
                self._fail(batch, "", ModelUnhealthy)
                return
            now = time.monotonic()
            for item in batch:
                waited = now - item.enqueued
                self._m_queue.observe(waited)
                stats.queue.add(waited)
            began = time.perf_counter()
            x = batch[0].rows if len(batch) == 1 else np.concatenate([item.rows for item in batch])
            rows = x.shape[0]
            self._m_batch.observe(rows)
            started = time.perf_counter()
            try:
                if self._inline:
                    logits = self._run(x)
                else:
                    logits = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, x)
            except Exception as exc:
                if health is None or health.batch_failed(exc):
                    logger.exception("runtime failed for %s version %s on %d rows", self.model, self.version, rows)
                self._fail(batch, "the model failed to run")
                return
            finally:
                ended = time.perf_counter()
                self._m_compute.observe(ended - started)
                stats.executed(len(batch), rows, started - began, ended - started)
            if not isinstance(logits, np.ndarray) or logits.ndim != 2 or logits.shape[0] != rows:
                if health is None or health.batch_failed(None, WRONG_OUTPUT):  # the first of a streak is logged
                    logger.error(
                        "%s version %s returned %s for %d rows",
                        self.model,
                        self.version,
                        getattr(logits, "shape", type(logits).__name__),
                        rows,
                    )
                self._fail(batch, "the model returned the wrong number of rows")
                return
            if health is not None:
                health.batch_succeeded()
            self._scatter(batch, logits)
            stats.handed_back(len(batch), rows, time.perf_counter() - ended)
        finally:
            self._slots.release()

    @staticmethod
    def _scatter(batch: list[Item], logits: np.ndarray) -> None:
        offset = 0
        for item in batch:
            if not item.future.done():  # else the caller gave up while its rows ran
                item.future.set_result(logits[offset : offset + item.n])
            offset += item.n

    def _fail(self, batch: list[Item], message: str, error: type[ModelFailure | ModelUnhealthy] = ModelFailure) -> None:
        """Fails every waiting caller of a batch with its own ``error``: ModelFailure (INTERNAL), or
        ModelUnhealthy (UNAVAILABLE) for a batch not run because the version is unhealthy."""
        if error is ModelUnhealthy:
            message = f"model {self.model!r} version {self.version} is not healthy; retry on another replica"
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error(message))
