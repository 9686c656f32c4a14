"""Concurrent Predict calls decided as one batch: the pipeline's per-call work paid once per batch.

A Predict call carries one applicant, and most of what deciding it costs PredictionService does
not depend on how many applicants a call carries: checking and assembling the rows, deciding,
the ledger commit's bookkeeping, the per-call metrics (docs/decisions/0006-merged-predicts.md).
Under load, the :class:`PredictMerger` gathers the Predict calls that arrive
while others are being decided and runs them through the pipeline together, as the items of one
batch; each caller gets its own item's outcome. On a lightly loaded server a call is decided at
once, alone, as if merging did not exist (see :class:`PredictMerger` for when calls wait).

What a caller sees does not change (tests/prediction/test_merging.py):

* **Its own deadline.** Each call's rows are scored on their own, through the cache and the
  inference coalescer, in the caller's context and with its deadline budget (``score_groups``'
  ``callers``), and only calls with deadlines close together share a batch (:class:`PredictMerger`):
  a caller with a short deadline gets its fallback in time and neither shortens nor lengthens
  another caller's budget; the spans and log lines of its scoring are its own.
* **Its own errors.** A bad item gets its own error, as in a BatchPredict.
* **One decision per request id.** Two calls with the same request id never share a batch (a
  batch refuses a repeated id): the second goes in the next batch and finds the first's
  decision on record (``replayed``), as two concurrent calls always have.
* **A caller that leaves** (it cancelled, or its deadline passed) takes its item with it: its
  scoring is cancelled (and the Infer call, once no caller waits for it) and its item is
  neither decided nor recorded, unless the batch's ledger commit had already begun — as for a
  call decided alone. A batch whose callers have all left is cancelled.

**Its own priority.** Calls share a batch only with calls of the same priority level (the caller's,
:mod:`mlpair.prediction.intake.priority`), and when several queues go out together the
higher level's go first: a Predict that asked for the bulk level never holds back, nor rides
with, the online ones.

What is shared: the batch's ledger commit, and the log lines and spans of the batch as a whole
(a merged batch runs in a context of its own, not as any one of its callers).

Tuned by ``PREDICTION_MERGE_MAX_CALLS`` (1 decides each call alone), ``PREDICTION_MERGE_MAX_DELAY_MS``
and ``PREDICTION_MERGE_WAIT_FROM_CALLS`` (``settings.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable, Sequence

from mlpair.prediction import metrics
from mlpair.prediction.intake import priority
from mlpair.prediction.outcomes import Outcome, Outcomes, PredictInput
from mlpair.prediction.scoring.coalescer import settle


class MergedCall:
    """One Predict call waiting in, or decided by, a merged batch.

    Attributes:
        request: what it asks.
        future: resolves to its outcome; cancelled when the caller leaves.
        context: the caller's context (trace span, log context): its item is scored in it.
    """

    __slots__ = ("request", "future", "context", "batch", "task")

    def __init__(self, request: PredictInput, future: asyncio.Future[Outcome], context: contextvars.Context) -> None:
        self.request = request
        self.future = future
        self.context = context
        self.batch: list[MergedCall] = []  # the calls decided together, once sent
        self.task: asyncio.Task | None = None  # the task deciding them, once sent

    @property
    def gone(self) -> bool:
        """Whether the caller left before its outcome was delivered."""
        return self.future.cancelled()


# (requests, the merged calls by position, or None for a batch of one) → each request's outcome
RunBatch = Callable[[Sequence[PredictInput], Sequence[MergedCall] | None], Awaitable[Outcomes]]


class _Queue:
    """Calls waiting to go out together: one priority level, their near deadlines within the merger's
    window of the first's (``deadline`` None: calls with no deadline or a far one)."""

    __slots__ = ("calls", "ids", "deadline", "flush", "send_by", "level")

    def __init__(self, deadline: float | None, level: int = 0) -> None:
        self.calls: list[MergedCall] = []
        self.ids: set[str] = set()
        self.deadline = deadline  # the first call's near deadline
        self.flush: asyncio.Handle | None = None
        self.send_by = 0.0  # loop time the queue goes by
        self.level = level

    def takes(self, deadline: float | None, window_s: float, level: int) -> bool:
        if level != self.level:
            return False
        if deadline is None or self.deadline is None:
            return deadline is None and self.deadline is None
        return abs(deadline - self.deadline) <= window_s


