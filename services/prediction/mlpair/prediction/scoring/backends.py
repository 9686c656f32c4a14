"""Cache backends for inference results, and what makes an entry read from one fit to serve.

:class:`MemoryCache` (in-process LRU) and :class:`NullCache` here, and
:class:`~mlpair.prediction.scoring.redis_backend.RedisCache` (shared by replicas; any Redis error
or timeout is a miss, never a failed request) in :mod:`.redis_backend`, behind the
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

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mlpair.prediction import metrics


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
    count_invalid(backend, cause)
    return False


def count_invalid(backend: str, cause: str) -> None:
    """Counts an entry read from ``backend`` that may not be served, by ``cause``
    (``prediction_cache_invalid_total``)."""
    metrics.labelled(metrics.CACHE_INVALID, backend, cause).inc()
