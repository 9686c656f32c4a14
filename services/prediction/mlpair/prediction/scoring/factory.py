"""Building the scoring chain once: cache → coalescer → resilience → inference client.

Each layer is constructed here and injected into the one that calls it, so none of them builds
another (and a test can put a fake client under the real chain with :func:`wire_scorer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlpair.observability.calls import CallTracer
from mlpair.prediction.scoring.backends import LogitsCache, MemoryCache, NullCache
from mlpair.prediction.scoring.cache import CachedInference
from mlpair.prediction.scoring.client import InferenceClient
from mlpair.prediction.scoring.coalescer import InferenceCoalescer, Infers
from mlpair.prediction.scoring.redis_backend import RedisCache
from mlpair.prediction.scoring.resilience import CircuitBreaker, DeadlineBudget, ResilientCaller, RetryPolicy
from mlpair.rpc import channel_credentials

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from mlpair.prediction.settings import PredictionSettings


def build_cache(settings: PredictionSettings) -> LogitsCache:
    """The cache backend ``settings.cache_backend`` names (no network I/O yet)."""
    if settings.cache_backend == "redis":
        return RedisCache(
            settings.redis_url,
            key_prefix=settings.redis_key_prefix,
            stale_ttl_s=settings.cache_stale_ttl_s,
            timeout_s=settings.redis_timeout_ms / 1000,
            max_connections=settings.redis_max_connections,
            reply_timeout_s=settings.redis_reply_timeout_ms / 1000,
        )
    if settings.cache_backend == "memory":
        return MemoryCache(max_entries=settings.cache_max_entries, stale_ttl_s=settings.cache_stale_ttl_s)
    return NullCache()


def wire_scorer(
    client: Infers,
    cache: LogitsCache,
    caller: ResilientCaller,
    *,
    fresh_ttl_s: float,
    linger_s: float = 1.0,
    coalesce_max_delay_s: float = 0.002,
    max_call_rows: int = 1024,
) -> CachedInference:
    """``cache`` in front of a coalescer that sends merged calls through ``caller`` to ``client``.

    Args:
        fresh_ttl_s: entries younger than this are served without calling inference.
        linger_s: how long a successful call stays joinable after its result is cached.
        coalesce_max_delay_s: longest a flight's rows wait to share an Infer call with other
            flights while a call of the same target is in flight.
        max_call_rows: most rows in one merged Infer call.
    """
    coalescer = InferenceCoalescer(client, caller, max_delay_s=coalesce_max_delay_s, max_rows=max_call_rows)
    return CachedInference(coalescer, cache, fresh_ttl_s=fresh_ttl_s, linger_s=linger_s)


def build_inference_client(
    settings: PredictionSettings, *, tracer_provider: TracerProvider | None = None
) -> InferenceClient:
    """The client of InferenceService ``settings`` name (no network I/O yet)."""
    tls = channel_credentials(
        settings.inference_tls_ca_file, settings.inference_tls_cert_file, settings.inference_tls_key_file
    )
    return InferenceClient(
        settings.inference_target,
        timeout_ms=settings.inference_timeout_ms,
        max_message_bytes=settings.max_message_bytes,
        reconnect_backoff_max_ms=settings.inference_reconnect_backoff_max_ms,
        credentials=tls,
        keepalive_ms=settings.inference_keepalive_ms,
        keepalive_timeout_ms=settings.inference_keepalive_timeout_ms,
        load_balancing=settings.inference_load_balancing,
        tracer=CallTracer(tracer_provider) if settings.tracing else None,
    )


def build_scorer(settings: PredictionSettings, client: Infers) -> CachedInference:
    """``client`` behind the cache, single-flight, coalescing, deadline budget, retries and breaker."""
    caller = ResilientCaller(
        CircuitBreaker(
            "inference",
            failure_threshold=settings.breaker_failure_threshold,
            open_s=settings.breaker_open_ms / 1000,
            half_open_probes=settings.breaker_half_open_probes,
        ),
        DeadlineBudget(
            reserve_s=settings.crm_reserve_ms / 1000,
            max_call_s=settings.inference_timeout_ms / 1000,
            min_attempt_s=settings.inference_min_attempt_ms / 1000,
        ),
        RetryPolicy(
            max_attempts=settings.inference_max_attempts,
            backoff_base_s=settings.inference_retry_backoff_ms / 1000,
            backoff_max_s=settings.inference_timeout_ms / 1000,
        ),
    )
    cache = build_cache(settings)
    return wire_scorer(
        client,
        cache,
        caller,
        fresh_ttl_s=settings.cache_fresh_ttl_s,
        linger_s=0.0 if isinstance(cache, NullCache) else 1.0,
        coalesce_max_delay_s=settings.coalesce_max_delay_ms / 1000,
        max_call_rows=settings.inference_max_batch_rows,
    )
