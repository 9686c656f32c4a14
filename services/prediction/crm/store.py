"""The CRM database: decisions delivered by the ledger's relay, exactly once per request id.

Delivery is one transaction per batch, ``INSERT … ON CONFLICT DO NOTHING``: if a connection
drops after the commit but before the acknowledgement, the relay retries the whole
transaction and the rows already there are skipped, so a decision is never doubled.
Connections are checked before use (``pool_pre_ping``) and a dropped one is replaced.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, Float, Integer, Row, String, Text, event, func, make_url, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from mlpair.prediction.crm.migrate import CRM_BRANCH, upgrade
from mlpair.prediction.crm.models import DecisionRecord

# Decision ids are derived from the request id (the idempotency key), so every replica, every
# retry and every delivery attempt name a decision the same way (RFC 4122 name-based UUID).
_DECISION_NAMESPACE = uuid.UUID("6b1f4a3e-3c1d-5e0a-9b7e-6d6c70616972")
_NAMESPACE_BYTES = _DECISION_NAMESPACE.bytes


# What json.dumps(obj) and json.dumps(obj, separators=(",", ":")) do, without building an encoder
# per call (json.dumps makes a new JSONEncoder whenever an argument differs from the defaults).
_JSON = json.JSONEncoder()
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


def decision_id_for(request_id: str) -> str:
    """The decision id of ``request_id``: UUIDv5 in mlpair's namespace (RFC 4122 §4.3).

    The same value as ``str(uuid.uuid5(namespace, request_id))``, built from the SHA-1 digest
    directly: the ``uuid.UUID`` object costs more than the hash on the request path.
    """
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + request_id.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True)
class StoredDecision:
    """A decision as recorded (in the decision ledger, then in the CRM).

    ``probability`` is None when no model output was used (``served_from = "fallback"``);
    ``served_from`` is one of ``inference``, ``cache``, ``stale_cache``, ``fallback``.
    """

    decision_id: str
    request_id: str
    entity_id: str
    model_name: str
    model_version: str
    feature_schema_version: str
    policy_version: str
    probability: float | None
    decision: str
    reason_codes: tuple[str, ...]
    served_from: str = "inference"
    cache_age_ms: int = 0
    degraded_reason: str = ""
    decided_at: datetime | None = None

    def _fields(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: asdict deep-copies every value, which cost more
        # than the rest of the decision's write on the request path (profiled).
        return {
            "decision_id": self.decision_id,
            "request_id": self.request_id,
            "entity_id": self.entity_id,
            "model_name": self.model_name,
            "model_version": self.model_version,
            "feature_schema_version": self.feature_schema_version,
            "policy_version": self.policy_version,
            "probability": self.probability,
            "decision": self.decision,
            "reason_codes": self.reason_codes,
            "served_from": self.served_from,
            "cache_age_ms": self.cache_age_ms,
            "degraded_reason": self.degraded_reason,
            "decided_at": self.decided_at,
        }

    def to_json(self) -> str:
        data = self._fields()
        data["decided_at"] = self.decided_at.isoformat() if self.decided_at else None
        return _COMPACT_JSON.encode(data)

    @classmethod
    def from_json(cls, payload: str) -> StoredDecision:
        data = json.loads(payload)
        data["reason_codes"] = tuple(data["reason_codes"])
        data["decided_at"] = datetime.fromisoformat(data["decided_at"]) if data.get("decided_at") else None
        return cls(**data)

    @classmethod
    def from_record(cls, r: Row[Any]) -> StoredDecision:
        """A decision from a selected ``decisions`` row (:class:`DecisionRecord`'s columns)."""
        return cls(
            r.decision_id,
            r.request_id,
            r.entity_id,
            r.model_name,
            r.model_version,
            r.feature_schema_version,
            r.policy_version,
            r.probability,
            r.decision,
            tuple(json.loads(r.reason_codes)),
            r.served_from,
            r.cache_age_ms,
            r.degraded_reason,
            as_utc(r.decided_at),
        )

    def to_row(self) -> dict[str, Any]:
        row = self._fields()
        row["reason_codes"] = self.reason_codes_json()
        return row

    def crm_row(self) -> tuple:
        """The decision's :data:`CRM_COLUMNS` values."""
        return (
            self.decision_id,
            self.request_id,
            self.entity_id,
            self.model_name,
            self.model_version,
            self.feature_schema_version,
            self.policy_version,
            self.probability,
            self.decision,
            self.reason_codes_json(),
            self.served_from,
            self.cache_age_ms,
            self.degraded_reason,
            self.decided_at,
        )

    def reason_codes_json(self) -> str:
        """The reason codes as stored: a JSON list."""
        return _JSON.encode(list(self.reason_codes))

    @staticmethod
    def reason_codes_from_json(stored: str) -> tuple[str, ...]:
        return tuple(json.loads(stored))


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; every timestamp here is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


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
# The CRM columns a delivery writes: the decision's fields, in order (reason_codes as JSON text).
CRM_COLUMNS = tuple(StoredDecision.__dataclass_fields__)
CrmRow = tuple  # one decision's CRM_COLUMNS values


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
    """As :func:`_unnest_insert`, from packed text columns (``crm/packed.py``), counting the rows inserted."""
    from mlpair.prediction.crm import packed

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
        await self.engine.dispose()

    async def deliver(self, decisions: list[StoredDecision]) -> list[str]:
        """Inserts ``decisions`` in one transaction (see :meth:`deliver_rows`)."""
        return await self.deliver_rows([d.crm_row() for d in decisions])

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
            async with self.engine.begin() as conn:
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
        """Inserts decisions given as packed text columns (``CRM_COLUMNS`` order, ``crm/packed.py``)
        in one transaction, as :meth:`deliver_rows` does; returns how many were inserted (request
        ids already recorded are skipped)."""
        async with self.engine.begin() as conn:
            result = await conn.exec_driver_sql(_PACKED_INSERT, tuple(columns))
            return int(result.scalar_one())

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
            return StoredDecision.from_record(record) if record else None

    async def count(self) -> int:
        """Number of recorded decisions."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(DecisionRecord))).scalar_one())
