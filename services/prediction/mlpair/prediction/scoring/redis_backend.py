"""The Redis cache backend: one cache shared by every replica, where any Redis error or timeout
is a miss, never a failed request (see :mod:`.backends` for the protocol and why every entry read
is checked before it is served).
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from mlpair.prediction import metrics
from mlpair.prediction.scoring.backends import CachedLogits, count_invalid

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_VALUE_BYTES = 4096  # header, a version name and the logits of any model this service serves
MAX_CLOCK_SKEW_S = 5.0  # a shared entry stored further in the future than this was not written by a replica

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
            count_invalid(self.name, "format")
            return None
        if len(value) > MAX_VALUE_BYTES:
            count_invalid(self.name, "size")
            return None
        try:
            tag, digest, stored_at, length = _HEADER.unpack_from(value)
            start = _HEADER.size + length
            version = value[_HEADER.size : start].decode()
            if tag != _TAG or len(value) < start or (len(value) - start) % 4:
                count_invalid(self.name, "format")
                return None
            logits = np.frombuffer(value, dtype="<f4", offset=start)
        except (struct.error, UnicodeDecodeError, ValueError):
            count_invalid(self.name, "format")
            return None
        if digest != _key_digest(key):  # a value copied (or written) under another key
            count_invalid(self.name, "key")
            return None
        if not math.isfinite(stored_at) or stored_at > now + MAX_CLOCK_SKEW_S:
            count_invalid(self.name, "clock")
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
