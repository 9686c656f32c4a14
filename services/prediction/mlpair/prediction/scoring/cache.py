"""Caching inference results, with single-flight and a stale fallback.

What is cached is what InferenceService returns for one guarded feature row: its logits
``[n_classes] float32`` and the model version that served them. Calibration and the decision
policy run again on every request, so a policy change applies at once.

* **Key** = model name, pinned model version, feature schema version and a hash of the guarded
  float32 feature row (the first 128 bits of its SHA-256, :func:`cache_key`): a model or schema
  switch can never serve the old model's entries, fresh or stale.
* **Windows.** An entry younger than ``fresh_ttl_s`` is served without calling inference
  (``from_cache``). Older entries, up to ``stale_ttl_s``, are used only when inference is
  unavailable, times out or its circuit is open: they are served with ``stale``, their age and
  the reason. Past the stale window there is nothing to serve and the caller applies the
  documented fallback (a REVIEW decision, see ``pipeline``).
* **Single-flight** (C36): concurrent misses for one key in this process share one Infer call.
  The call is cancelled only when every request waiting on it has gone (C22). It runs within
  its first request's budget; a request that joined it and still has budget left when it times
  out on that shorter budget makes one call of its own, so a caller with a tight deadline can
  turn no other caller's identical request into a fallback. A finished call
  stays joinable for a short linger (``linger_s``, at most 1 s): a request whose cache read was
  sent before the result was cached (a Redis reply in flight) still gets it without a second call.
* **Coalescing** (:mod:`~mlpair.prediction.scoring.coalescer`): the Infer calls of concurrent requests'
  flights go out together as one call per model version, so many Predict calls cost about
  one round trip to InferenceService.
* **Backends** (:mod:`~mlpair.prediction.scoring.backends`). :class:`MemoryCache` (in-process LRU,
  the default), :class:`RedisCache` (:mod:`~mlpair.prediction.scoring.redis_backend`: shared by
  replicas through ``redis.asyncio``; any Redis
  error or timeout counts as a miss, never as a failed request) and :class:`NullCache`.
  Single-flight is per process in every case.
* **Validated reads.** Every entry read, from any backend, is checked like untrusted input
  (:func:`~mlpair.prediction.scoring.backends.fit_to_serve`): the key it was written for, the model
  version, ``[n_classes]`` finite logits, its size and age. One that does not fit is a miss,
  counted, never served (not even stale), never an error. Rows without usable model output are
  never written.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from mlpair.contracts.target import ModelTarget
from mlpair.prediction import metrics
from mlpair.prediction.errors import DeadlineTooShort, InferenceTimeout, InferenceUnavailable
from mlpair.prediction.scoring.backends import CachedLogits, LogitsCache, MemoryCache, NullCache, fit_to_serve
from mlpair.prediction.scoring.coalescer import InferenceCoalescer
from mlpair.prediction.scoring.keys import cache_key, cache_keys
from mlpair.prediction.scoring.redis_backend import RedisCache
from mlpair.prediction.scoring.rows import Scored, ScoredRows, Source

__all__ = [
    "CachedInference",
    "CachedLogits",
    "LogitsCache",
    "MemoryCache",
    "NullCache",
    "RedisCache",
    "Scored",
    "ScoredRows",
    "Source",
    "cache_key",
    "cache_keys",
]

logger = logging.getLogger(__name__)


class _Answer:
    """A flight's Infer result: logits ``[len(keys), n_classes] float32`` in its keys' order."""

    __slots__ = ("logits", "version", "keys", "_row_of")

    def __init__(self, logits: np.ndarray, version: str, keys: list[str]) -> None:
        self.logits, self.version, self.keys = logits, version, keys
        self._row_of: dict[str, int] | None = None

    @property
    def row_of(self) -> dict[str, int]:
        """Key → its row of ``logits``; made on first use (a call whose rows are all its own,
        in order, never needs it)."""
        if self._row_of is None:
            self._row_of = {key: i for i, key in enumerate(self.keys)}
        return self._row_of


class _Flight:
    """One Infer call that several requests wait on; cancelled when the last of them leaves."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.outcome: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        self.outcome.add_done_callback(_consume_exception)
        self.task: asyncio.Task | None = None
        self.waiters = 0


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: a flight nobody waits on any more must not log


