"""Property: whatever bad callers share a coalescing window and an InferenceService batch with, every
good caller's answer is its solo answer — no fallback, no circuit-breaker transition.

Hypothesis draws a mix of good callers and every kind of bad one this project can produce: a row
whose model output is NaN (``tests.nonfinite``), an 8 KB trace header, a poisoned entry in the
shared Redis cache, an attribute value that is refused, a caller that cancels, a caller whose
deadline expires. They call one PredictionService at once; its Infer calls pass a forwarder that
holds each for 50 ms, so everyone queued behind the first call travels together in the next one,
into one InferenceService batch. Each good (and poisoned, and big-header) caller's request is also
sent alone to a second PredictionService without a cache: the answers must be equal, probability
bit for bit. The breaker opens at the first counted failure, so any failure a bad caller caused
for the call it shared would show as a transition.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.scoring.cache import cache_key
from tests import nonfinite
from tests.e2e.conftest import inference_service, prediction_service
from tests.fault_support import inference_forwarder
from tests.support import require_service
from tests.support.e2e import big_tracestate, decided, traceparent

pytestmark = pytest.mark.timeout(300)
MODEL = "credit-risk"
BAD_KINDS = ("nonfinite", "big_header", "poisoned", "refused", "cancelled", "expired")
POISONS = ("nonfinite", "wrong_width", "wrong_version", "other_key", "garbage")
_fresh = itertools.count()  # every caller's row is new: no cache hit, no single-flight across examples


@pytest.fixture(scope="module")
async def services(nonfinite_repository, tmp_path_factory):
    require_service("Redis", "127.0.0.1", 6379)
    async with inference_service(nonfinite_repository, max_queue_delay_ms=5) as inference, \
            inference_forwarder(inference) as (target, forwarder):
        forwarder.delay_s = 0.05
        async with prediction_service(target, nonfinite_repository, tmp_path_factory.mktemp("mixed"),
                                      cache_backend="redis", redis_key_prefix=f"mlpair-test:{uuid.uuid4().hex}:",
                                      coalesce_max_delay_ms=200, breaker_failure_threshold=1) as mixed, \
                prediction_service(inference, nonfinite_repository, tmp_path_factory.mktemp("solo"),
                                   cache_backend="off") as solo:
            yield mixed, solo, forwarder


def transitions() -> float:
    return sum(REGISTRY.get_sample_value("prediction_circuit_transitions_total",
                                         {"dependency": "inference", "state": s}) or 0.0
               for s in ("OPEN", "HALF_OPEN", "CLOSED"))


async def poison(predictor, record: dict, how: str) -> None:
    """Writes a bad entry for ``record``'s row into the shared cache, as another process might."""
    family = predictor.families[MODEL]
    version = family.members[0].version
    row = family.assembler.assemble(record).vector
    key = cache_key(ModelTarget(MODEL, version, family.feature_version), row)
    cache = predictor.scorer.cache
    good_logits = np.array([0.3, -0.2], np.float32)
    if how == "nonfinite":
        await cache.put_many([(key, np.array([np.nan, 1.0], np.float32), version)])
    elif how == "wrong_width":
        await cache.put_many([(key, np.array([1.0, 2.0, 3.0], np.float32), version)])
    elif how == "wrong_version":
        await cache.put_many([(key, good_logits, "999")])
    elif how == "other_key":  # a well-formed value of another row, copied under this row's key
        other = cache_key(ModelTarget(MODEL, version, family.feature_version), row + 1)
        await cache.put_many([(other, good_logits, version)])
        await cache._redis.set(cache.prefix + key, await cache._redis.get(cache.prefix + other))
    else:
        await cache._redis.set(cache.prefix + key, b"\x00\x01garbage")


callers = st.tuples(st.integers(1, 5), st.lists(st.sampled_from(BAD_KINDS), min_size=1, max_size=6),
                    st.lists(st.sampled_from(POISONS), min_size=6, max_size=6),
                    st.lists(st.floats(0.0, 0.04), min_size=6, max_size=6))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=callers)
async def test_no_bad_caller_changes_a_good_callers_answer(services, credit_holdout, mix):
    (stub, predictor), (solo_stub, _), forwarder = services
    n_good, bad, poisons, delays = mix
    kinds = ["good"] * n_good + bad
    plan = []
    for i, kind in enumerate(kinds):
        n = next(_fresh)
        record = dict(credit_holdout.records[n % 300])
        record["Amount"] = 500 + n  # a row of its own
        plan.append((f"prop-{uuid.uuid4().hex[:12]}", kind, record, poisons[i % 6], delays[i % 6]))

    solo = {}
    for rid, kind, record, how, _ in plan:
        if kind in ("good", "poisoned", "big_header"):
            solo[rid] = decided(await solo_stub.Predict(request(rid, record), timeout=20))
        if kind == "poisoned":
            await poison(predictor, record, how)
    before, calls_before = transitions(), forwarder.calls

    async def call(rid: str, kind: str, record: dict, delay: float):
        if kind == "nonfinite":
            record = nonfinite.bad(record)
        elif kind == "refused":
            record = {**record, "Age": "not a number"}
        metadata = (("traceparent", traceparent()[0]), ("tracestate", big_tracestate())) if kind == "big_header" else ()
        timeout = 0.005 + delay if kind == "expired" else 20
        pending = stub.Predict(request(rid, record), metadata=metadata, timeout=timeout)
        if kind == "cancelled":
            await asyncio.sleep(delay)
            pending.cancel()
        try:
            return await pending
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            return exc

    replies = await asyncio.gather(*(call(rid, kind, record, delay) for rid, kind, record, _, delay in plan))

    for (rid, kind, *_), reply in zip(plan, replies):
        if kind in ("good", "poisoned"):
            assert isinstance(reply, pb.PredictResponse), (kind, reply)
            assert decided(reply) == solo[rid] and not reply.fallback, kind
        elif kind == "big_header":  # decided like the rest, or refused up front by gRPC itself
            assert (decided(reply) == solo[rid] if isinstance(reply, pb.PredictResponse)
                    else reply.code() == grpc.StatusCode.RESOURCE_EXHAUSTED), reply
        elif kind == "nonfinite":
            assert (reply.decision_label, reply.reason_codes[0]) == ("REVIEW", "MODEL_OUTPUT_INVALID")
        elif kind == "refused":
            assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert transitions() == before and predictor.scorer.caller.breaker.state.name == "CLOSED"
    # the callers really shared calls (else the property would be vacuous): the rows that must reach
    # InferenceService went in at most half as many calls (two at least: one coalescing window may close
    # while a busy event loop is still reading the last requests)
    reaching = sum(kind in ("good", "poisoned", "nonfinite") for kind in kinds)
    assert forwarder.calls - calls_before <= max(2, reaching // 2), (forwarder.calls - calls_before, reaching)


def request(rid: str, record: dict) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=rid, entity_id=f"entity-{rid}", model_name=MODEL,
                             attributes=to_attributes(record))
