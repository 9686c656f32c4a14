"""``crm_statement_cache_size=0`` (PgBouncer in transaction mode), against the real PostgreSQL:
the CRM store still delivers and reads, and no statement it leaves prepared on a server
connection has asyncpg's per-connection counter name (``__asyncpg_stmt_N__``), which two
clients sharing that server connection through PgBouncer would both use."""

from __future__ import annotations

import re
import uuid

import pytest
from sqlalchemy import text

from mlpair.prediction.crm.store import CrmStore
from mlpair.prediction.records import StoredDecision, decision_id_for


def decision(request_id: str) -> StoredDecision:
    return StoredDecision(decision_id_for(request_id), request_id, "entity-1", "credit-risk", "1", "credit-risk/v1",
                          "policy/v1", 0.3, "REVIEW", ("ELEVATED_DEFAULT_RISK",))


async def prepared_names(crm: CrmStore) -> tuple[list[str], list[str]]:
    """Deliveries and reads on one pooled connection, then the names prepared on it."""
    tag = uuid.uuid4().hex[:8]
    for i in range(3):
        batch = [decision(f"pgb-{tag}-{i}-{j}") for j in range(2)]
        assert sorted(await crm.deliver(batch)) == sorted(d.request_id for d in batch)
        assert await crm.find(batch[0].request_id) == batch[0]
    async with crm.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
        names = (await conn.execute(text("SELECT name FROM pg_prepared_statements"))).scalars().all()
    return [n for n in names if n.startswith("__asyncpg_stmt_")], names


@pytest.mark.timeout(60)
async def test_a_crm_without_statement_cache_names_no_statement_by_counter(postgres_url):
    cached, plain = CrmStore(postgres_url), CrmStore(postgres_url, statement_cache_size=0)
    try:
        await cached.create_schema()
        counter_named, _ = await prepared_names(cached)
        assert counter_named, "the default engine caches statements under asyncpg's counter names"
        counter_named, names = await prepared_names(plain)
        assert counter_named == []
        assert all(re.fullmatch(r"__asyncpg_[0-9a-f]{32}__", n) for n in names), names
    finally:
        await cached.close()
        await plain.close()
