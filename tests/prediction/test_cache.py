"""Cache keys, fresh and stale windows, Redis, and single-flight against the real InferenceService (C36)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.scoring.cache import MemoryCache, NullCache, RedisCache, Source, cache_key, cache_keys
from mlpair.prediction.scoring.client import InferenceClient
from mlpair.prediction.scoring.factory import wire_scorer
from mlpair.prediction.scoring.resilience import CircuitBreaker, DeadlineBudget, ResilientCaller, RetryPolicy
from tests.fault_support import inference_forwarder, prediction_service, prediction_settings
from tests.support import Clock, require_service

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
ROW = np.linspace(-1, 1, 12, dtype=np.float32)
LOGITS = np.array([0.5, -0.25], dtype=np.float32)


def caller(**breaker) -> ResilientCaller:
    return ResilientCaller(CircuitBreaker("inference", failure_threshold=breaker.get("threshold", 5), open_s=60),
                           DeadlineBudget(reserve_s=0.02, max_call_s=2.0), RetryPolicy(max_attempts=1))


def test_key_names_model_version_schema_and_row():
    base = cache_key(ModelTarget("credit-risk", "1", "credit-risk/v1"), ROW)
    assert base == cache_key(ModelTarget("credit-risk", "1", "credit-risk/v1"), ROW.copy())
    others = {cache_key(ModelTarget("churn", "1", "credit-risk/v1"), ROW), cache_key(ModelTarget("credit-risk", "2", "credit-risk/v1"), ROW),
              cache_key(ModelTarget("credit-risk", "1", "credit-risk/v2"), ROW),
              cache_key(ModelTarget("credit-risk", "1", "credit-risk/v1"), np.nextafter(ROW, 2, dtype=np.float32))}
    assert base not in others and len(others) == 4


def test_keys_of_a_matrix_are_each_rows_own():
    target = ModelTarget("credit-risk", "1", "credit-risk/v1")
    rows = np.random.default_rng(5).normal(size=(7, ROW.shape[0])).astype(np.float32)
    rows[3] = rows[1]  # equal rows, equal keys
    for matrix in (rows, np.asfortranarray(rows), rows.astype(np.float64), rows[:, :0], rows[:0]):
        assert cache_keys(target, matrix) == [cache_key(target, row) for row in matrix]


def test_key_values_are_the_ones_replicas_share():
    """Pinned: replicas of one release share a Redis cache, so every one must key a row alike
    (a release that changes the layout bumps ``KEY_LAYOUT``); one row at a time and a batch."""
    target = ModelTarget("credit-risk", "1", "credit-risk/v1")
    rows = (np.arange(60, dtype=np.float32).reshape(2, 30) / 7).astype(np.float32)
    pinned = ["v3|credit-risk|1|credit-risk/v1|07cdfe165c49b15cc618e23165dc310d",
              "v3|credit-risk|1|credit-risk/v1|3b59c40114d6b9674f2afc1f8fb3fadf"]
    assert cache_keys(target, rows) == pinned
    assert [cache_key(target, row) for row in rows] == pinned


async def test_memory_cache_ages_entries_out_of_the_stale_window():
    clock = Clock(1000.0)
    cache = MemoryCache(max_entries=10, stale_ttl_s=60, clock=clock)
    await cache.put_many([("k", LOGITS, "1")])
    clock.now += 59
    (entry,) = await cache.get_many(["k"])
    assert entry.model_version == "1" and entry.age_s == pytest.approx(59) and np.array_equal(entry.logits, LOGITS)
    clock.now += 2
    assert await cache.get_many(["k"]) == [None] and len(cache) == 0


async def test_memory_cache_evicts_least_recently_used():
    cache = MemoryCache(max_entries=2, stale_ttl_s=60)
    await cache.put_many([("a", LOGITS, "1"), ("b", LOGITS, "1")])
    await cache.get_many(["a"])  # b is now the least recently used
    await cache.put_many([("c", LOGITS, "1")])
    assert [e is not None for e in await cache.get_many(["a", "b", "c"])] == [True, False, True]


@pytest.fixture
async def redis_cache():
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    clock = Clock(1000.0)
    cache = RedisCache(f"redis://{REDIS_HOST}:{REDIS_PORT}/0", key_prefix=f"mlpair-test:{uuid.uuid4().hex}:",
                       stale_ttl_s=60, timeout_s=1.0, clock=clock)
    yield cache, clock
    keys = [k async for k in cache._redis.scan_iter(match=f"{cache.prefix}*")]
    if keys:
        await cache._redis.delete(*keys)
    await cache.close()


async def test_redis_cache_round_trips_entries_with_age_and_expiry(redis_cache):
    cache, clock = redis_cache
    assert await cache.ping()
    await cache.put_many([("k", LOGITS, "7")])
    clock.now += 12.5
    entry, missing = await cache.get_many(["k", "absent"])
    assert missing is None and entry.model_version == "7" and entry.age_s == pytest.approx(12.5)
    assert np.array_equal(entry.logits, LOGITS)
    ttl_ms = await cache._redis.pttl(cache.prefix + "k")
    assert 0 < ttl_ms <= 60_000  # Redis drops the entry at the end of the stale window


async def test_redis_cache_treats_garbage_and_outages_as_misses(redis_cache):
    cache, _ = redis_cache
    await cache._redis.set(cache.prefix + "bad", b"\x01")
    assert await cache.get_many(["bad"]) == [None]
    down = RedisCache("redis://127.0.0.1:1/0", key_prefix="x:", stale_ttl_s=60, timeout_s=0.2)
    try:
        assert await down.get_many(["k"]) == [None]
        await down.put_many([("k", LOGITS, "1")])  # swallowed: a cache outage never fails a request
        assert not await down.ping()
    finally:
        await down.close()


class CountingClient:
    """The one place a test stands in for InferenceService: an object with the client's
    ``infer`` signature that counts calls, returns fixed logits, or raises what it is given."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.error: Exception | None = None

    async def infer(self, target, features, *, timeout_s=None, callers=None, priority=0):
        self.calls.append(target.version)
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return np.tile(LOGITS, (len(features), 1)), target.version


