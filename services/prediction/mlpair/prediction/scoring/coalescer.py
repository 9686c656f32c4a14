"""Client-side micro-batching across the hop: the rows of concurrent requests share one Infer call.

Each Predict call carries one entity, so without this every request would pay a whole
InferenceService round trip of its own: a second Python gRPC hop per decision, which is where
a two-service split loses most of its throughput (design.md, "The hop budget"). The
:class:`InferenceCoalescer` sits between the cache's single-flight calls and the resilient
caller: concurrent calls for the same (model, model version, feature schema version) and priority level
wait briefly in a *lane* and go out together as one ``Infer``; the logits are scattered back in
row order. Rows of different priority levels (:mod:`mlpair.prediction.intake.priority`: the
caller's level) never share a call: each lane's calls carry their level to InferenceService, so
bulk rows never ride an online call ahead of other bulk work, nor hold an online row back.

When a lane's rows are sent:

* at once (after the current event-loop iteration, so calls made together travel together)
  when no Infer call of that lane is in flight: nothing is gained by waiting, so a lone
  request pays no delay;
* otherwise as soon as an in-flight call of the lane returns, or when the oldest queued row
  has waited ``max_delay_s``, whichever comes first: under load, batches grow with the
  round-trip time, and no row waits longer than ``max_delay_s`` for company;
* at once when the queued rows reach ``max_rows`` (keep it at most InferenceService's
  ``max_batch_size``); one call's rows are never split, and a call that does not fit next to
  the queued rows starts the next batch.

A merged call is nobody's in particular: it runs in a context of its own (no caller's span,
baggage or log context), its span links to every caller's span, and it carries no caller's
request id (:mod:`mlpair.observability.propagation`).

A merged call runs through the :class:`~mlpair.prediction.scoring.resilience.ResilientCaller` once:
the circuit breaker counts it as one call, retries repeat it whole, and its deadline is the
*latest* of its callers' deadlines (the call is of use while any of them waits). Each caller
waits only for its own budget: one whose budget runs out gets :class:`InferenceTimeout` alone
and leaves, and one whose budget is too short for an attempt when it arrives or when the batch is
sent is not included (:meth:`ResilientCaller.no_budget_error`: :class:`DeadlineTooShort`). So a
caller with a short or expired deadline can neither shorten the others' call nor make it a
timeout that counts against the breaker. A caller that goes away is dropped from a batch not
yet sent; a sent call is cancelled only when every caller in it has gone.

Tuned by ``PREDICTION_COALESCE_MAX_DELAY_MS`` (``max_delay_s``) and ``PREDICTION_INFERENCE_MAX_BATCH_ROWS``
(``max_rows``) (``settings.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from mlpair.contracts.target import ModelTarget
from mlpair.observability.calls import Caller
from mlpair.prediction import metrics
from mlpair.prediction.errors import InferenceTimeout
from mlpair.prediction.intake import priority
from mlpair.prediction.scoring.resilience import ResilientCaller

T = TypeVar("T")


async def settle(work: Awaitable[T], futures: Iterable[asyncio.Future]) -> T | None:
    """``work``'s result for the callers waiting on ``futures``; when it fails, None, and each future not
    done yet (its caller still waits) gets the exception; when it is cancelled, so is every future."""
    try:
        return await work
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise
    except Exception as exc:  # noqa: BLE001  (handed to every caller)
        for future in futures:
            if not future.done():
                future.set_exception(exc)
        return None


class Infers(Protocol):
    """What the coalescer needs of an InferenceService client (:class:`~.client.InferenceClient`)."""

    async def infer(
        self,
        target: ModelTarget,
        features: np.ndarray,
        *,
        timeout_s: float | None = None,
        callers: Sequence[Caller] | None = None,
        priority: int = 0,
    ) -> tuple[np.ndarray, str]:
        """Logits ``[batch, n_classes] float32`` for ``features`` ``[batch, n_features] float32``, and
        the model version that served them; a row the service could not score is all NaN.
        ``priority``: InferenceService's batch-queue level (1 = highest, 0 = its default).

        Raises:
            InferenceError: the call failed as a whole (timeout, unavailable, overloaded, contract
                refused, any other failure).
        """

    async def ready(self, timeout_s: float) -> bool:
        """Whether InferenceService reports SERVING within ``timeout_s`` seconds."""

    async def close(self) -> None:
        """Closes the connection to InferenceService."""


@dataclass(eq=False)
class _Part:
    """One caller's rows waiting in a lane, and the future its logits are delivered to."""

    rows: np.ndarray  # [n, n_features] float32
    deadline: float | None
    future: asyncio.Future
    caller: Caller  # whose rows these are: the merged call's span links to it
    call: _Call | None = None


@dataclass(eq=False)
class _Call:
    """One merged Infer call in flight; cancelled when none of its callers waits any more."""

    task: asyncio.Task | None = None
    waiting: int = 0


@dataclass(eq=False)
class _Lane:
    parts: list[_Part] = field(default_factory=list)
    rows: int = 0
    in_flight: int = 0
    flush: asyncio.Handle | None = None  # the scheduled send of the queued parts, if any


