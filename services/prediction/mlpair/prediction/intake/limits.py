"""Per-caller rate limits: how many decisions per second each caller may ask for.

The algorithm is GCRA (the generic cell rate algorithm, a token bucket kept as one number): a caller
limited to ``rate`` decisions/s with a ``burst`` keeps a *theoretical arrival time* (TAT); a call of
``n`` decisions is admitted when ``max(TAT, now) + n / rate - now <= burst / rate``, and then moves the
TAT to that sum. A refused call changes nothing and learns when it would be admitted (its
``RetryInfo``). A Predict takes one decision; a BatchPredict of ``n`` items or a PredictColumns chunk
of ``n`` rows takes ``n`` at once, all or nothing: a call larger than the burst is never admitted,
so the burst must cover the largest batch a caller sends.

Limits are set per caller with a default (``PREDICTION_CALLER_LIMITS='{"a": 50, "*": 500}'``,
decisions/s; ``PREDICTION_CALLER_BURST_S``: the burst as seconds of the rate, at least one decision);
a caller neither named nor covered by ``*`` is not limited. Two stores:

* :class:`MemoryLimiter` — in this process (the embedded default; each replica and each worker limits
  on its own, so N of them admit N times the rate);
* :class:`RedisLimiter` — one TAT per caller in Redis, shared by every replica: one Lua script per call
  (:data:`GCRA_SCRIPT`), atomic in Redis, that reads the time from Redis itself (``TIME``), so the
  replicas' clocks play no part. When Redis does not answer within ``PREDICTION_REDIS_TIMEOUT_MS``
  the call is admitted (``open``, the default: a limit must not turn a Redis outage into a service
  outage) or refused UNAVAILABLE (``closed``), as ``PREDICTION_CALLER_LIMIT_REDIS_FAILURE`` says;
  either way it is counted in ``prediction_caller_limit_errors_total``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from mlpair.prediction import metrics
from mlpair.prediction.errors import CallerRateLimited, LimitUnavailable
from mlpair.prediction.intake.callers import CallerSource, identify, metric_label

logger = logging.getLogger(__name__)
DEFAULT = "*"

# KEYS[1]: the caller's TAT (microseconds since the epoch, Redis's clock). ARGV: the emission interval
# (microseconds per decision), the burst tolerance (microseconds), the decisions asked for. Returns
# {1, 0} when admitted (the TAT moved), {0, microseconds until it would be} when refused (unchanged).
GCRA_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, tolerance, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new_tat = tat + n * interval
local wait = new_tat - now - tolerance
if wait > 0 then return {0, wait} end
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return {1, 0}
"""


@dataclass(frozen=True)
class Limit:
    """``rate`` decisions per second with a burst of ``burst`` decisions."""

    rate: float
    burst: float

    @property
    def interval_us(self) -> int:
        """Microseconds per decision."""
        return max(1, round(1e6 / self.rate))

    @property
    def tolerance_us(self) -> int:
        """How far ahead of now the TAT may run, in microseconds: ``burst`` decisions' worth."""
        return round(self.burst * 1e6 / self.rate)


def parse_limits(rates: Mapping[str, float], burst_s: float) -> dict[str, Limit]:
    """Caller → :class:`Limit` from decisions/s per caller (``*``: every caller not named).

    Raises:
        ValueError: a rate that is not a positive number.
    """
    out = {}
    for caller, rate in rates.items():
        if not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"caller limit of {caller!r} must be a positive number of decisions per second")
        out[caller] = Limit(float(rate), max(1.0, rate * burst_s))
    return out


class Limiter:
    """Admits or refuses a caller's decisions (:meth:`take`); the limits' store is the subclass's."""

    def __init__(self, limits: Mapping[str, Limit], label) -> None:
        """``label``: caller → its bounded metric label."""
        self.limits = dict(limits)
        self.label = label

    def limit_of(self, caller: str) -> Limit | None:
        """The caller's limit: its own, else the default (``*``), else none."""
        return self.limits.get(caller) or self.limits.get(DEFAULT)

    async def take(self, caller: str, n: int) -> None:
        """Takes ``n`` decisions from ``caller``'s limit, or refuses the call whole; counts them
        either way (``prediction_caller_decisions_total``).

        Raises:
            CallerRateLimited: over the limit (RESOURCE_EXHAUSTED, with when to retry).
            LimitUnavailable: the shared store did not answer and the limit fails closed.
        """
        limit = self.limit_of(caller)
        label = self.label(caller)
        wait_us = None if limit is None or n <= 0 else await self._take(caller, limit, n)
        if wait_us is None or limit is None:
            metrics.CALLER_DECISIONS.labels(label, "admitted").inc(n)
            return
        metrics.CALLER_DECISIONS.labels(label, "limited").inc(n)
        retry_s = wait_us / 1e6
        raise CallerRateLimited(
            f"the caller's limit of {limit.rate:g} decisions per second is used up; retry in {retry_s:.3f} s",
            retry_after_s=retry_s,
            metadata={"limit_per_s": f"{limit.rate:g}", "burst": f"{limit.burst:g}"},
        )

    async def _take(self, caller: str, limit: Limit, n: int) -> int | None:
        """None when admitted, else microseconds until the call would be."""
        raise NotImplementedError

    async def close(self) -> None:
        """Releases the store's connections."""