async def test_c36_a_finished_call_stays_joinable_for_its_linger_each_for_its_own():
    """A finished flight answers requests for its keys for ``linger_s`` after it finished (here
    the cache never holds anything, so only the lingering flight can answer), then is gone; the
    flights finished at different times expire each at its own time."""
    client = CountingClient()
    scorer = wire_scorer(client, NullCache(), caller(), fresh_ttl_s=300, linger_s=1.0)
    target = ModelTarget("m", "1", "s")
    a, b = ROW[None, :], (ROW + 1)[None, :]
    await scorer.score(target, a, None)
    await asyncio.sleep(0.6)
    await scorer.score(target, b, None)
    assert len(client.calls) == 2
    (joined_a,), (joined_b,) = await scorer.score(target, a, None), await scorer.score(target, b, None)
    assert len(client.calls) == 2 and joined_a.source is joined_b.source is Source.INFERENCE  # both lingering
    await asyncio.sleep(0.5)  # a finished 1.1 s ago, b 0.5 s ago (margins for a loaded machine)
    await scorer.score(target, a, None)
    assert len(client.calls) == 3  # a's flight expired: a call of its own
    await scorer.score(target, b, None)
    assert len(client.calls) == 3  # b's still lingers
    await asyncio.sleep(1.1)
    assert not scorer._flights  # every flight expired
    await scorer.close()


async def test_c36_a_model_switch_never_serves_the_old_models_entries():
    from mlpair.prediction.errors import InferenceUnavailable

    client, cache = CountingClient(), MemoryCache(max_entries=10, stale_ttl_s=3600)
    scorer = wire_scorer(client, cache, caller(), fresh_ttl_s=300)
    (first,) = await scorer.score(ModelTarget("credit-risk", "1", "credit-risk/v1"), ROW[None, :], None)
    (again,) = await scorer.score(ModelTarget("credit-risk", "1", "credit-risk/v1"), ROW[None, :], None)
    assert (first.source, again.source, client.calls) == (Source.INFERENCE, Source.CACHE, ["1"])
    (switched,) = await scorer.score(ModelTarget("credit-risk", "2", "credit-risk/v1"), ROW[None, :], None)
    assert switched.source is Source.INFERENCE and client.calls == ["1", "2"]
    client.error = InferenceUnavailable("down")
    (new_schema,) = await scorer.score(ModelTarget("credit-risk", "2", "credit-risk/v2"), ROW[None, :], None)
    assert new_schema.source is Source.FALLBACK and new_schema.logits is None  # the v1 entry is not served, not even stale


