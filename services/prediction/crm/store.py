"""Idempotent decision writes to the CRM database through SQLAlchemy's asyncio extension."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from mlpair.prediction.crm.models import Base, DecisionRecord


@dataclass(frozen=True)
class StoredDecision:
    """A decision as recorded in the CRM."""

    decision_id: str
    request_id: str
    entity_id: str
    model_name: str
    model_version: str
    feature_schema_version: str
    policy_version: str
    probability: float
    decision: str
    reason_codes: tuple[str, ...]

    @classmethod
    def from_record(cls, r: DecisionRecord) -> StoredDecision:
        return cls(r.decision_id, r.request_id, r.entity_id, r.model_name, r.model_version,
                   r.feature_schema_version, r.policy_version, r.probability, r.decision,
                   tuple(json.loads(r.reason_codes)))


def make_engine(url: str) -> AsyncEngine:
    """Async engine for ``url``; SQLite gets WAL and a busy timeout so concurrent writers wait
    instead of failing with "database is locked"."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    return create_async_engine(url, pool_pre_ping=True)


class CrmStore:
    """Records decisions exactly once per request id."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def create_schema(self) -> None:
        """Creates missing tables (idempotent)."""
        async with self.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)

    async def close(self) -> None:
        await self.engine.dispose()

    async def find(self, request_id: str) -> StoredDecision | None:
        """The decision recorded for ``request_id``, if any."""
        async with self._sessions() as session:
            record = await session.scalar(select(DecisionRecord).where(DecisionRecord.request_id == request_id))
            return StoredDecision.from_record(record) if record else None

    async def record(self, decision: StoredDecision) -> StoredDecision:
        """Inserts ``decision``; if its request id is already recorded, returns that row instead.

        ``decision.decision_id`` may be empty; a UUID4 is assigned on insert.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the database is unreachable or refuses the write.
        """
        values = {**decision.__dict__, "decision_id": decision.decision_id or str(uuid.uuid4()),
                  "reason_codes": json.dumps(list(decision.reason_codes))}
        async with self._sessions() as session:
            session.add(DecisionRecord(**values))
            try:
                await session.commit()
            except IntegrityError:
                await session.rollback()
                existing = await self.find(decision.request_id)
                if existing is None:
                    raise
                return existing
        return StoredDecision(**{**values, "reason_codes": decision.reason_codes})

    async def count(self) -> int:
        """Number of recorded decisions."""
        async with self._sessions() as session:
            return int(await session.scalar(select(func.count()).select_from(DecisionRecord)))