class CachedInference:
    """Inference behind the cache and single-flight; misses go to the injected coalescer, which
    sends them through the resilient caller to the client (wired by :mod:`.factory`).

    Args:
        coalescer: merges concurrent Infer calls (:class:`~.coalescer.InferenceCoalescer`); its
            resilient caller's deadline budget also bounds how long a request waits on a shared call.
        cache: a :class:`LogitsCache` backend.
        fresh_ttl_s: entries younger than this are served without calling inference.
        linger_s: how long a successful call stays joinable after its result is cached
            (capped at ``fresh_ttl_s``); covers cache reads that were already in flight.
    """

    def __init__(
        self,
        coalescer: InferenceCoalescer,
        cache: LogitsCache,
        *,
        fresh_ttl_s: float,
        linger_s: float = 1.0,
    ) -> None:
        self.coalescer = coalescer
        self.client = coalescer.client
        self.caller = coalescer.caller
        self.cache = cache
        self.fresh_ttl_s = fresh_ttl_s
        self.linger_s = min(linger_s, fresh_ttl_s)
        self._flights: dict[str, _Flight] = {}

    async def close(self) -> None:
        """Cancels the inference calls still in flight or lingering for late joiners, then closes the
        coalescer (cancelling its merged calls) and the cache backend; the InferenceService client
        is not closed here (the composition root owns it)."""
        for flight in list(self._flights.values()):
            if flight.task is not None:
                flight.task.cancel()
        await self.coalescer.close()
        await self.cache.close()

    async def score(
        self,
        target: ModelTarget,
        rows: np.ndarray,
        deadline: float | None,
        *,
        n_classes: int | None = None,
    ) -> ScoredRows:
        """Logits for each row of ``rows`` ``[batch, n_features] float32``, in order.

        Args:
            deadline: the caller's deadline in ``time.monotonic()`` seconds, or None.
            n_classes: the model's number of classes; a cached entry of another width is a miss.

        Returns:
            The rows' logits ``[batch, n_classes] float32`` as one matrix and how each was served;
            rows inference could not score are STALE_CACHE when a stale entry exists, else FALLBACK
            (a NaN row). Without ``n_classes`` the width is that of the logits received.

        Raises:
            InferenceContractError, InferenceFailed: InferenceService refused or failed the call
                (no decision may be made on these rows).
        """
        model_name, model_version = target.name, target.version
        keys = cache_keys(target, rows)
        unique = list(dict.fromkeys(keys))
        entries = await self.cache.get_many(unique)
        joined = list(map(self._flights.get, unique))  # each key's call in flight, if any
        cached = dict(zip(unique, entries, strict=True))
        results: dict[str, Scored] = {}  # rows served from the cache, stale, or by the fallback
        inferred: dict[str, _Answer] = {}  # rows inference answered: their call's matrix
        flights: dict[int, tuple[_Flight, list[str], bool]] = {}  # id → (flight, its keys here, led by us)
        leading: list[str] = []
        hits = coalesced = 0
        if entries.count(None) == joined.count(None) == len(unique):  # all misses, none in flight: no row to look at
            leading = unique
        else:
            for key, entry, flight in zip(unique, entries, joined):
                if entry is not None and not fit_to_serve(
                    self.cache.name, entry, model_version, n_classes, self.cache.stale_ttl_s
                ):
                    entry = cached[key] = None  # a miss: never served, not even stale
                if entry is not None and entry.age_s < self.fresh_ttl_s:
                    results[key] = Scored(entry.logits, entry.model_version, Source.CACHE, int(entry.age_s * 1000))
                    hits += 1
                elif flight is not None:
                    flights.setdefault(id(flight), (flight, [], False))[1].append(key)
                    coalesced += 1
                else:
                    leading.append(key)
        for result, n in (("hit", hits), ("coalesced", coalesced), ("miss", len(leading))):
            if n:  # counted once per call, not per row
                metrics.labelled(metrics.CACHE_REQUESTS, model_name, result).inc(n)

        def lead(lead_keys: list[str]) -> _Flight:
            if lead_keys == keys:  # every row distinct and led here: the matrix as it is
                lead_rows = rows
            else:
                first_row = {key: i for i, key in reversed(list(enumerate(keys)))}
                lead_rows = rows[[first_row[key] for key in lead_keys]]
            return self._start_flight(lead_keys, functools.partial(self.coalescer.infer, target, lead_rows, deadline))

        if leading:
            flight = lead(leading)
            flights[id(flight)] = (flight, leading, True)
        again: list[str] = []
        for flight, flight_keys, led in flights.values():
            if not await self._settle(flight, flight_keys, led, deadline, model_name, cached, results, inferred):
                again += flight_keys
        if again:  # a joined call ran out of its leader's budget, not ours: one call of our own
            await self._settle(lead(again), again, True, deadline, model_name, cached, results, inferred)
        return _scored_rows(keys, results, inferred, n_classes)

    async def score_uncached(
        self, target: ModelTarget, rows: np.ndarray, deadline: float | None, *, n_classes: int | None = None
    ) -> ScoredRows:
        """:meth:`score` for rows neither looked up in nor written to the cache: a bulk chunk's
        rows (PredictColumns), each read once, would only evict online callers' entries. One call
        through the coalescer, with its retries, deadline budget and circuit breaker; no stale
        entry and no fallback: a row inference cannot score now is not decided.

        Raises:
            InferenceUnavailable: InferenceService could not answer (down, timed out, circuit open).
            DeadlineTooShort, InferenceContractError, InferenceFailed: as :meth:`score`.
        """
        logits, version = await self.coalescer.infer(target, rows, deadline)
        n = len(rows)
        width = logits.shape[1] if n_classes is None else n_classes
        if logits.shape != (n, width):  # a row of another width has no usable output
            logits = np.full((n, width), np.nan, dtype=np.float32)
        return ScoredRows(np.array(logits, dtype=np.float32), [Source.INFERENCE] * n, [version] * n, [0] * n, [""] * n)

    async def _settle(
        self,
        flight: _Flight,
        flight_keys: list[str],
        led: bool,
        deadline: float | None,
        model_name: str,
        cached: dict[str, CachedLogits | None],
        results: dict[str, Scored],
        inferred: dict[str, _Answer],
    ) -> bool:
        """Waits for a flight and fills ``inferred`` for its keys, or ``results`` (stale or
        fallback) when inference could not be used; False, filling nothing, when this request joined another's
        call that timed out on that request's shorter budget while this one still has budget left."""
        try:
            answer = await self._wait(flight, deadline, leader=led)
        except (InferenceUnavailable, DeadlineTooShort) as exc:
            budget = self.caller.budget
            if (
                isinstance(exc, (InferenceTimeout, DeadlineTooShort))  # the leader's budget, not ours
                and not led
                and budget.call_timeout_s(deadline, time.monotonic()) >= budget.min_attempt_s
            ):
                return False
            if isinstance(exc, DeadlineTooShort):
                raise
            for key in flight_keys:
                results[key] = self._degraded(model_name, cached[key], exc.reason)
        else:
            inferred.update(dict.fromkeys(flight_keys, answer))
        return True

    def _start_flight(self, keys: list[str], infer: Callable[[], Awaitable[tuple[np.ndarray, str]]]) -> _Flight:
        flight = _Flight(keys)
        self._flights.update(dict.fromkeys(keys, flight))
        flight.task = asyncio.get_running_loop().create_task(self._fly(flight, infer))
        return flight

    async def _fly(self, flight: _Flight, infer: Callable[[], Awaitable[tuple[np.ndarray, str]]]) -> None:
        """Runs the Infer call, publishes the outcome, then caches it; the flight stays
        registered until the cache holds the result, so no later request can miss in between."""
        try:
            logits, version = await infer()
        except asyncio.CancelledError:
            flight.outcome.cancel()
            self._unregister(flight)
            raise
        except BaseException as exc:  # noqa: BLE001  (re-raised to every waiter of the flight)
            flight.outcome.set_exception(exc)
            self._unregister(flight)
            return
        flight.outcome.set_result(_Answer(logits, version, flight.keys))
        finite = np.isfinite(logits).all(axis=1).tolist()
        try:  # a row without usable output (NaN, see InferenceClient) is never cached
            await self.cache.put_many(
                [(key, row.copy(), version) for key, row, ok in zip(flight.keys, logits, finite) if ok]
            )
        finally:
            asyncio.get_running_loop().call_later(self.linger_s, self._unregister, flight)

    def _unregister(self, flight: _Flight) -> None:
        flights = self._flights
        for key in flight.keys:
            if flights.get(key) is flight:
                del flights[key]

    async def _wait(self, flight: _Flight, deadline: float | None, *, leader: bool) -> _Answer:
        """The flight's outcome. The leader's call is bounded by its own budget; a request that
        joined another's call waits at most its own remaining budget."""
        flight.waiters += 1
        try:
            if leader or deadline is None:
                return await asyncio.shield(flight.outcome)
            timeout = self.caller.budget.call_timeout_s(deadline, now := time.monotonic())
            if timeout <= 0:  # too short to wait: the caller's deadline (or the open circuit's fallback)
                raise self.caller.no_budget_error(deadline, now) or InferenceTimeout("no budget left to wait")
            try:
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancellation (gh-86296)
                    return await asyncio.shield(flight.outcome)
            except TimeoutError:
                raise InferenceTimeout(
                    "the shared inference call did not finish within this request's budget"
                ) from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if flight.outcome.cancelled() and not (current and current.cancelling()):
                # the call was cancelled under us (shutdown), not this request: treat as a timeout
                raise InferenceTimeout("the shared inference call was abandoned") from None
            raise
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.outcome.done() and flight.task is not None:
                flight.task.cancel()

    @staticmethod
    def _degraded(model_name: str, entry: CachedLogits | None, reason: str) -> Scored:
        if entry is None:
            return Scored(None, "", Source.FALLBACK, 0, reason)
        metrics.STALE_SERVED.labels(model_name, reason).inc()
        return Scored(entry.logits, entry.model_version, Source.STALE_CACHE, int(entry.age_s * 1000), reason)