class MemoryLimiter(Limiter):
    """The limits in this process (GCRA on ``time.monotonic``)."""

    def __init__(self, limits: Mapping[str, Limit], label) -> None:
        super().__init__(limits, label)
        self._tat: dict[str, int] = {}

    async def _take(self, caller: str, limit: Limit, n: int) -> int | None:
        now = time.monotonic_ns() // 1000
        tat = max(self._tat.get(caller, 0), now)
        new_tat = tat + n * limit.interval_us
        wait = new_tat - now - limit.tolerance_us
        if wait > 0:
            return wait
        self._tat[caller] = new_tat
        return None


class RedisLimiter(Limiter):
    """The limits in Redis, shared by every replica: one :data:`GCRA_SCRIPT` call per call."""

    def __init__(
        self,
        limits: Mapping[str, Limit],
        label,
        url: str,
        prefix: str,
        timeout_s: float,
        failure: Literal["open", "closed"] = "open",
        max_connections: int = 16,
    ) -> None:
        super().__init__(limits, label)
        from redis import asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.prefix = prefix + "caller-limit:"
        self.failure = failure
        # a call waits up to timeout_s for a free connection (a plain pool refuses at once when all
        # max_connections are busy, which a burst of concurrent calls reaches)
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._script = self._redis.register_script(GCRA_SCRIPT)

    async def _take(self, caller: str, limit: Limit, n: int) -> int | None:
        try:
            admitted, wait = await self._script(
                keys=[self.prefix + caller], args=[limit.interval_us, limit.tolerance_us, n]
            )
        except Exception as exc:  # noqa: BLE001  (any Redis failure: the setting decides)
            metrics.CALLER_LIMIT_ERRORS.labels(self.failure).inc()
            logger.warning("caller limit store failed (%s); failing %s", type(exc).__name__, self.failure)
            if self.failure == "open":
                return None
            raise LimitUnavailable("the caller limit store is unavailable; retry later") from None
        return None if int(admitted) else int(wait)

    async def close(self) -> None:
        """Closes the Redis connections."""
        await self._redis.aclose()


class CallerGate:
    """What intake does once per call: establish the caller (:func:`~.callers.identify`) and take
    the call's decisions from its limit (:class:`Limiter`)."""

    def __init__(self, limiter: Limiter, source: CallerSource = "none", header: str = "x-caller-id") -> None:
        self.limiter = limiter
        self.source = source
        self.header = header

    def identify(self, context) -> str:
        """The call's caller.

        Raises:
            InvalidCaller: the trusted source's value is not a usable caller id.
        """
        return identify(context, self.source, self.header)

    async def admit(self, context, n: int) -> str:
        """The call's caller, once its ``n`` decisions are taken from the caller's limit.

        Raises:
            InvalidCaller: as :meth:`identify`.
            CallerRateLimited: over the caller's limit (nothing is decided).
            LimitUnavailable: the shared limit store failed and the limit fails closed.
        """
        caller = identify(context, self.source, self.header)
        await self.limiter.take(caller, n)
        return caller

    async def close(self) -> None:
        """Releases the limiter's connections."""
        await self.limiter.close()


def build_gate(settings) -> CallerGate:
    """The gate ``settings`` (:class:`~mlpair.prediction.settings.PredictionSettings`) describe."""
    limits = parse_limits(settings.caller_limits, settings.caller_burst_s)
    named = frozenset(settings.callers) | (frozenset(limits) - {DEFAULT})

    def label(caller: str) -> str:
        return metric_label(caller, named)

    limiter: Limiter
    if settings.caller_limit_backend == "redis" and limits:
        limiter = RedisLimiter(
            limits,
            label,
            settings.redis_url,
            settings.redis_key_prefix,
            settings.redis_timeout_ms / 1000,
            settings.caller_limit_redis_failure,
            settings.redis_max_connections,
        )
    else:
        limiter = MemoryLimiter(limits, label)
    return CallerGate(limiter, settings.caller_source, settings.caller_header)
