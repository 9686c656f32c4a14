"""Calling InferenceService within the caller's deadline: budget, retries and a circuit breaker.

* **Deadline budget.** A Predict call has the caller's deadline; the Infer call gets what
  remains of it minus a reserve for recording the decision (``crm_reserve_ms``), capped at
  ``inference_timeout_ms``. With less than ``inference_min_attempt_ms`` left before any attempt
  no call is made and the request fails fast with :class:`DeadlineTooShort` (DEADLINE_EXCEEDED,
  nothing decided or recorded: the deadline is the caller's, not a sign that inference is down),
  or with :class:`CircuitOpen` while the circuit is open (then the caller falls back). An attempt
  that runs out of its budget is :class:`InferenceTimeout`, and the caller falls back.
* **Retries** only of inference-side faults, which another replica may not have
  (``InferenceUnavailable.retryable``, ``scoring.client.classify``: UNAVAILABLE, a failed model
  batch or another INTERNAL, UNKNOWN), with full jitter — ``uniform(0, min(cap, base·2^attempt))``, AWS Architecture Blog, "Exponential
  Backoff and Jitter" (2015) — and only when the wait plus a minimal attempt still fit the
  budget.
* **Circuit breaker** (Nygard, *Release It!*, 2nd ed., ch. 5): CLOSED counts consecutive
  unavailable/timed-out calls (a timeout only when the call had the whole
  ``inference_timeout_ms``: a call its caller's own deadline cut short says nothing about the
  service, and one caller sending tight deadlines must not open the circuit for all); at ``failure_threshold`` it OPENs and calls fail at once with
  :class:`CircuitOpen`; after ``open_s`` it is HALF_OPEN and lets ``half_open_probes`` calls
  through at a time — a success closes it, a failure opens it again. Answers that prove the
  service is up (a contract refusal, an invalid tensor) count as successes for availability;
  a replica's failed model batch counts as a failure, by cause in ``prediction_inference_errors_total``. Load
  shedding (:class:`InferenceOverloaded`: a full queue, the mesh's rate limit) counts as neither:
  a busy service is not a broken one, and opening the circuit would turn shed calls into
  fallback decisions (errors by cause: ``scoring.client.classify``).

Tuned by (``settings.py``): the budget ``PREDICTION_INFERENCE_TIMEOUT_MS``, ``PREDICTION_CRM_RESERVE_MS``,
``PREDICTION_INFERENCE_MIN_ATTEMPT_MS``; the retry budget ``PREDICTION_INFERENCE_MAX_ATTEMPTS`` (the first
included) and ``PREDICTION_INFERENCE_RETRY_BACKOFF_MS``; the breaker ``PREDICTION_BREAKER_FAILURE_THRESHOLD``,
``PREDICTION_BREAKER_OPEN_MS``, ``PREDICTION_BREAKER_HALF_OPEN_PROBES``. Istio's retries multiply these
(``deploy/istio/``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from mlpair import background
from mlpair.prediction import metrics
from mlpair.prediction.errors import (
    CircuitOpen,
    DeadlineTooShort,
    InferenceOverloaded,
    InferenceTimeout,
    InferenceUnavailable,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CircuitState(enum.IntEnum):
    """Breaker states; the values are what the ``prediction_circuit_state`` gauge exports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """A consecutive-failure circuit breaker with half-open probes (not thread-safe: one event loop).

    Args:
        name: dependency name, the gauge label (e.g. ``inference``).
        failure_threshold: consecutive failures that open the circuit.
        open_s: seconds the circuit stays open before probing.
        half_open_probes: calls allowed at once while half-open.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        name: str,
        *,
        failure_threshold: int,
        open_s: float,
        half_open_probes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failure_threshold = max(1, failure_threshold)
        self.open_s = open_s
        self.half_open_probes = max(1, half_open_probes)
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probes = 0
        metrics.CIRCUIT_STATE.labels(name).set(CircuitState.CLOSED)

    @property
    def state(self) -> CircuitState:
        """The current state; an OPEN circuit whose wait has passed reads as HALF_OPEN."""
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.open_s:
            self._transition(CircuitState.HALF_OPEN)
        return self._state

    def acquire(self) -> None:
        """Admits one call or raises.

        Raises:
            CircuitOpen: the circuit is open, or half-open with every probe slot taken.
        """
        state = self.state
        if state is CircuitState.CLOSED:
            return
        if state is CircuitState.HALF_OPEN and self._probes < self.half_open_probes:
            self._probes += 1
            return
        raise CircuitOpen("the inference circuit is open after repeated failures")

    def release(self) -> None:
        """An admitted call ended without an outcome (cancelled); frees its half-open probe slot."""
        if self._state is CircuitState.HALF_OPEN and self._probes > 0:
            self._probes -= 1

    def record_success(self) -> None:
        """An admitted call reached a live service."""
        self._failures = 0
        if self._state is not CircuitState.CLOSED:
            self._transition(CircuitState.CLOSED)

    def record_failure(self) -> None:
        """An admitted call found the service unavailable or timed out."""
        self._failures += 1
        if self._state is CircuitState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
            if self._state is not CircuitState.OPEN:
                self._transition(CircuitState.OPEN)

    def _transition(self, state: CircuitState) -> None:
        logger.warning("circuit %s: %s -> %s", self.name, self._state.name, state.name)
        self._state = state
        self._probes = 0
        if state is CircuitState.CLOSED:
            self._failures = 0
        metrics.CIRCUIT_STATE.labels(self.name).set(state)
        metrics.CIRCUIT_TRANSITIONS.labels(self.name, state.name).inc()


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts, and how long to wait between them (full jitter)."""

    max_attempts: int = 2
    backoff_base_s: float = 0.01
    backoff_max_s: float = 0.2

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return background.backoff_s(attempt - 1, self.backoff_base_s, self.backoff_max_s)


