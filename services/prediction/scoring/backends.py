"""Cache backends for inference results, and what makes an entry read from one fit to serve.

:class:`MemoryCache` (in-process LRU), :class:`RedisCache` (shared by replicas; any Redis error
or timeout is a miss, never a failed request) and :class:`NullCache`, behind the
:class:`LogitsCache` protocol that :class:`~mlpair.prediction.scoring.cache.CachedInference` uses.

**A shared cache is untrusted input.** Other processes write Redis too (other replicas, other
releases, anything with access to it), so nothing read from it is used as it comes: the value is
a fixed binary layout (never object serialisation) that names the key it was written for, and
:func:`fit_to_serve` checks every entry from every backend the way this process would have
written it — the key it was stored under, the model version, ``[n_classes]`` finite float32
logits, a size within bounds, a store time not in the future. An entry that does not fit is a
miss, counted in ``prediction_cache_invalid_total{backend, cause}``; it is never served, not even
stale, and never an error. One poisoned entry can therefore change nobody's decision.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from mlpair.prediction import metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_VALUE_BYTES = 4096  # header, a version name and the logits of any model this service serves
MAX_CLOCK_SKEW_S = 5.0  # a shared entry stored further in the future than this was not written by a replica


@dataclass(frozen=True)
class CachedLogits:
    """One cache entry as read: logits ``[n_classes] float32``, the serving version, age in seconds."""

    logits: np.ndarray
    model_version: str
    age_s: float


class LogitsCache(Protocol):
    """What :class:`CachedInference` needs from a backend; entries past the stale window are never returned."""

    name: str
    stale_ttl_s: float

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        """The entries stored under ``keys``, in the same order; None for a miss.

        A backend returns None, never raises, for a key it cannot read (outage, entry past the stale
        window, a value not in its layout); the caller still checks each entry with :func:`fit_to_serve`.
        """

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        """Stores ``(key, logits [n_classes] float32, model_version)`` triples for the stale window.

        A write the backend cannot make is lost, never an error: the request that computed the logits
        has them already.
        """

    async def ping(self) -> bool:
        """Whether the backend answers now; never raises."""

    async def close(self) -> None:
        """Releases the backend's connections or entries; the cache is not used afterwards."""


class NullCache:
    """No caching: every request calls inference, and there is never a stale result."""

    name = "off"
    stale_ttl_s = 0.0

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        """A miss (None) for each of ``keys``."""
        return [None] * len(keys)

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        """Stores nothing."""
        return None

    async def ping(self) -> bool:
        """Always True: there is nothing to be down."""
        return True

    async def close(self) -> None:
        """Nothing to release."""
        return None