def _scored_rows(
    keys: list[str], results: dict[str, Scored], inferred: dict[str, _Answer], n_classes: int | None
) -> ScoredRows:
    """The rows of ``keys`` in order: each Infer call's logits copied into the matrix as one block,
    cached and stale entries row by row (a cache entry is one row), NaN where nothing fits."""
    width = n_classes
    if width is None:  # the width of what was received: a call's logits, else a cached entry's
        answer = next(iter(inferred.values()), None)
        found = next((s.logits for s in results.values() if s.logits is not None), None)
        width = answer.logits.shape[1] if answer is not None else len(found) if found is not None else 0
    n = len(keys)
    if n and not results and len(inferred) == n:  # the common case: one call answered every row, in order
        only = next(iter(inferred.values()))
        if only.logits.shape == (n, width) and only.keys == keys:
            logits = np.array(only.logits, dtype=np.float32)  # a copy, as the block copy below makes
            return ScoredRows(logits, [Source.INFERENCE] * n, [only.version] * n, [0] * n, [""] * n)
    logits = np.full((len(keys), width), np.nan, dtype=np.float32)
    blocks: dict[int, tuple[_Answer, list[int], list[int]]] = {}  # call → (its answer, rows here, its rows)
    sources: list[Source] = []
    versions: list[str] = []
    ages: list[int] = []
    reasons: list[str] = []
    for i, key in enumerate(keys):
        answer = inferred.get(key)
        if answer is not None:
            block = blocks.setdefault(id(answer), (answer, [], []))
            block[1].append(i)
            block[2].append(answer.row_of[key])
            sources.append(Source.INFERENCE)
            versions.append(answer.version)
            ages.append(0)
            reasons.append("")
            continue
        scored = results[key]
        if scored.logits is not None and scored.logits.shape == (width,):
            logits[i] = scored.logits
        sources.append(scored.source)
        versions.append(scored.model_version)
        ages.append(scored.age_ms)
        reasons.append(scored.degraded_reason)
    for answer, here, there in blocks.values():
        if answer.logits.shape[1] == width:  # logits of another width stay NaN: unusable rows
            logits[here] = answer.logits[there]
    return ScoredRows(logits, sources, versions, ages, reasons)
