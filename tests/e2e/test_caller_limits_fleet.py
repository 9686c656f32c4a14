"""Per-caller limits shared by a fleet (issue 40's target), with real processes and a real Redis.

Three PredictionService replicas share one decision ledger and CRM (PostgreSQL) and one Redis that
holds the callers' limits. Caller A (limited to 50 decisions/s) sends 200 Predicts/s and caller B
(not limited) 50/s, spread round-robin over the replicas, open loop, for the issue's 30 s
(``MLPAIR_FLEET_LIMIT_S`` sets another length): A's accepted rate across the
fleet is 50/s ± 10 % (GCRA admits the rate plus one burst, 10 decisions here), B is never refused,
and every refused call is absent from the ledger and the CRM, counted exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import asyncpg
import grpc
import pytest
from sqlalchemy import make_url

from mlpair.rpc import error_info
from tests.e2e.replicas import cluster, request
from tests.support import require_service
from tests.support.pair import scratch_postgres

DURATION_S = float(os.environ.get("MLPAIR_FLEET_LIMIT_S", "30"))
A_RATE, A_SENT_PER_S, B_SENT_PER_S, BURST_S = 50, 200, 50, 0.2
pytestmark = pytest.mark.timeout(240 + 3 * DURATION_S)


async def ledger_callers(url: str, prefix: str) -> dict[str, str]:
    u = make_url(url)
    conn = await asyncpg.connect(host=u.host, port=u.port, user=u.username, database=u.database)
    try:
        rows = await conn.fetch("SELECT request_id, caller FROM prediction.decision_ledger WHERE request_id LIKE $1",
                                prefix + "%")
    finally:
        await conn.close()
    return {r["request_id"]: r["caller"] for r in rows}


async def crm_callers(url: str, prefix: str) -> dict[str, str]:
    u = make_url(url)
    conn = await asyncpg.connect(host=u.host, port=u.port, user=u.username, database=u.database)
    try:
        rows = await conn.fetch("SELECT request_id, caller FROM decisions WHERE request_id LIKE $1", prefix + "%")
    finally:
        await conn.close()
    return {r["request_id"]: r["caller"] for r in rows}


@pytest.fixture
def postgres_url():
    """A database of this test's own (a sync fixture: creating it runs its own short event loop)."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    with scratch_postgres(prefix="mlpair_fleet_limits") as url:
        yield url


async def test_a_caller_over_its_limit_is_held_to_it_across_replicas_and_others_are_untouched(
        model_repository, credit_holdout, tmp_path, postgres_url):
    require_service("Redis", "127.0.0.1", 6379)
    prefix = f"fleet-{uuid.uuid4().hex[:8]}-"
    env = {"PREDICTION_CALLER_SOURCE": "header", "PREDICTION_CALLER_LIMITS": json.dumps({"A": A_RATE}),
           "PREDICTION_CALLER_BURST_S": str(BURST_S), "PREDICTION_CALLER_LIMIT_BACKEND": "redis",
           "PREDICTION_CALLER_LIMIT_REDIS_FAILURE": "closed", "PREDICTION_REDIS_TIMEOUT_MS": "1000",
           "PREDICTION_REDIS_KEY_PREFIX": f"mlpair-test:{uuid.uuid4().hex}:", "PREDICTION_WORKERS": "1"}
    async with cluster(tmp_path, model_repository, postgres_url, replicas=3, **env) as c:
        records = credit_holdout.records
        outcomes: dict[str, str] = {}  # request id → OK or the status's reason

        async def call(k: int, caller: str, request_id: str) -> None:
            stub = c.stubs[k % len(c.stubs)]
            try:
                await stub.Predict(request(request_id, records[k % len(records)]), timeout=30,
                                   metadata=(("x-caller-id", caller),))
                outcomes[request_id] = "OK"
            except grpc.aio.AioRpcError as exc:
                info = error_info(exc)
                outcomes[request_id] = info.reason if info else exc.code().name

        async def send(caller: str, per_s: int, start: float) -> list[asyncio.Task]:
            tasks = []
            for k in range(int(per_s * DURATION_S)):
                await asyncio.sleep(max(0.0, start + k / per_s - time.monotonic()))
                tasks.append(asyncio.create_task(call(k, caller, f"{prefix}{caller}-{k}")))
            return tasks

        start = time.monotonic() + 0.5
        sent = await asyncio.gather(send("A", A_SENT_PER_S, start), send("B", B_SENT_PER_S, start))
        await asyncio.gather(*(t for tasks in sent for t in tasks))

        def of(caller: str, outcome: str) -> set[str]:
            return {r for r, o in outcomes.items() if r.startswith(f"{prefix}{caller}-") and o == outcome}

        a_ok, a_limited, b_ok = of("A", "OK"), of("A", "CALLER_RATE_LIMITED"), of("B", "OK")
        assert len(a_ok) + len(a_limited) == A_SENT_PER_S * DURATION_S, sorted(set(outcomes.values()))
        assert len(b_ok) == B_SENT_PER_S * DURATION_S, sorted(set(outcomes.values()))  # B: none refused
        assert abs(len(a_ok) / DURATION_S - A_RATE) <= 0.1 * A_RATE, len(a_ok)

        ledger = await ledger_callers(postgres_url, prefix)
        assert set(ledger) == a_ok | b_ok  # every refused call absent, every accepted one present
        assert {caller for r, caller in ledger.items() if r in a_ok} == {"A"}
        assert {caller for r, caller in ledger.items() if r in b_ok} == {"B"}
        for _ in range(200):  # the relays deliver every recorded decision to the CRM
            crm = await crm_callers(postgres_url, prefix)
            if len(crm) >= len(ledger):
                break
            await asyncio.sleep(0.1)
        assert crm == ledger