@dataclass(frozen=True)
class DeadlineBudget:
    """Splits the caller's remaining time between inference and recording the decision.

    Attributes:
        reserve_s: seconds kept back for the outbox write and the response.
        max_call_s: the longest single Infer deadline, whatever the caller allows.
        min_attempt_s: no attempt is started with less than this.
    """

    reserve_s: float = 0.02
    max_call_s: float = 1.0
    min_attempt_s: float = 0.005

    def call_timeout_s(self, deadline: float | None, now: float) -> float:
        """Seconds the next Infer attempt may take; ≤ 0 means the budget is spent.

        Args:
            deadline: the caller's deadline in ``time.monotonic()`` seconds, or None (no deadline).
            now: ``time.monotonic()``.
        """
        if deadline is None:
            return self.max_call_s
        return min(self.max_call_s, deadline - now - self.reserve_s)


class ResilientCaller:
    """Runs one logical Infer call: budget, breaker admission, retries of retryable failures."""

    def __init__(self, breaker: CircuitBreaker, budget: DeadlineBudget, retry: RetryPolicy) -> None:
        self.breaker = breaker
        self.budget = budget
        self.retry = retry

    def no_budget_error(self, deadline: float | None, now: float) -> DeadlineTooShort | CircuitOpen | None:
        """Why no Infer attempt may start for a caller with ``deadline`` (``time.monotonic()``
        seconds) at ``now``, or None when one may: its budget is under ``min_attempt_s`` —
        :class:`CircuitOpen` while the circuit is open (inference is known to be down: the caller
        falls back), else :class:`DeadlineTooShort` (the caller's deadline: nothing is decided)."""
        left = self.budget.call_timeout_s(deadline, now)
        if left >= self.budget.min_attempt_s:
            return None
        if self.breaker.state is CircuitState.OPEN:
            return CircuitOpen("the inference circuit is open after repeated failures")
        return DeadlineTooShort(
            f"the call's deadline leaves {max(0.0, left) * 1000:.0f} ms for inference once "
            f"{self.budget.reserve_s * 1000:.0f} ms are kept to record the decision, under the "
            f"{self.budget.min_attempt_s * 1000:.0f} ms an attempt needs; nothing was decided: retry with a "
            "longer deadline and the same request id"
        )

    async def call(self, attempt: Callable[[float], Awaitable[T]], deadline: float | None, *, model: str) -> T:
        """``await attempt(timeout_s)`` until it succeeds, within ``deadline``.

        Args:
            attempt: one Infer attempt given its timeout in seconds.
            deadline: the caller's deadline in ``time.monotonic()`` seconds, or None.
            model: model family (metric label).

        Raises:
            DeadlineTooShort: the caller's budget was too short for a first attempt (none was made).
            InferenceTimeout: the budget ran out during an attempt, or before a retry.
            CircuitOpen: the breaker refused the call.
            InferenceUnavailable: the last attempt found the service down or failing.
            InferenceOverloaded: the service shed the call (not retried: a retry adds load; not a breaker failure).
            InferenceContractError, InferenceFailed: the service answered with a refusal (not retried).
        """
        number = 0
        while True:
            number += 1
            now = time.monotonic()
            timeout = self.budget.call_timeout_s(deadline, now)
            if timeout < self.budget.min_attempt_s:
                error = self.no_budget_error(deadline, now) if number == 1 else None
                raise error or InferenceTimeout("no deadline budget left for another inference attempt")
            self.breaker.acquire()
            try:
                result = await attempt(timeout)
            except InferenceUnavailable as exc:
                if isinstance(exc, InferenceTimeout) and timeout < self.budget.max_call_s:
                    self.breaker.release()  # cut short by the caller's deadline: no evidence either way
                else:
                    self.breaker.record_failure()
                if not exc.retryable or number >= self.retry.max_attempts:
                    raise
                wait = self.retry.backoff_s(number)
                remaining = self.budget.call_timeout_s(deadline, time.monotonic() + wait)
                if remaining < self.budget.min_attempt_s:
                    raise
                metrics.INFERENCE_RETRIES.labels(model).inc()
                await asyncio.sleep(wait)
            except (asyncio.CancelledError, InferenceOverloaded):
                self.breaker.release()  # the caller left, or the service shed load: neither says it is down
                raise
            except Exception:
                self.breaker.record_success()  # the service answered, so it is available
                raise
            else:
                self.breaker.record_success()
                return result
