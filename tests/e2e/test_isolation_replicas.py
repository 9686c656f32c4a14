"""One bad row fails no other caller, across replicas (C43), with real processes.

One InferenceService process serving a credit-risk entry whose logits are NaN for applicants of
95+ (``tests.nonfinite``) and two PredictionService replicas in front of it (cache off: every
answer comes from an Infer call merged with other callers' rows), sharing one decision ledger and
one CRM in PostgreSQL (``conftest.replicas``, shared with C40–C42); a round-robin client drives
them. Exact counts.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from tests import nonfinite
from tests.e2e.replicas import crm_rows, request

pytestmark = pytest.mark.timeout(300)
REPLICAS = 2  # the healthy ones (conftest.replicas has a third that cannot reach InferenceService)
CALLS, BAD, IN_FLIGHT, ROUNDS = 200, 10, 32, 3


def decided(reply: pb.PredictResponse) -> tuple:
    return (reply.decision_label, reply.probability, list(reply.reason_codes), reply.model_version,
            reply.fallback, reply.stale, reply.degraded_reason)


def merged_calls(replica) -> int:
    """Infer calls that carried more than one caller's rows, from the replica's own metrics."""
    port = replica.env["PREDICTION_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ('prediction_coalesced_call_flights_bucket{le="1.0",model="credit-risk"}',
                     'prediction_coalesced_call_flights_count{model="credit-risk"}'):
            if line.startswith(name + " "):
                values[name.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return int(values.get("prediction_coalesced_call_flights_count", 0) - values.get("prediction_coalesced_call_flights_bucket", 0))


async def test_c43_200_concurrent_predicts_with_10_bad_fail_0_of_190_good_calls(replicas, credit_holdout):
    stubs = replicas.stubs[:REPLICAS]
    records = credit_holdout.records[:CALLS - BAD]
    # each good applicant alone, one call at a time: the answer every concurrent call must equal
    solo = [decided(await stubs[i % REPLICAS].Predict(request(f"c43-solo-{i}", r), timeout=20))
            for i, r in enumerate(records)]
    assert not any(s[4] for s in solo)  # no fallback among them
    bad_at = set(range(0, CALLS, CALLS // BAD))  # every 20th call is a bad applicant
    limit = asyncio.Semaphore(IN_FLIGHT)

    async def call(n: int, rid: str, record: dict):
        async with limit:
            try:
                return await stubs[n % REPLICAS].Predict(request(rid, record), timeout=20)
            except grpc.aio.AioRpcError as exc:
                return exc

    for round_ in range(ROUNDS):
        plan, good = [], iter(range(len(records)))
        for n in range(CALLS):
            plan.append(("bad", n % len(records)) if n in bad_at else ("good", next(good)))
        replies = await asyncio.gather(*(
            call(n, f"c43-r{round_}-{n}", nonfinite.bad(records[i]) if kind == "bad" else records[i])
            for n, (kind, i) in enumerate(plan)))
        good_failed = [(n, r) for n, ((kind, i), r) in enumerate(zip(plan, replies))
                       if kind == "good" and (isinstance(r, grpc.aio.AioRpcError) or decided(r) != solo[i])]
        bad_answers = [r for (kind, _), r in zip(plan, replies) if kind == "bad"]
        assert len(good_failed) == 0, good_failed[:3]  # 0 of 190
        assert [(r.decision_label, r.reason_codes[0], r.fallback) for r in bad_answers] == \
            [("REVIEW", "MODEL_OUTPUT_INVALID", True)] * BAD
    assert sum(merged_calls(r) for r in replicas.replicas[:REPLICAS]) > 0  # good and bad rows did share calls

    bad_ids = [f"c43-r0-{n}" for n in sorted(bad_at)]
    for _ in range(100):  # the relays deliver the bad rows' decisions to the CRM like any other
        rows = await crm_rows(replicas.crm_url, bad_ids)
        if len(rows) == BAD:
            break
        await asyncio.sleep(0.1)
    assert sorted((found[0].decision, found[0].probability) for found in rows.values()) == [("REVIEW", None)] * BAD