class PredictMerger:
    """Decides concurrent single-item calls as batches of at most ``max_calls`` (module docstring).

    When a batch is sent:

    * at once, in the caller's own task, while fewer than ``wait_from_calls`` calls are being
      decided and none is queued: on a lightly loaded server, where waiting would only add
      latency, a call is decided exactly as it was before merging existed;
    * otherwise as soon as a batch being decided finishes, or when the oldest queued call has
      waited ``max_delay_s``, whichever comes first (the inference coalescer's rule, one stage
      earlier): under load, batches grow with the time a batch takes;
    * at once when ``max_calls`` are queued.

    Deadlines: a batch is decided when its last item is scored. An item's scoring ends by
    ``scoring_bound_s`` (every Infer attempt and backoff at its longest) or, when its deadline is
    sooner than that, by its deadline less the budget kept back for recording (``crm_reserve_ms``).
    So calls whose deadlines are further away than ``scoring_bound_s`` (or that have none) share
    batches freely, and calls with a nearer deadline share one only with calls whose deadlines lie
    within ``deadline_window_s`` of theirs: keep the window well under the reserve
    (``build_predictor`` uses half of it), and the earliest caller still has the rest to record
    its decision in time. A call never waits for company more than a tenth of the budget its
    deadline leaves it.

    Args:
        run: runs one batch: ``run(requests, callers)`` → each request's outcome, in order;
            ``callers`` is None for a batch of one (it then runs in its caller's context).
        max_calls: most calls in one batch.
        max_delay_s: longest a call waits for company while a batch is being decided, in seconds.
        deadline_window_s: most seconds between the near deadlines of calls in one batch.
        scoring_bound_s: longest an item's scoring takes when its deadline does not cut it short.
        wait_from_calls: calls being decided from which a new call waits for company.
    """

    def __init__(
        self,
        run: RunBatch,
        max_calls: int,
        max_delay_s: float,
        deadline_window_s: float,
        scoring_bound_s: float,
        wait_from_calls: int = 4,
    ) -> None:
        self._run = run
        self.max_calls = max_calls
        self.max_delay_s = max_delay_s
        self.deadline_window_s = deadline_window_s
        self.scoring_bound_s = scoring_bound_s
        self.wait_from_calls = wait_from_calls
        self._deciding = 0  # calls in the batches being decided
        self._queues: list[_Queue] = []
        self._tasks: set[asyncio.Task] = set()  # the batches being decided

    async def decide(self, request: PredictInput) -> Outcome:
        """``request``'s outcome, decided in a batch with the calls that arrived with it.

        Raises:
            Whatever the batch's run raised as a whole (each item's own error is its outcome).
        """
        if self._deciding < self.wait_from_calls and not self._queues:
            return await self._alone(request)
        deadline, now = request.deadline, time.monotonic()
        near = deadline if deadline is not None and deadline - now <= self.scoring_bound_s + self.max_delay_s else None
        level = priority.current()
        queue = next((q for q in self._queues if q.takes(near, self.deadline_window_s, level)), None)
        if queue is not None and request.request_id in queue.ids:
            self._send(queue)  # a repeated id never shares a batch: what is queued goes first
            queue = None
        if queue is None:
            queue = _Queue(near, level)
            self._queues.append(queue)
        loop = asyncio.get_running_loop()
        call = MergedCall(request, loop.create_future(), contextvars.copy_context())
        queue.calls.append(call)
        queue.ids.add(request.request_id)
        if len(queue.calls) >= self.max_calls:
            self._send(queue)
        elif self._deciding < self.wait_from_calls:
            if queue.flush is None:
                queue.flush, queue.send_by = loop.call_soon(self._send, queue), loop.time()
        else:
            wait_s = self.max_delay_s
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - now) / 10)
            send_by = loop.time() + wait_s
            if queue.flush is None or send_by < queue.send_by:
                if queue.flush is not None:
                    queue.flush.cancel()
                queue.flush, queue.send_by = loop.call_at(send_by, self._send, queue), send_by
        try:
            return await call.future
        except asyncio.CancelledError:
            self._left(call)
            raise

    async def _alone(self, request: PredictInput) -> Outcome:
        """Decides ``request`` as a batch of one in the caller's task (cancelled with it)."""
        metrics.MERGED_CALLS.observe(1)
        self._deciding += 1
        try:
            outcomes = await self._run([request], None)
        finally:
            self._deciding -= 1
            self._send_all()
        return outcomes[0]

    async def drain(self) -> None:
        """Sends what is queued and waits for every batch being decided."""
        self._send_all()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _left(self, call: MergedCall) -> None:
        """A caller left: a batch whose callers have all left is cancelled (a live batch drops
        the leaver's item itself, see ``score_groups`` and ``Predictor._run``)."""
        if not call.future.done():
            call.future.cancel()
        if call.task is not None and all(c.gone for c in call.batch):
            call.task.cancel()

    def _send(self, queue: _Queue) -> None:
        if queue.flush is not None:
            queue.flush.cancel()
            queue.flush = None
        if queue in self._queues:
            self._queues.remove(queue)
        batch = [call for call in queue.calls if not call.future.done()]  # done: left while queued
        if not batch:
            return
        metrics.MERGED_CALLS.observe(len(batch))
        self._deciding += len(batch)
        # one caller: its batch runs as it would alone; several: in a context of none of them
        context = batch[0].context if len(batch) == 1 else contextvars.Context()
        task = asyncio.get_running_loop().create_task(self._decide(batch), context=context)
        for call in batch:
            call.batch, call.task = batch, task
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._done, batch))

    def _done(self, batch: list[MergedCall], task: asyncio.Task) -> None:
        """A batch is decided: the calls waiting for one to finish go now. Each call's links to
        its batch and task are dropped: they are reference cycles (call → batch → call, and call →
        task, whose coroutine holds the batch) that only the cyclic collector would free, with
        every caller's request, context and outcome in them (under Predict load, about a fifth of
        what each young collection scanned)."""
        self._tasks.discard(task)
        self._deciding -= len(batch)
        for call in batch:
            call.batch, call.task = [], None
        self._send_all()

    def _send_all(self) -> None:
        """Sends every queue, the highest priority level's (1) first; 0 (no call's level) last."""
        for queue in sorted(self._queues, key=lambda q: q.level or 1 << 30):
            self._send(queue)

    async def _decide(self, batch: list[MergedCall]) -> None:
        run = self._run([c.request for c in batch], batch if len(batch) > 1 else None)
        if (outcomes := await settle(run, (c.future for c in batch))) is None:
            return
        for i, call in enumerate(batch):
            if not call.future.done():  # done: the caller left
                call.future.set_result(outcomes[i])
