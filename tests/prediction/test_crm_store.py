"""Idempotent CRM writes against SQLite and the real PostgreSQL at 127.0.0.1:5432."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from mlpair.prediction.crm.store import CrmStore, StoredDecision


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


def decision(request_id: str, probability: float = 0.3) -> StoredDecision:
    return StoredDecision("", request_id, "entity-1", "credit-risk", "1", "credit-risk/v1", "policy/v1",
                          probability, "REVIEW", ("ELEVATED_DEFAULT_RISK",))


async def test_same_request_id_is_recorded_once(store):
    request_id = f"crm-{uuid.uuid4()}"
    before = await store.count()
    first = await store.record(decision(request_id))
    again = await store.record(decision(request_id, probability=0.9))
    assert again.decision_id == first.decision_id and again.probability == 0.3
    found = await store.find(request_id)
    assert found == first and found.reason_codes == ("ELEVATED_DEFAULT_RISK",)
    assert await store.count() == before + 1


async def test_concurrent_duplicates_still_give_one_row(store):
    request_id = f"crm-{uuid.uuid4()}"
    before = await store.count()
    results = await asyncio.gather(*(store.record(decision(request_id)) for _ in range(8)))
    assert len({r.decision_id for r in results}) == 1
    assert await store.count() == before + 1
