"""PredictColumns across replicas, with real processes (``conftest.replicas``: one InferenceService
whose logits are NaN for applicants of 95+, two PredictionService replicas, one ledger and one CRM
in PostgreSQL, cache off). The same table sent to both replicas at once, among bad rows and other
callers' Predicts: each request id decided once, exact counts in the ledger and the CRM."""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
import pyarrow as pa
import pytest

from mlpair.client.tables import chunk_result, request_chunks
from mlpair.prediction.recording.models import LEDGER_SCHEMA, LEDGER_TABLE
from tests import nonfinite
from tests.e2e.replicas import crm_rows, request

pytestmark = pytest.mark.timeout(300)
ROWS, BAD, OTHER_CALLS = 300, 15, 40


def chunk(ids: list[str], records: list[dict]) -> pa.Table:
    columns = {"request_id": ids, "entity_id": [f"e-{i}" for i in ids]}
    for name in dict.fromkeys(n for r in records for n in r):
        columns[name] = [r.get(name) for r in records]
    return pa.table(columns)


async def decide(stub, table: pa.Table):
    [result] = [chunk_result(reply) async for reply in stub.PredictColumns(request_chunks([table], "credit-risk"),
                                                                          timeout=120)]
    return result


async def test_one_table_sent_to_two_replicas_at_once_is_decided_once_per_row(replicas, credit_holdout, postgres_url):
    stubs = replicas.stubs[:2]
    good = list(credit_holdout.records[:ROWS - BAD])
    records = good + [nonfinite.bad(r) for r in credit_holdout.records[:BAD]]  # unusable model output: fallback
    ids = [f"cols-rep-{i}" for i in range(ROWS)]
    table = chunk(ids + [ids[0]], records + [records[0]])  # and an id repeated in the chunk: that row refused

    async def other_caller(n: int):
        try:
            return await stubs[n % 2].Predict(request(f"cols-rep-other-{n}", good[n]), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc

    first, second, *others = await asyncio.gather(decide(stubs[0], table), decide(stubs[1], table),
                                                  *(other_caller(n) for n in range(OTHER_CALLS)))
    assert first.error is None and second.error is None
    # every row decided exactly once between the two replicas; the other answered with that decision
    assert first.decided + second.decided == ROWS and first.replayed + second.replayed == ROWS
    assert first.failed == second.failed == 1  # the repeated id, each time
    a, b = first.decisions.to_pylist(), second.decisions.to_pylist()
    for x, y in zip(a[:ROWS], b[:ROWS]):
        assert (x["decision_id"], x["decision"], x["probability"]) == (y["decision_id"], y["decision"], y["probability"])
        assert x["replayed"] != y["replayed"]
    assert [x["reason_codes"][0] for x in a[ROWS - BAD:ROWS]] == ["MODEL_OUTPUT_INVALID"] * BAD
    assert all(x["served_from"] == "inference" for x in a[:ROWS - BAD])
    assert a[ROWS]["error_code"] == b[ROWS]["error_code"] == "INVALID_ARGUMENT"
    # the other callers were decided normally meanwhile
    assert all(not isinstance(r, grpc.aio.AioRpcError) and not r.fallback for r in others)

    conn = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        ledger = await conn.fetchval(
            f"SELECT count(*) FROM {LEDGER_SCHEMA}.{LEDGER_TABLE} WHERE request_id LIKE 'cols-rep-%' "
            "AND request_id NOT LIKE 'cols-rep-other-%'")
    finally:
        await conn.close()
    assert ledger == ROWS
    for _ in range(100):  # each replica's relay delivers what it recorded, once
        delivered = await crm_rows(replicas.crm_url, ids)
        if len(delivered) == ROWS:
            break
        await asyncio.sleep(0.2)
    assert len(delivered) == ROWS and all(len(rows) == 1 for rows in delivered.values())
