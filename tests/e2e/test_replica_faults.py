"""Three PredictionService replicas under a bounded burst with faults, then every request id retried
against every replica: one decision per request id, none lost, none doubled, none contradicted.

Real processes over one InferenceService; the ledger and the CRM share one PostgreSQL database,
each through its own TCP proxy. The burst goes round robin over the replicas, 16 calls in flight:

1. replica 2 is killed (SIGKILL) a third of the way through the first phase;
2. the CRM is cut for the whole second phase (serving goes on: decisions wait in the ledger);
3. the ledger is cut for the whole third phase (fail closed: nothing is acknowledged);
4. everything is restored, replica 2 restarted, and every request id is sent again to every
   replica, together with a reused-id call (another applicant) per id.

Exact counts: CRM rows == acknowledged request ids (after the retries, every id), 0 duplicates,
0 answers that differ from the CRM row of their id, every reused-id call refused.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from tests.e2e.replicas import cluster, contradicts, crm_rows, refusal_reason, request

pytestmark = pytest.mark.timeout(300)
PHASE_IDS = 120  # request ids per phase
IN_FLIGHT = 16
RETRY_ATTEMPTS = 20  # a client's retries of one call while a replica's connections recover


async def burst(stubs, ids: list[str], records, on_call=None) -> tuple[dict[str, pb.PredictResponse], dict[str, str]]:
    """Sends each id once, round robin over ``stubs``; returns (acknowledged answers, failures by code)."""
    acknowledged: dict[str, pb.PredictResponse] = {}
    failed: dict[str, str] = {}
    order = itertools.count()
    semaphore = asyncio.Semaphore(IN_FLIGHT)

    async def one(k: int, rid: str) -> None:
        async with semaphore:
            n = next(order)
            if on_call is not None:
                await on_call(n)
            try:
                acknowledged[rid] = await stubs[k % len(stubs)].Predict(request(rid, records[k % len(records)]),
                                                                       timeout=10)
            except grpc.aio.AioRpcError as error:
                failed[rid] = error.code().name

    await asyncio.gather(*(one(k, rid) for k, rid in enumerate(ids)))
    return acknowledged, failed


async def call_until_answered(stub, message: pb.PredictRequest):
    """One caller's call with retries on UNAVAILABLE (what a business system's client does);
    returns the answer or the final error."""
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return await stub.Predict(message, timeout=10)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == RETRY_ATTEMPTS - 1:
                return error
            await asyncio.sleep(0.25)


async def test_three_replicas_keep_one_decision_per_request_id_through_kills_and_outages(
        model_repository, postgres_url, credit_holdout, tmp_path):
    records = credit_holdout.records[:60]
    async with cluster(tmp_path, model_repository, postgres_url, replicas=3, proxied=("ledger", "crm")) as c:
        killed = c.replicas[1]

        async def kill_at_a_third(n: int) -> None:
            if n == PHASE_IDS // 3 and killed.alive():
                await asyncio.to_thread(killed.kill)

        ids = [f"fault-{phase}-{i}" for phase in range(3) for i in range(PHASE_IDS)]
        phase1, phase2, phase3 = (ids[k * PHASE_IDS:(k + 1) * PHASE_IDS] for k in range(3))
        ack1, failed1 = await burst(c.stubs, phase1, records, kill_at_a_third)
        await c.proxies["crm"].cut()
        ack2, failed2 = await burst(c.stubs, phase2, records)
        await c.proxies["crm"].restore()
        await c.proxies["ledger"].cut()
        ack3, failed3 = await burst(c.stubs, phase3, records)
        await c.proxies["ledger"].restore()
        await asyncio.to_thread(killed.start)

        # what each phase did: the kill failed calls (some may have been committed before the
        # process died); the CRM outage failed nothing on the live replicas; the ledger outage
        # acknowledged nothing
        assert failed1 and len(ack1) + len(failed1) == PHASE_IDS
        assert set(failed2.values()) <= {"UNAVAILABLE"} and len(failed2) == len(phase2[1::3])  # only the dead replica's
        assert not ack3 and set(failed3.values()) == {"UNAVAILABLE"}
        acknowledged = {**ack1, **ack2}
        # decisions the killed replica committed but never answered: their retries are replays too
        committed_unanswered = await on_record(postgres_url, [rid for rid in ids if rid not in acknowledged])

        # every id sent again to every replica, and each id once more with another applicant
        limit = asyncio.Semaphore(2 * IN_FLIGHT)

        async def bounded(stub, message):
            async with limit:
                return await call_until_answered(stub, message)

        retries = [(rid, k, request(rid, records[i % len(records)]))
                   for i, rid in enumerate(ids) for k in range(3)]
        answers = await asyncio.gather(*(bounded(c.stubs[k], m) for _, k, m in retries))
        reused = await asyncio.gather(*(bounded(c.stubs[i % 3], request(rid, records[(i + 1) % len(records)],
                                                                         entity_id=f"other-{rid}"))
                                        for i, rid in enumerate(ids)))

        errors = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
        assert errors == []
        for rid, first in acknowledged.items():  # nothing acknowledged was lost or changed
            assert all(a.decision_id == first.decision_id and a.decision_label == first.decision_label
                       and a.probability == first.probability
                       for (r, _, _), a in zip(retries, answers) if r == rid)
        refused = [e for e in reused if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.ALREADY_EXISTS
                   and refusal_reason(e) == "IDEMPOTENCY_KEY_REUSED"]
        assert len(refused) == len(ids)

        for _ in range(300):  # the relays drain the backlog the CRM outage left
            fault_rows = await crm_rows(c.crm_url, ids)
            if len(fault_rows) == len(ids):
                break
            await asyncio.sleep(0.1)
    assert len(fault_rows) == len(ids)  # CRM rows == acknowledged request ids (every id, after the retries)
    assert all(len(found) == 1 for found in fault_rows.values())  # 0 duplicates
    contradicting = [(rid, contradicts(a, fault_rows[rid][0])) for (rid, _, _), a in zip(retries, answers)
                     if contradicts(a, fault_rows[rid][0])]
    contradicting += [(rid, contradicts(a, fault_rows[rid][0])) for rid, a in acknowledged.items()
                      if contradicts(a, fault_rows[rid][0])]
    assert contradicting == []  # 0 answers differ from the CRM row of their id
    # each id not acknowledged in the burst was decided once, by its first retry, unless the killed
    # replica had already committed it
    unacknowledged = len(ids) - len(acknowledged)
    assert sum(1 for a in answers if not a.replayed) == unacknowledged - len(committed_unanswered)


async def on_record(postgres_url: str, request_ids: list[str]) -> set[str]:
    """The request ids the ledger holds (read directly from its table)."""
    import asyncpg
    from sqlalchemy import make_url

    conn = await asyncpg.connect(make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        rows = await conn.fetch("SELECT request_id FROM prediction.decision_ledger WHERE request_id = ANY($1::text[])",
                                request_ids)
    finally:
        await conn.close()
    return {row[0] for row in rows}