class InferenceCoalescer:
    """Merges concurrent Infer calls per model version into one call (see the module docstring).

    Args:
        client: an :class:`~mlpair.prediction.scoring.client.InferenceClient`.
        caller: deadline budget, retries and circuit breaker, applied to each merged call.
        max_delay_s: longest a row waits for others while a call of its lane is in flight.
        max_rows: most rows in one merged call.
    """

    def __init__(
        self, client: Infers, caller: ResilientCaller, *, max_delay_s: float = 0.002, max_rows: int = 1024
    ) -> None:
        self.client = client
        self.caller = caller
        self.max_delay_s = max(0.0, max_delay_s)
        self.max_rows = max(1, max_rows)
        self._lanes: dict[tuple[ModelTarget, int], _Lane] = {}
        self._calls: set[asyncio.Task] = set()

    async def infer(self, target: ModelTarget, rows: np.ndarray, deadline: float | None) -> tuple[np.ndarray, str]:
        """Logits for ``rows`` ``[n, n_features] float32`` from ``target``'s model, sent together
        with concurrent callers' rows for the same target at the same priority level (one lane per
        target and level; the level is the caller's, :func:`mlpair.prediction.intake.priority.current`).

        Args:
            deadline: the caller's deadline in ``time.monotonic()`` seconds, or None.

        Returns:
            Logits ``[n, n_classes] float32`` (rows in order) and the model version that served them.

        Raises:
            DeadlineTooShort: this caller's budget is too short for an attempt (its rows are not sent).
            InferenceTimeout, CircuitOpen, InferenceUnavailable, InferenceContractError,
            InferenceFailed: as :meth:`ResilientCaller.call` for the merged call.
        """
        refused = self.caller.no_budget_error(deadline, time.monotonic())
        if refused is not None:
            raise refused
        key = (target, priority.current())
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        part = _Part(rows, deadline, asyncio.get_running_loop().create_future(), Caller.current())
        part.future.add_done_callback(functools.partial(self._left, part))
        if lane.parts and lane.rows + len(rows) > self.max_rows:
            self._send(key, lane)
        lane.parts.append(part)
        lane.rows += len(rows)
        if lane.rows >= self.max_rows:
            self._send(key, lane)
        elif lane.flush is None:
            loop = asyncio.get_running_loop()
            lane.flush = (
                loop.call_soon(self._send, key, lane)
                if lane.in_flight == 0
                else loop.call_later(self.max_delay_s, self._send, key, lane)
            )
        if deadline is None:
            return await part.future
        # this caller's own budget (not capped at one attempt's: the call may retry); leaving
        # cancels its future, and the call once nobody waits
        wait_s = deadline - time.monotonic() - self.caller.budget.reserve_s
        try:
            async with asyncio.timeout(max(0.0, wait_s)):
                return await part.future
        except TimeoutError:
            raise InferenceTimeout("the inference call did not finish within this request's budget") from None

    async def close(self) -> None:
        """Cancels every merged call still in flight."""
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    def _send(self, key: tuple[ModelTarget, int], lane: _Lane) -> None:
        """Sends the lane's queued parts as one call (those still waiting, with budget left)."""
        if lane.flush is not None:
            lane.flush.cancel()
            lane.flush = None
        parts, lane.parts, lane.rows = lane.parts, [], 0
        now = time.monotonic()
        live = []
        for part in parts:
            if part.future.done():  # its caller went away while it was queued
                continue
            refused = self.caller.no_budget_error(part.deadline, now)
            if refused is not None:  # spent while queued: as if it had arrived so
                part.future.set_exception(refused)
                continue
            live.append(part)
        if not live:
            return
        call = _Call(waiting=len(live))
        for part in live:
            part.call = call
        lane.in_flight += 1
        # a context of its own: the call must not run as (or log as) whichever caller sent it
        call.task = asyncio.get_running_loop().create_task(self._call(key, lane, live), context=contextvars.Context())
        self._calls.add(call.task)
        call.task.add_done_callback(self._calls.discard)

    async def _call(self, key: tuple[ModelTarget, int], lane: _Lane, parts: list[_Part]) -> None:
        target, level = key
        model_name = target.name
        rows = parts[0].rows if len(parts) == 1 else np.concatenate([p.rows for p in parts])
        # the latest: the call is of use while any caller waits (each waits only its own budget)
        deadlines = [p.deadline for p in parts if p.deadline is not None]
        deadline = max(deadlines) if len(deadlines) == len(parts) else None  # None: a caller without one
        callers = [p.caller for p in parts]
        started = time.perf_counter()
        try:
            call = self.caller.call(
                lambda timeout: self.client.infer(target, rows, timeout_s=timeout, callers=callers, priority=level),
                deadline,
                model=model_name,
            )
            if (called := await settle(call, (p.future for p in parts))) is None:
                return
            logits, version = called
            metrics.labelled(metrics.INFERENCE_DURATION, model_name).observe(time.perf_counter() - started)
            metrics.labelled(metrics.COALESCED_CALL_ROWS, model_name).observe(len(rows))
            metrics.labelled(metrics.COALESCED_CALL_FLIGHTS, model_name).observe(len(parts))
            offset = 0
            for part in parts:
                n = len(part.rows)
                if not part.future.done():
                    part.future.set_result((logits[offset : offset + n], version))
                offset += n
        finally:
            lane.in_flight -= 1
            if lane.parts:  # rows that queued behind this call go now
                self._send(key, lane)

    @staticmethod
    def _left(part: _Part, future: asyncio.Future) -> None:
        """A part's future is done; if its caller went away from a sent call, and it was the
        last one waiting on that call, the call is cancelled."""
        if not future.cancelled():
            future.exception()  # marks it retrieved: a caller that left must not make asyncio log it
            return
        if part.call is None:
            return
        part.call.waiting -= 1
        if part.call.waiting == 0 and part.call.task is not None:
            part.call.task.cancel()
