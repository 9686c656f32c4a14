"""The ledger's bulk path (a BatchPredict's decisions as columns, one statement): exactly one row
per request id, replays and repeats answered as the group commit answers them, exact counts."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from mlpair.prediction.errors import LedgerUnavailable
from mlpair.prediction.recording.recorder import DecisionRecorder
from mlpair.prediction.records import DecisionColumns, RecordedBatch, decision_id_for
from tests.support.ledger import opened_ledger

pytestmark = pytest.mark.timeout(120)


def columns(request_ids: list[str], fingerprint: str = "fp", decision: str = "APPROVE") -> DecisionColumns:
    n = len(request_ids)
    now = datetime.now(UTC)
    return DecisionColumns(
        list(request_ids), [decision_id_for(r) for r in request_ids], [f"e-{r}" for r in request_ids],
        ["credit-risk"] * n, ["1"] * n, ["credit-risk/v1"] * n, ["policy/v1"] * n,
        [0.125 if i % 5 else None for i in range(n)], [decision] * n,
        [("LOW_DEFAULT_RISK",) if i % 3 else ("A", "B_MISSING_DEFAULTED") for i in range(n)],
        ["inference"] * n, [0] * n, [""] * n, [now] * n, [f"caller-{i % 2}" for i in range(n)], [fingerprint] * n)


@pytest.fixture
async def recorder(migrated_postgres):
    recorder = DecisionRecorder.open(migrated_postgres, migrated_postgres, ledger_timeout_s=15.0, linger_s=0.0)
    await recorder.start()
    try:
        yield recorder
    finally:
        await recorder.close()


async def ledger_rows(ledger) -> int:
    async with ledger._connection() as conn:
        return int(await conn.fetchval('SELECT count(*) FROM "prediction".decision_ledger'))


async def test_a_batch_with_repeats_and_replays_records_exactly_one_row_per_new_request_id(recorder):
    earlier = [f"old-{i}" for i in range(30)]
    assert not any(isinstance(o, LedgerUnavailable) for o in await recorder.ledger.record_many(
        columns(earlier[:20]), ["fp"] * 20))
    await recorder.ledger.record_many(columns(earlier[20:], fingerprint="other", decision="DECLINE"), ["other"] * 10)
    fresh = [f"new-{i}" for i in range(300)]
    ids = fresh + earlier + fresh[:25]  # 300 new, 30 on record already, 25 repeated within the batch
    batch = columns(ids)
    outcomes = await recorder.ledger.record_many(batch, batch.fingerprints)
    assert isinstance(outcomes, RecordedBatch) and len(outcomes) == len(ids) == 355
    assert await ledger_rows(recorder.ledger) == 330  # exactly one row per request id
    replayed = [i for i, o in enumerate(outcomes) if o.replayed]
    assert replayed == list(range(300, 355))
    assert all(outcomes[i].decision == batch[i] and outcomes[i].fingerprint == "fp" for i in range(300))
    # on record before: what was recorded then (another payload's fingerprint where it differed)
    assert [outcomes[300 + i].fingerprint for i in range(30)] == ["fp"] * 20 + ["other"] * 10
    assert {outcomes[320 + i].decision.decision for i in range(10)} == {"DECLINE"}
    # a repeat within the batch: the decision of its first occurrence, as a replay
    assert all(outcomes[330 + i].decision == batch[i] for i in range(25))
    assert await recorder.wait_delivered(30)
    assert await recorder.crm.count() == 330


async def test_a_batch_that_cannot_be_packed_is_recorded_from_its_columns_with_the_same_outcomes(recorder):
    """A value holding the packing's separator (no id the API admits: it refuses control characters)
    sends the batch as arrays; new ids are recorded once and an id on record already is a replay."""
    assert not isinstance((await recorder.ledger.record_many(columns(["sep-old"]), ["fp"]))[0], LedgerUnavailable)
    ids = ["sep\x1fnew", "sep-old", *(f"sep-{i}" for i in range(10))]
    batch = columns(ids)
    outcomes = await recorder.ledger.record_many(batch, batch.fingerprints)
    assert [o.replayed for o in outcomes] == [False, True, *[False] * 10]
    assert outcomes[0].decision == batch[0] and outcomes[1].decision.request_id == "sep-old"
    assert await ledger_rows(recorder.ledger) == 12


async def test_concurrent_bulk_batches_of_the_same_request_ids_record_one_decision_each(recorder):
    ids = [f"race-{i}" for i in range(200)]
    a, b = columns(ids, decision="APPROVE"), columns(list(reversed(ids)), decision="DECLINE")
    first, second = await asyncio.gather(recorder.ledger.record_many(a, a.fingerprints), recorder.ledger.record_many(b, b.fingerprints))
    assert await ledger_rows(recorder.ledger) == 200
    # each id went to exactly one batch as new, and the other got that decision as a replay
    for i, rid in enumerate(ids):
        x, y = first[i], second[len(ids) - 1 - i]
        assert x.replayed != y.replayed and x.decision.decision_id == y.decision.decision_id == decision_id_for(rid)
        assert x.decision.decision == y.decision.decision


async def test_a_bulk_commit_that_fails_returns_ledger_unavailable_for_every_row(migrated_postgres):
    async with opened_ledger(migrated_postgres) as ledger:
        async with ledger._connection() as conn:  # a ledger that refuses writes
            await conn.execute('ALTER TABLE "prediction".decision_ledger ADD CONSTRAINT no_rows CHECK (false) NOT VALID')
        batch = columns([f"refused-{i}" for i in range(40)])
        outcomes = await ledger.record_many(batch, batch.fingerprints)
        assert [type(o) for o in outcomes] == [LedgerUnavailable] * 40 and not ledger.reachable
        assert await ledger_rows(ledger) == 0