async def test_stale_entries_are_served_only_when_inference_is_unavailable():
    from mlpair.prediction.errors import InferenceUnavailable

    clock = Clock(1000.0)
    client = CountingClient()
    scorer = wire_scorer(client, MemoryCache(max_entries=10, stale_ttl_s=60, clock=clock), caller(), fresh_ttl_s=5,
                             linger_s=0)
    await scorer.score(ModelTarget("m", "1", "s"), ROW[None, :], None)
    clock.now += 10  # past the fresh window: inference is called again while it is up
    (refreshed,) = await scorer.score(ModelTarget("m", "1", "s"), ROW[None, :], None)
    assert refreshed.source is Source.INFERENCE and len(client.calls) == 2
    clock.now += 10
    client.error = InferenceUnavailable("down")
    (stale,) = await scorer.score(ModelTarget("m", "1", "s"), ROW[None, :], None)
    assert stale.source is Source.STALE_CACHE and stale.age_ms == 10_000
    assert stale.degraded_reason == "INFERENCE_UNAVAILABLE" and np.array_equal(stale.logits, LOGITS)
    clock.now += 61  # past the stale window: nothing to serve
    (fallback,) = await scorer.score(ModelTarget("m", "1", "s"), ROW[None, :], None)
    assert fallback.source is Source.FALLBACK and fallback.degraded_reason == "INFERENCE_UNAVAILABLE"


async def test_contract_refusals_are_raised_never_served_from_cache():
    from mlpair.prediction.errors import InferenceContractError

    client = CountingClient()
    scorer = wire_scorer(client, NullCache(), caller(), fresh_ttl_s=5)
    client.error = InferenceContractError("refused")
    with pytest.raises(InferenceContractError):
        await scorer.score(ModelTarget("m", "1", "s"), ROW[None, :], None)


async def test_a_batch_scores_each_distinct_row_once_in_one_call():
    client = CountingClient()
    scorer = wire_scorer(client, MemoryCache(max_entries=10, stale_ttl_s=60), caller(), fresh_ttl_s=5)
    rows = np.stack([ROW, ROW + 1, ROW])
    results = await scorer.score(ModelTarget("m", "1", "s"), rows, None)
    assert [r.source for r in results] == [Source.INFERENCE] * 3 and client.calls == ["1"]


