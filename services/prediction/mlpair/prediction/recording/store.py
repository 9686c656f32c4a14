"""The CRM database: decisions delivered by the ledger's relay, exactly once per request id.

Delivery is one statement per batch, ``INSERT … ON CONFLICT DO NOTHING``, atomic and committed on
its own (on PostgreSQL no BEGIN/COMMIT round trips): if a connection drops after the commit but
before the acknowledgement, the relay retries the whole batch and the rows already there are
skipped, so a decision is never doubled.
Connections are checked before use (``pool_pre_ping``) and a dropped one is replaced.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, Float, Integer, String, Text, event, func, make_url, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from mlpair.prediction.recording.codecs import CRM_COLUMNS, CrmRow, crm_row, from_record
from mlpair.prediction.recording.migrate import CRM_BRANCH, upgrade
from mlpair.prediction.recording.models import DecisionRecord
from mlpair.prediction.records import StoredDecision


def make_engine(
    url: str, *, timeout_s: float = 30.0, synchronous: str = "NORMAL", statement_cache_size: int = 100
) -> AsyncEngine:
    """Async engine for ``url``.

    SQLite gets WAL (readers never block the writer), ``synchronous`` (FULL: fsync at every
    commit, survives power loss; NORMAL: survives a process crash) and a busy timeout so
    concurrent writers wait instead of failing with "database is locked". Other databases get
    ``pool_pre_ping`` (a dead pooled connection is replaced before use) and connect and
    statement timeouts of ``timeout_s`` (asyncpg's ``timeout`` / ``command_timeout``).

    ``statement_cache_size=0`` (asyncpg only) is for PgBouncer in transaction mode, where
    consecutive statements of one client may run on different server connections: no
    prepared statement is cached (asyncpg's and SQLAlchemy's caches both off) and each one
    SQLAlchemy still prepares gets a unique name, so two clients never collide on
    ``__asyncpg_stmt_1__`` (SQLAlchemy's asyncpg dialect documentation, "Prepared Statement
    Name with PGBouncer").
    """
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": timeout_s})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
            cursor.close()

        return engine
    connect_args: dict[str, Any] = {"timeout": timeout_s, "command_timeout": timeout_s} if "asyncpg" in url else {}
    if connect_args and statement_cache_size == 0:
        connect_args.update(
            statement_cache_size=0,
            prepared_statement_cache_size=0,
            prepared_statement_name_func=lambda: f"__asyncpg_{uuid.uuid4().hex}__",
        )
    elif connect_args:
        connect_args.update(statement_cache_size=statement_cache_size)
    return create_async_engine(url, pool_pre_ping=True, connect_args=connect_args)


_ARRAY_TYPES = {String: "text", Text: "text", Float: "float8", Integer: "int4", DateTime: "timestamptz"}


def _unnest_insert() -> str:
    """``INSERT … SELECT * FROM unnest($1, …, $14) ON CONFLICT DO NOTHING RETURNING request_id``
    (asyncpg's ``$n`` parameters): one array per delivered column, unnested into rows by
    PostgreSQL. Each array has the column's base type (text, not varchar(n): an explicit cast to
    varchar(n) would truncate, while the assignment into the column refuses a value that is too
    long, as a row-by-row insert does)."""
    columns = DecisionRecord.__table__.columns
    arrays = ", ".join(
        f"CAST(${k} AS {_ARRAY_TYPES[type(columns[name].type)]}[])" for k, name in enumerate(CRM_COLUMNS, start=1)
    )
    return (
        f"INSERT INTO {DecisionRecord.__tablename__} ({', '.join(CRM_COLUMNS)}) "
        f"SELECT * FROM unnest({arrays}) ON CONFLICT DO NOTHING RETURNING request_id"
    )


_UNNEST_INSERT = _unnest_insert()


def _packed_insert() -> str:
    """As :func:`_unnest_insert`, from packed text columns (``recording/packed.py``), counting the rows inserted."""
    from mlpair.prediction.recording import packed

    columns = DecisionRecord.__table__.columns
    types = [_ARRAY_TYPES[type(columns[name].type)] for name in CRM_COLUMNS]
    names = ", ".join(f"c{k}" for k in range(len(CRM_COLUMNS)))
    return (
        f"WITH inserted AS (INSERT INTO {DecisionRecord.__tablename__} ({', '.join(CRM_COLUMNS)}) SELECT "
        + ", ".join(packed.cast(f"c{k}", t) for k, t in enumerate(types))
        + " FROM unnest("
        + ", ".join(packed.unpacked(k) for k in range(1, len(types) + 1))
        + f") AS t({names}) ON CONFLICT DO NOTHING RETURNING 1) SELECT count(*) FROM inserted"
    )


_PACKED_INSERT = _packed_insert()


def _insert(dialect_name: str):
    if dialect_name == "postgresql":
        return postgresql.insert(DecisionRecord)
    if dialect_name == "sqlite":
        return sqlite.insert(DecisionRecord)
    raise ValueError(f"CRM database dialect {dialect_name!r} is not supported (PostgreSQL or SQLite)")


class CrmStore:
    """The CRM database: idempotent batch delivery and look-ups."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, statement_cache_size: int = 100) -> None:
        self.engine = make_engine(url, timeout_s=timeout_s, statement_cache_size=statement_cache_size)

    async def create_schema(self) -> None:
        """Migrates the CRM database to the latest revision (idempotent).

        Raises:
            sqlalchemy.exc.SQLAlchemyError, OSError: the database is unreachable.
        """
        await upgrade(self.engine, CRM_BRANCH)

    async def close(self) -> None:
        """Disposes of the engine's connection pool; the store is not used afterwards."""
        await self.engine.dispose()

    async def deliver(self, decisions: list[StoredDecision]) -> list[str]:
        """Inserts ``decisions`` in one transaction (see :meth:`deliver_rows`)."""
        return await self.deliver_rows([crm_row(d) for d in decisions])

    async def deliver_rows(self, rows: list[CrmRow]) -> list[str]:
        """Inserts decisions given as :data:`CRM_COLUMNS` tuples in one transaction; request ids
        already recorded are skipped.

        Returns:
            The request ids actually inserted by this call.

        Raises:
            sqlalchemy.exc.SQLAlchemyError, OSError: the database is unreachable or refused the
                transaction (nothing of it was committed, or all of it was — retry it whole).
        """
        if not rows:
            return []
        if self.engine.dialect.driver == "asyncpg":
            # 14 column arrays, not 14 parameters per row: SQLAlchemy's per-row parameter
            # processing cost more CPU than the rest of the delivery (same rows; see the tests)
            columns = [list(column) for column in zip(*rows)]
            async with self._self_committing() as conn:
                result = await conn.exec_driver_sql(_UNNEST_INSERT, tuple(columns))
                return list(result.scalars())
        stmt = _insert(self.engine.dialect.name).on_conflict_do_nothing().returning(DecisionRecord.request_id)
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt, [dict(zip(CRM_COLUMNS, row)) for row in rows])
            return list(result.scalars())

    @property
    def takes_packed(self) -> bool:
        """Whether :meth:`deliver_packed` works here (PostgreSQL through asyncpg)."""
        return self.engine.dialect.driver == "asyncpg"

    async def deliver_packed(self, columns: list[str]) -> int:
        """Inserts decisions given as packed text columns (``CRM_COLUMNS`` order, ``recording/packed.py``)
        in one transaction, as :meth:`deliver_rows` does; returns how many were inserted (request
        ids already recorded are skipped)."""
        async with self._self_committing() as conn:
            result = await conn.exec_driver_sql(_PACKED_INSERT, tuple(columns))
            return int(result.scalar_one())

    @contextlib.asynccontextmanager
    async def _self_committing(self) -> AsyncIterator[AsyncConnection]:
        """A connection whose one statement commits on its own (PostgreSQL: no BEGIN and COMMIT
        round trips; a single ``INSERT`` is atomic by itself)."""
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    async def ping(self) -> bool:
        """Whether the CRM database answers ``SELECT 1``."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:  # noqa: BLE001  (any failure: the CRM database is not healthy)
            return False
        return True

    async def find(self, request_id: str) -> StoredDecision | None:
        """The decision recorded for ``request_id``, if any."""
        async with self.engine.connect() as conn:
            record = (await conn.execute(select(DecisionRecord).where(DecisionRecord.request_id == request_id))).first()
            return from_record(record) if record else None

    async def count(self) -> int:
        """Number of recorded decisions."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(DecisionRecord))).scalar_one())
