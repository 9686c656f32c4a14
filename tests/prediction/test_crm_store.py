"""CRM migrations and idempotent delivery against SQLite and the real PostgreSQL at 127.0.0.1:5432."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC

import pytest
from sqlalchemy import inspect, text

from mlpair.prediction.recording.codecs import CRM_COLUMNS, crm_row
from mlpair.prediction.recording.migrate import current_revision
from mlpair.prediction.recording.store import CrmStore, make_engine
from mlpair.prediction.records import StoredDecision, decision_id_for
from tests.support.ledger import crm_decision

CRM_HEAD = "crm_0003"


@pytest.fixture(params=["sqlite", "postgresql"])
def crm_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def store(crm_url):
    crm = CrmStore(crm_url)
    await crm.create_schema()
    yield crm
    await crm.close()


async def test_a_fresh_database_is_migrated_to_head_and_again_is_a_no_op(store):
    assert await current_revision(store.engine) == CRM_HEAD
    await store.create_schema()
    assert await current_revision(store.engine) == CRM_HEAD
    async with store.engine.connect() as conn:
        columns = await conn.run_sync(lambda c: {col["name"]: col for col in inspect(c).get_columns("decisions")})
    assert {"served_from", "cache_age_ms", "degraded_reason", "decided_at"} <= set(columns)
    assert columns["probability"]["nullable"]


async def test_a_crm_created_before_migrations_is_stamped_and_upgraded_keeping_its_rows(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'old.sqlite'}"
    engine = make_engine(url)
    async with engine.begin() as conn:  # the table exactly as the first release created it
        await conn.execute(text(
            "CREATE TABLE decisions (decision_id VARCHAR(36) PRIMARY KEY, request_id VARCHAR(128) NOT NULL UNIQUE, "
            "entity_id VARCHAR(128) NOT NULL, model_name VARCHAR(64) NOT NULL, model_version VARCHAR(32) NOT NULL, "
            "feature_schema_version VARCHAR(64) NOT NULL, policy_version VARCHAR(64) NOT NULL, "
            "probability FLOAT NOT NULL, decision VARCHAR(32) NOT NULL, reason_codes TEXT NOT NULL, "
            "created_at DATETIME DEFAULT (CURRENT_TIMESTAMP) NOT NULL)"))
        await conn.execute(text("INSERT INTO decisions VALUES ('d-old', 'r-old', 'e', 'credit-risk', '1', 's', 'p', "
                                "0.7, 'DECLINE', '[\"HIGH_DEFAULT_RISK\"]', CURRENT_TIMESTAMP)"))
    await engine.dispose()
    crm = CrmStore(url)
    try:
        await crm.create_schema()
        assert await current_revision(crm.engine) == CRM_HEAD
        old = await crm.find("r-old")
        assert (old.decision_id, old.probability, old.served_from, old.reason_codes) == \
            ("d-old", 0.7, "inference", ("HIGH_DEFAULT_RISK",))
    finally:
        await crm.close()


async def test_c39_delivering_the_same_decision_again_writes_no_second_row(store):
    request_id = f"crm-{uuid.uuid4()}"
    before = await store.count()
    assert await store.deliver([crm_decision(request_id)]) == [request_id]
    assert await store.deliver([crm_decision(request_id, probability=0.9)]) == []  # a retried transaction
    found = await store.find(request_id)
    assert found.decision_id == decision_id_for(request_id) and found.probability == 0.3
    assert found.reason_codes == ("ELEVATED_DEFAULT_RISK",)
    assert await store.count() == before + 1


async def test_c39_concurrent_deliveries_of_one_decision_give_one_row(store):
    request_id = f"crm-{uuid.uuid4()}"
    before = await store.count()
    inserted = await asyncio.gather(*(store.deliver([crm_decision(request_id)]) for _ in range(8)))
    assert sum(len(ids) for ids in inserted) == 1
    assert await store.count() == before + 1


async def test_a_fallback_decision_is_stored_without_a_probability(store):
    request_id = f"crm-{uuid.uuid4()}"
    await store.deliver([crm_decision(request_id, probability=None, served_from="fallback",
                                  degraded_reason="CIRCUIT_OPEN")])
    found = await store.find(request_id)
    assert found.probability is None and found.served_from == "fallback" and found.degraded_reason == "CIRCUIT_OPEN"


async def test_a_batch_with_some_rows_already_delivered_inserts_only_the_rest(store):
    ids = [f"crm-{uuid.uuid4()}" for _ in range(5)]
    await store.deliver([crm_decision(ids[1]), crm_decision(ids[3])])
    assert sorted(await store.deliver([crm_decision(i) for i in ids])) == sorted([ids[0], ids[2], ids[4]])


def varied_decisions(prefix: str) -> list[StoredDecision]:
    """Decisions with every kind of value a column holds: None, non-ASCII, empty, fallback."""
    from datetime import datetime, timedelta

    at = datetime(2026, 11, 30, 4, 35, 43, 123456, tzinfo=UTC)
    return [StoredDecision(decision_id_for(f"{prefix}{i}"), f"{prefix}{i}", f"entité-{i}", "credit-risk",
                           "1+2" if i % 3 else "", "credit-risk/v1", "policy/v2",
                           None if i % 7 == 0 else (i / 49) ** 0.37, "REVIEW", ("A", "B_ü") if i % 2 else (),
                           "fallback" if i % 7 == 0 else "cache", i * 1000, "CIRCUIT_OPEN" if i % 7 == 0 else "",
                           None if i % 11 == 0 else at + timedelta(microseconds=i))
            for i in range(50)]


async def test_postgresql_column_array_delivery_stores_what_a_row_insert_stores(postgres_url):
    from sqlalchemy.dialects import postgresql

    from mlpair.prediction.recording.models import DecisionRecord

    crm = CrmStore(postgres_url)
    try:
        await crm.create_schema()
        tag = uuid.uuid4().hex[:8]
        delivered = varied_decisions(f"arrays-{tag}-")
        inserted = varied_decisions(f"rows-{tag}-")
        assert sorted(await crm.deliver(delivered)) == sorted(d.request_id for d in delivered)
        assert await crm.deliver(delivered) == []
        async with crm.engine.begin() as conn:  # the generic row-by-row statement, for reference
            await conn.execute(postgresql.insert(DecisionRecord).on_conflict_do_nothing(), [dict(zip(CRM_COLUMNS, crm_row(d))) for d in inserted])
        for a, b in zip(delivered, inserted):
            got, expected = await crm.find(a.request_id), await crm.find(b.request_id)
            assert got == a
            assert {**got.__dict__, "decision_id": "", "request_id": ""} == \
                {**expected.__dict__, "decision_id": "", "request_id": ""}
    finally:
        await crm.close()


async def test_postgresql_refuses_a_value_longer_than_its_column_never_truncates(postgres_url):
    from sqlalchemy.exc import DBAPIError

    crm = CrmStore(postgres_url)
    try:
        await crm.create_schema()
        request_id = f"long-{uuid.uuid4()}"
        with pytest.raises(DBAPIError):
            await crm.deliver([crm_decision(request_id, degraded_reason="X" * 65)])  # degraded_reason is VARCHAR(64)
        assert await crm.find(request_id) is None
    finally:
        await crm.close()