def cache_requests(result: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("prediction_cache_requests_total",
                                     {"model": "credit-risk", "result": result}) or 0.0


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_c36_stampede_of_identical_requests_makes_one_inference_call(
        backend, inference_server, model_repository, credit_holdout, tmp_path):
    if backend == "redis":
        require_service("Redis", REDIS_HOST, REDIS_PORT)
    record = credit_holdout.records[3]
    async with inference_forwarder(inference_server) as (target, forwarder):
        settings = prediction_settings(tmp_path, model_repository, target, cache_backend=backend,
                                       redis_key_prefix=f"mlpair-test:{uuid.uuid4().hex}:")
        async with prediction_service(settings) as (stub, predictor, _, _):
            before = {r: cache_requests(r) for r in ("hit", "miss", "coalesced")}
            replies = await asyncio.gather(*(stub.Predict(pb.PredictRequest(
                request_id=f"c36-{backend}-{i}", entity_id=f"e{i}", attributes=to_attributes(record)), timeout=30)
                for i in range(200)))
            assert forwarder.calls == 1
            seen = {r: cache_requests(r) - before[r] for r in before}
            assert seen["miss"] == 1 and seen["hit"] + seen["coalesced"] == 199
            assert len({(r.decision, r.probability, tuple(r.reason_codes)) for r in replies}) == 1
            assert len({r.decision_id for r in replies}) == 200  # 200 request ids, 200 decisions on record
            assert not any(r.stale or r.fallback for r in replies)
            assert await predictor.recorder.wait_delivered(20) and await predictor.crm.count() == 200


async def test_c22_shared_call_is_cancelled_only_when_every_waiter_has_gone(inference_server, credit_entry):
    async with inference_forwarder(inference_server) as (target, forwarder):
        forwarder.delay_s = 30.0
        client = InferenceClient(target, timeout_ms=60_000, max_message_bytes=1 << 20)
        scorer = wire_scorer(client, MemoryCache(max_entries=10, stale_ttl_s=60), caller(), fresh_ttl_s=5)
        row = np.zeros((1, credit_entry.manifest.n_features), np.float32)
        args = (ModelTarget("credit-risk", credit_entry.manifest.model_version, credit_entry.manifest.versions.feature_schema_version), row)
        try:
            waiters = [asyncio.ensure_future(scorer.score(*args, None)) for _ in range(3)]
            while forwarder.calls < 1:
                await asyncio.sleep(0.01)
            waiters[0].cancel()  # the leader's caller leaves; the other two still wait
            waiters[1].cancel()
            await asyncio.sleep(0.2)
            assert forwarder.cancelled == 0 and forwarder.calls == 1
            waiters[2].cancel()  # the last one leaves: the Infer call is cancelled at InferenceService
            await asyncio.gather(*waiters, return_exceptions=True)
            for _ in range(100):
                if forwarder.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert forwarder.cancelled == 1
        finally:
            await scorer.close()
            await client.close()


def invalid_reads(backend: str, cause: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("prediction_cache_invalid_total", {"backend": backend, "cause": cause}) or 0.0


async def test_every_entry_read_from_redis_is_checked_and_a_poisoned_one_is_a_counted_miss(redis_cache):
    """Other processes write the shared cache: an entry this process would not have written is a
    miss (inference is called), counted by cause, never served — not even stale — and never an error."""
    import struct

    from mlpair.prediction.errors import InferenceUnavailable
    from mlpair.prediction.scoring.redis_backend import MAX_VALUE_BYTES

    cache, clock = redis_cache
    rows = np.stack([ROW + i for i in range(8)])
    keys = [cache_key(ModelTarget("m", "1", "s"), row) for row in rows]
    await cache.put_many([(keys[0], LOGITS, "1")])
    good = await cache._redis.get(cache.prefix + keys[0])

    async def poison(i: int, value: bytes) -> None:
        await cache._redis.set(cache.prefix + keys[i], value)

    def rewritten(logits=LOGITS, version=b"1", stored_at=None, digest=None) -> bytes:
        tag, own_digest, at, _ = struct.unpack_from("<4s16sdH", good)
        return struct.pack("<4s16sdH", tag, own_digest if digest is None else digest,
                           at if stored_at is None else stored_at, len(version)) + version + logits.astype("<f4").tobytes()

    await poison(1, good)  # key 0's value copied under key 1
    await poison(2, rewritten(logits=np.array([np.nan, 1.0], np.float32), digest=hashlib_digest(keys[2])))
    await poison(3, rewritten(version=b"2", digest=hashlib_digest(keys[3])))
    await poison(4, rewritten(logits=np.array([1.0, 2.0, 3.0], np.float32), digest=hashlib_digest(keys[4])))
    await poison(5, rewritten(stored_at=clock.now + 3600, digest=hashlib_digest(keys[5])))
    await poison(6, good[:-1] + b"\x00" * MAX_VALUE_BYTES)
    await poison(7, struct.pack("<dH", clock.now, 1) + b"1" + LOGITS.astype("<f4").tobytes())  # the old layout
    causes = ["key", "nonfinite", "version", "shape", "clock", "size", "format"]
    before = {c: invalid_reads("redis", c) for c in causes}

    client = CountingClient()
    scorer = wire_scorer(client, cache, caller(), fresh_ttl_s=30, linger_s=0)
    scored = await scorer.score(ModelTarget("m", "1", "s"), rows, None, n_classes=2)
    assert [s.source for s in scored] == [Source.CACHE] + [Source.INFERENCE] * 7  # poisoned: misses
    assert all(np.array_equal(s.logits, LOGITS) for s in scored)
    assert {c: invalid_reads("redis", c) - before[c] for c in causes} == dict.fromkeys(causes, 1)

    for i in range(1, 8):  # poisoned again, then inference goes down: none is served, not even stale
        await cache._redis.set(cache.prefix + keys[i], b"\x01")
    client.error = InferenceUnavailable("down")
    scored = await scorer.score(ModelTarget("m", "1", "s"), rows, None, n_classes=2)
    assert [s.source for s in scored] == [Source.CACHE] + [Source.FALLBACK] * 7


def hashlib_digest(key: str) -> bytes:
    import hashlib

    return hashlib.blake2b(key.encode(), digest_size=16).digest()


async def test_memory_entries_are_checked_too():
    cache = MemoryCache(max_entries=10, stale_ttl_s=60)
    keys = [cache_key(ModelTarget("m", "1", "s"), ROW + i) for i in range(3)]
    await cache.put_many([(keys[0], np.array([np.inf, 0.0], np.float32), "1"), (keys[1], LOGITS, "9"),
                          (keys[2], LOGITS.astype(np.float64), "1")])
    before = sum(invalid_reads("memory", c) for c in ("nonfinite", "version", "shape"))
    client = CountingClient()
    scored = await wire_scorer(client, cache, caller(), fresh_ttl_s=30).score(
        ModelTarget("m", "1", "s"), np.stack([ROW + i for i in range(3)]), None, n_classes=2)
    assert [s.source for s in scored] == [Source.INFERENCE] * 3
    assert sum(invalid_reads("memory", c) for c in ("nonfinite", "version", "shape")) - before == 3


async def test_a_leaders_tight_deadline_makes_no_joined_request_fall_back(inference_server, credit_entry):
    """Single-flight shares a call; the call runs on its first request's budget. A request that
    joined it with more budget left gets a call of its own when that budget runs out."""
    import time

    async with inference_forwarder(inference_server) as (target, forwarder):
        forwarder.delay_s = 0.3  # slower than the leader's budget, well inside the joiner's
        client = InferenceClient(target, timeout_ms=10_000, max_message_bytes=1 << 20)
        scorer = wire_scorer(client, MemoryCache(max_entries=10, stale_ttl_s=60), caller(), fresh_ttl_s=5)
        row = np.zeros((1, credit_entry.manifest.n_features), np.float32)
        args = (ModelTarget("credit-risk", credit_entry.manifest.model_version, credit_entry.manifest.versions.feature_schema_version), row)
        try:
            now = time.monotonic()
            leader = asyncio.ensure_future(scorer.score(*args, now + 0.12))
            await asyncio.sleep(0)
            joined = asyncio.ensure_future(scorer.score(*args, now + 10.0))
            (led,), (follower,) = await asyncio.gather(leader, joined)
        finally:
            await scorer.close()
            await client.close()
    assert (led.source, led.degraded_reason) == (Source.FALLBACK, "INFERENCE_TIMEOUT")  # its own budget
    assert follower.source is Source.INFERENCE and forwarder.calls == 2


@pytest.mark.parametrize("case", ["one call in order", "one call shuffled", "two calls", "a key twice", "another width"])
def test_rows_of_a_call_are_each_keys_own_answer(case):
    """``_scored_rows`` takes one call's matrix whole when it answered every row in order; every
    other arrangement goes row by row. Either way row ``i`` holds its own key's logits."""
    from mlpair.prediction.scoring.cache import _Answer, _scored_rows

    rng = np.random.default_rng(11)
    keys = [f"k{i}" for i in range(6)]

    def answer(for_keys, version="1", width=2):
        return _Answer(rng.normal(size=(len(for_keys), width)).astype(np.float32), version, {k: i for i, k in enumerate(for_keys)})

    if case == "one call in order":
        answers = [answer(keys)]
    elif case == "one call shuffled":
        answers = [answer([keys[i] for i in (3, 0, 5, 1, 4, 2)])]
    elif case == "two calls":
        answers = [answer(keys[:2], "1"), answer(keys[2:], "2")]
    elif case == "a key twice":
        answers = [answer(keys)]
        keys = [*keys, keys[2]]
    else:
        answers = [answer(keys, width=3)]
    inferred = {k: a for a in answers for k in a.row_of}
    rows = _scored_rows(keys, {}, inferred, 2)
    for i, key in enumerate(keys):
        own = inferred[key]
        expected = own.logits[own.row_of[key]] if own.logits.shape[1] == 2 else np.full(2, np.nan, dtype=np.float32)
        np.testing.assert_array_equal(rows.logits[i], expected)
        assert (rows.sources[i], rows.model_versions[i], rows.age_ms[i], rows.degraded_reasons[i]) == (
            Source.INFERENCE, own.version, 0, "")
    assert rows.logits.dtype == np.float32 and not any(rows.logits is a.logits for a in answers)
    assert not np.shares_memory(rows.logits, answers[0].logits)