class MemoryCache:
    """In-process LRU bounded by entry count; ages from ``time.monotonic()``."""

    name = "memory"

    def __init__(self, *, max_entries: int, stale_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max(1, max_entries)
        self.stale_ttl_s = stale_ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[np.ndarray, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        """The entries under ``keys``, in order, None for a miss; each hit becomes the most recently used.

        An entry older than ``stale_ttl_s`` seconds (by this cache's clock) is deleted and read as a
        miss. ``age_s`` is the seconds since the entry was stored.
        """
        found = list(map(self._entries.get, keys))
        if found.count(None) == len(found):  # every key a miss (a batch of new rows): nothing to age or move
            return [None] * len(found)
        now = self._clock()
        out: list[CachedLogits | None] = []
        for key, entry in zip(keys, found):
            if entry is None:
                out.append(None)
                continue
            logits, version, stored_at = entry
            if now - stored_at > self.stale_ttl_s:
                del self._entries[key]
                out.append(None)
                continue
            self._entries.move_to_end(key)
            out.append(CachedLogits(logits, version, now - stored_at))
        return out

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        """Stores ``(key, logits [n_classes] float32, model_version)`` triples, stamped with the clock's now.

        A key already present is overwritten and becomes the most recently used; past ``max_entries``
        the least recently used entries are evicted. The logits array is kept as given, not copied.
        """
        now = self._clock()
        entries, move_to_end = self._entries, self._entries.move_to_end
        for key, logits, version in items:
            entries[key] = (logits, version, now)
            move_to_end(key)
        for _ in range(len(entries) - self.max_entries):
            entries.popitem(last=False)

    async def ping(self) -> bool:
        """Always True: the cache lives in this process."""
        return True

    async def close(self) -> None:
        """Drops every entry."""
        self._entries.clear()


# Redis value: a layout tag, the BLAKE2b-128 digest of the key it was written for, stored-at wall-clock
# seconds (float64), version length (uint16), version (UTF-8), then the float32 logits.
_TAG = b"mlc2"
_HEADER = struct.Struct("<4s16sdH")


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class RedisCache:
    """A Redis cache shared by replicas. Entries expire (``EX``) at the end of the stale window.

    Ages use wall-clock time (``time.time()``), the only clock replicas share.

    **Connections** (issue 36 C53). At most ``max_connections`` per process (redis-py's
    ``BlockingConnectionPool``); a command that finds none free within ``timeout_s`` is a miss
    (``prediction_cache_errors_total{reason="no_connection"}``), never a new connection. A request
    waits at most ``timeout_s`` for its command, connection wait included (``reason="timeout"``),
    but the command is not cancelled: redis-py drops a connection whose command is cancelled or
    times out, since the reply still in flight would be read as the next command's, so a Redis
    slower than ``timeout_s`` made every command open a new connection (measured in
    docs/reliability.md). The command runs
    on in the background until its reply is read, up to ``reply_timeout_s``, and its connection
    goes back to the pool: once the pool is warm, a slow Redis opens no connection at all; one
    slower than ``reply_timeout_s`` costs a reconnect per command, at most ``max_connections`` at a
    time. Nothing is retried (redis-py retries a failed command three times by default).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str,
        stale_ttl_s: float,
        timeout_s: float,
        max_connections: int = 16,
        reply_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from redis import asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        reply_timeout_s = max(reply_timeout_s, timeout_s)
        self.pool = _counted_pool().from_url(  # built on first use: importing this module imports no redis
            url,
            max_connections=max(1, max_connections),
            timeout=timeout_s,  # the longest a command waits for a free connection
            socket_timeout=reply_timeout_s,
            socket_connect_timeout=reply_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = aioredis.Redis(connection_pool=self.pool)
        self.prefix = key_prefix
        self.stale_ttl_s = stale_ttl_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._late: set[asyncio.Task] = set()  # commands whose callers stopped waiting, reading their replies

    async def _bounded(self, command: Awaitable[T]) -> T:
        """``command``'s result within ``timeout_s``, the command left to finish when it takes longer.

        Raises:
            CacheUnavailable: no connection was free in time, or no reply came in time (``reason``).
            redis.RedisError, OSError: the command failed.
        """
        acquired = _Acquired()
        token = _ACQUIRED.set(acquired)  # the command's task sees it: whether it got a connection
        try:
            task = asyncio.ensure_future(command)
        finally:
            _ACQUIRED.reset(token)
        try:
            done, _ = await asyncio.wait((task,), timeout=self.timeout_s)
        except asyncio.CancelledError:
            self._leave(task)  # the caller went away: the command still must not drop its connection
            raise
        if not done:
            self._leave(task)
            raise CacheUnavailable("timeout" if acquired.connection else "no_connection")
        try:
            return task.result()
        except Exception as exc:
            if acquired.timed_out:
                raise CacheUnavailable("no_connection") from exc
            raise

    def _leave(self, task: asyncio.Task) -> None:
        self._late.add(task)
        task.add_done_callback(_finished_late(self._late))

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        """The entries under ``keys``, in order, read with one ``MGET``; None for a miss.

        A failed, timed-out or connection-starved ``MGET`` makes every key a miss, counted in
        ``prediction_cache_errors_total{operation="get"}``; a value not in this service's layout or
        written for another key is a miss counted in ``prediction_cache_invalid_total`` (by cause). Ages
        are wall-clock seconds since the writing replica stored the entry. Never raises for Redis errors.
        """
        if not keys:
            return []
        try:
            raw = await self._bounded(self._redis.mget([self.prefix + k for k in keys]))
        except Exception as exc:  # noqa: BLE001 - a cache outage is a miss, never a failed request
            _cache_error(self.name, "get", exc)
            return [None] * len(keys)
        now = self._clock()
        return [None if value is None else self._decode(key, value, now) for key, value in zip(keys, raw)]

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        """Writes ``(key, logits [n_classes] float32, model_version)`` triples in one pipeline (not a transaction).

        Each value is the fixed binary layout (tag, digest of the key, wall-clock store time, version,
        little-endian float32 logits) and expires (``PX``) at the end of the stale window. A write that
        fails or times out is lost and counted in ``prediction_cache_errors_total{operation="put"}``;
        never raises for Redis errors.
        """
        if not items:
            return
        now = self._clock()
        ttl_ms = max(1, int(self.stale_ttl_s * 1000))
        pipe = self._redis.pipeline(transaction=False)
        for key, logits, version in items:
            encoded = version.encode()
            value = (
                _HEADER.pack(_TAG, _key_digest(key), now, len(encoded))
                + encoded
                + np.ascontiguousarray(logits, "<f4").tobytes()
            )
            pipe.set(self.prefix + key, value, px=ttl_ms)
        try:
            await self._bounded(_execute(pipe))
        except Exception as exc:  # noqa: BLE001 - a cache outage loses the write, never the request
            _cache_error(self.name, "put", exc)

    async def ping(self) -> bool:
        """Whether Redis answers ``PING`` within ``timeout_s``; any failure is False, never raised."""
        try:
            return bool(await self._bounded(self._redis.ping()))
        except Exception:  # noqa: BLE001  (any failure: Redis is not healthy)
            return False

    async def close(self) -> None:
        """Cancels the commands still reading late replies, then closes the client and its connection pool."""
        for task in list(self._late):
            task.cancel()
        await asyncio.gather(*self._late, return_exceptions=True)
        await self._redis.aclose()
        await self.pool.aclose()

    def _decode(self, key: str, value: bytes | str, now: float) -> CachedLogits | None:
        """The entry a value holds if it has this service's layout and was written for ``key``;
        else None (counted by cause: ``size``, ``format``, ``key``, ``clock``)."""
        if not isinstance(value, bytes):  # never from this client (no decode_responses): not our layout
            _invalid(self.name, "format")
            return None
        if len(value) > MAX_VALUE_BYTES:
            _invalid(self.name, "size")
            return None
        try:
            tag, digest, stored_at, length = _HEADER.unpack_from(value)
            start = _HEADER.size + length
            version = value[_HEADER.size : start].decode()
            if tag != _TAG or len(value) < start or (len(value) - start) % 4:
                _invalid(self.name, "format")
                return None
            logits = np.frombuffer(value, dtype="<f4", offset=start)
        except (struct.error, UnicodeDecodeError, ValueError):
            _invalid(self.name, "format")
            return None
        if digest != _key_digest(key):  # a value copied (or written) under another key
            _invalid(self.name, "key")
            return None
        if not math.isfinite(stored_at) or stored_at > now + MAX_CLOCK_SKEW_S:
            _invalid(self.name, "clock")
            return None
        return CachedLogits(logits, version, max(0.0, now - stored_at))


class CacheUnavailable(Exception):
    """A Redis command that could not be used in time; ``reason``: ``no_connection`` or ``timeout``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Acquired:
    """Whether the command of one :meth:`RedisCache._bounded` call got a connection, or timed out waiting."""

    __slots__ = ("connection", "timed_out")

    def __init__(self) -> None:
        self.connection = self.timed_out = False


_ACQUIRED: contextvars.ContextVar[_Acquired | None] = contextvars.ContextVar("mlpair_redis_acquired", default=None)


@functools.cache
def _counted_pool() -> Any:
    from redis.asyncio import BlockingConnectionPool
    from redis.exceptions import ConnectionError as RedisConnectionError

    class CountedPool(BlockingConnectionPool):
        """A ``BlockingConnectionPool`` that tells the command waiting on it (``_ACQUIRED``) whether it
        got a connection or timed out waiting for one (redis-py says only "No connection available")."""

        async def get_connection(self, *args, **kwargs):
            acquired = _ACQUIRED.get()
            try:
                connection = await super().get_connection(*args, **kwargs)
            except RedisConnectionError as exc:
                if acquired is not None and isinstance(exc.__cause__, asyncio.TimeoutError | TimeoutError):
                    acquired.timed_out = True
                raise
            if acquired is not None:
                acquired.connection = True
            return connection

    return CountedPool


async def _execute(pipe) -> list:
    async with pipe:
        return await pipe.execute()


def _finished_late(late: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    def finished(task: asyncio.Task) -> None:
        late.discard(task)
        if not task.cancelled() and task.exception() is not None:  # read: nobody waits for it any more
            logger.debug("late redis command failed", exc_info=task.exception())

    return finished


def _cache_error(backend: str, operation: str, exc: Exception) -> None:
    reason = exc.reason if isinstance(exc, CacheUnavailable) else "error"
    metrics.CACHE_ERRORS.labels(backend, operation, reason).inc()
    logger.debug("redis %s failed (%s)", operation, reason, exc_info=reason == "error")


def fit_to_serve(
    backend: str, entry: CachedLogits, model_version: str, n_classes: int | None, stale_ttl_s: float
) -> bool:
    """Whether an entry read from ``backend`` is what this process would have stored for a row
    of ``model_version``: that version, ``[n_classes]`` finite float32 logits, an age within the
    stale window. An entry that is not is counted (``prediction_cache_invalid_total``) and must be
    treated as a miss.

    Args:
        n_classes: the model's number of classes; None checks only that the logits are one row.
    """
    logits = entry.logits
    if entry.model_version != model_version:
        cause = "version"
    elif (
        not isinstance(logits, np.ndarray)
        or logits.dtype != np.float32
        or logits.ndim != 1
        or (logits.shape[0] != n_classes if n_classes is not None else logits.shape[0] == 0)
    ):
        cause = "shape"
    elif not np.isfinite(logits).all():
        cause = "nonfinite"
    elif not 0.0 <= entry.age_s <= stale_ttl_s:
        cause = "age"
    else:
        return True
    _invalid(backend, cause)
    return False


def _invalid(backend: str, cause: str) -> None:
    metrics.labelled(metrics.CACHE_INVALID, backend, cause).inc()
