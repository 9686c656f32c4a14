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

import hashlib
import logging
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mlpair.prediction import metrics

logger = logging.getLogger(__name__)

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

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]: ...

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


class NullCache:
    """No caching: every request calls inference, and there is never a stale result."""

    name = "off"
    stale_ttl_s = 0.0

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        return [None] * len(keys)

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        return None

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
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
        now = self._clock()
        entries, move_to_end = self._entries, self._entries.move_to_end
        for key, logits, version in items:
            entries[key] = (logits, version, now)
            move_to_end(key)
        for _ in range(len(entries) - self.max_entries):
            entries.popitem(last=False)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
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
    """

    name = "redis"

    def __init__(
        self, url: str, *, key_prefix: str, stale_ttl_s: float, timeout_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        from redis import asyncio as aioredis

        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self.prefix = key_prefix
        self.stale_ttl_s = stale_ttl_s
        self._clock = clock

    async def get_many(self, keys: Sequence[str]) -> list[CachedLogits | None]:
        if not keys:
            return []
        try:
            raw = await self._redis.mget([self.prefix + k for k in keys])
        except Exception:  # a cache outage is a miss, never a failed request
            metrics.CACHE_ERRORS.labels(self.name, "get").inc()
            logger.debug("redis get failed", exc_info=True)
            return [None] * len(keys)
        now = self._clock()
        return [None if value is None else self._decode(key, value, now) for key, value in zip(keys, raw)]

    async def put_many(self, items: Sequence[tuple[str, np.ndarray, str]]) -> None:
        if not items:
            return
        now = self._clock()
        ttl_ms = max(1, int(self.stale_ttl_s * 1000))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, logits, version in items:
                    encoded = version.encode()
                    value = (
                        _HEADER.pack(_TAG, _key_digest(key), now, len(encoded))
                        + encoded
                        + np.ascontiguousarray(logits, "<f4").tobytes()
                    )
                    pipe.set(self.prefix + key, value, px=ttl_ms)
                await pipe.execute()
        except Exception:
            metrics.CACHE_ERRORS.labels(self.name, "put").inc()
            logger.debug("redis put failed", exc_info=True)

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except Exception:  # noqa: BLE001  (any failure: Redis is not healthy)
            return False

    async def close(self) -> None:
        await self._redis.aclose()

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
