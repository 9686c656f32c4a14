"""The decision ledger on PostgreSQL: one table shared by every replica (the production engine).

``prediction.decision_ledger`` holds one row per request id (a unique index). A group commit is one
statement that commits on its own (no BEGIN/COMMIT round trips):
``INSERT … SELECT FROM unnest(…) ON CONFLICT (request_id) DO NOTHING RETURNING``, then, only for
request ids that were on record, a read of the recorded rows. Under READ COMMITTED an
insert that meets a concurrent, uncommitted insert of the same id waits for it; if that commits,
the insert does nothing and the read that follows sees the winner's row, so concurrent first calls
on several replicas all return one decision. Each batch is sorted by request id, so two replicas'
transactions take the index's locks in one order and cannot deadlock.

Relays on any number of replicas claim undelivered rows with ``SELECT … FOR UPDATE SKIP LOCKED``
inside a transaction that stays open while the batch is delivered to the CRM, then marks the rows
delivered and commits: each row is delivered by one relay, and a relay that dies releases its
locks with its connection (nothing waits for a lease to expire).

Statements go straight through an asyncpg pool (no SQLAlchemy on the request path: its
per-statement processing cost more CPU than the statement); Alembic owns the schema.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime

import asyncpg
from sqlalchemy import make_url

from mlpair.prediction.crm import ledger, packed
from mlpair.prediction.crm.codecs import CrmRow, ledger_arrays
from mlpair.prediction.crm.migrate import SchemaNotReady
from mlpair.prediction.crm.models import LEDGER_SCHEMA, LEDGER_TABLE
from mlpair.prediction.records import DecisionColumns, Recorded, StoredDecision

TABLE = f'"{LEDGER_SCHEMA}".{LEDGER_TABLE}'
_COLUMNS = ", ".join(ledger.DECISION_COLUMNS)
# each column's base type: an array cast to varchar(n) would truncate, while the assignment into
# the column refuses a value that is too long, as a row-by-row insert does
_ARRAY_TYPES = (
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "float8",
    "text",
    "text",
    "text",
    "int4",
    "text",
    "timestamptz",
)
_UNNEST = ", ".join(f"${k}::{t}[]" for k, t in enumerate(_ARRAY_TYPES, start=1))
INSERT = (
    f"INSERT INTO {TABLE} ({_COLUMNS}) SELECT * FROM unnest({_UNNEST}) "
    "ON CONFLICT (request_id) DO NOTHING RETURNING request_id"
)
SELECT_RECORDED = f"SELECT {_COLUMNS} FROM {TABLE} WHERE request_id = ANY($1::text[])"
CLAIM = (
    f"SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE delivered_at IS NULL ORDER BY seq LIMIT $1 "
    "FOR UPDATE SKIP LOCKED"
)
MARK_DELIVERED = f"UPDATE {TABLE} SET delivered_at = now() WHERE seq = ANY($1::bigint[])"
# The bulk path's insert: each column one packed text parameter (crm/packed.py), split and cast by
# PostgreSQL. It answers with the request ids it did not insert (on record already): none, one empty
# result, in the usual case, instead of a row per decision inserted (0.3 µs of client CPU per row).
_NAMES = ", ".join(f"c{k}" for k in range(len(ledger.DECISION_COLUMNS)))
INSERT_PACKED = (
    f"WITH inserted AS (INSERT INTO {TABLE} ({_COLUMNS}) SELECT "
    + ", ".join(packed.cast(f"c{k}", t) for k, t in enumerate(_ARRAY_TYPES))
    + " FROM unnest("
    + ", ".join(packed.unpacked(k) for k in range(1, len(_ARRAY_TYPES) + 1))
    + f") AS t({_NAMES}) ON CONFLICT (request_id) DO NOTHING RETURNING request_id) "
    + f"SELECT r FROM unnest({packed.unpacked(1)}) AS r WHERE r NOT IN (SELECT request_id FROM inserted)"
)
# A relay's claim, packed: one row of (count, one packed text per CRM column), no object per decision.
# The rows are marked delivered by the same statement, inside the claim's transaction: it commits
# only once the CRM has them, and a failed delivery rolls the mark back with it.
_CLAIMED_TYPES = dict(zip(ledger.DECISION_COLUMNS, _ARRAY_TYPES))
CLAIM_PACKED = (
    f"WITH claimed AS (SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE delivered_at IS NULL "
    "ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED), "
    f"marked AS (UPDATE {TABLE} AS l SET delivered_at = now() FROM claimed WHERE l.seq = claimed.seq) "
    "SELECT count(*), "
    + ", ".join(
        packed.packed_agg(packed.as_text(c, _CLAIMED_TYPES[c]), "seq") for c in ledger.CLAIMED_COLUMNS.split(", ")
    )
    + " FROM claimed"
)
BACKLOG = (
    f"SELECT (SELECT count(*) FROM {TABLE} WHERE delivered_at IS NULL), COALESCE((SELECT "
    f"extract(epoch FROM now() - recorded_at) FROM {TABLE} WHERE delivered_at IS NULL ORDER BY seq LIMIT 1), 0)"
)
IMPORT = (
    f"INSERT INTO {TABLE} ({_COLUMNS}, delivered_at) SELECT *, CASE WHEN $16 THEN now() END "
    f"FROM unnest({_UNNEST}) ON CONFLICT (request_id) DO NOTHING"
)


def _same(value: datetime) -> datetime:
    return value


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """A released connection's reset: nothing beyond asyncpg's rollback of an open transaction.
    The ledger sets no session state (no SET, LISTEN, advisory lock or cursor), so asyncpg's
    default reset query (``RESET ALL``, ``UNLISTEN *``, …) would be one more round trip and
    statement per commit for nothing."""


def _columns(rows: Sequence[tuple]) -> list[list]:
    """Row tuples → one list per column (asyncpg sends each as a typed array)."""
    return [list(column) for column in zip(*rows)] if rows else [[] for _ in ledger.DECISION_COLUMNS]


def _packed(arrays: list[list]) -> list[str]:
    """The ledger's columns (``DECISION_COLUMNS`` order) packed for :data:`INSERT_PACKED`.

    Raises:
        packed.Unpackable: a value holds the separator.
    """
    texts = []
    for values, sql_type in zip(arrays, _ARRAY_TYPES):
        if sql_type == "float8":
            values = packed.floats(values)
        elif sql_type == "int4":
            values = list(map(str, values))
        elif sql_type == "timestamptz":
            values = packed.timestamps(values)
        texts.append(packed.pack(values))
    return texts


class PostgresLedger(ledger.DecisionLedger):
    """The ledger in ``prediction.decision_ledger`` of a PostgreSQL database.

    Args:
        url: SQLAlchemy URL (``postgresql+asyncpg://user@host/db``); the serving role needs
            SELECT, INSERT and UPDATE on the table (``mlpair migrate --serving-role``).
        timeout_s: connect, pool acquisition and statement timeout, in seconds.
        pool_size: most connections of this process (group commits, relay claims, probes).
        statement_cache_size: asyncpg's prepared statements per connection (0 behind PgBouncer
            in transaction mode, which cannot keep them).
    """

    max_commit_rows = 2048
    commit_concurrency = 3  # measured with bench/ledger_engines.py: p50 at 32 in flight 10.2 → see docs/design.md
    db_system = "postgresql"
    bulk_rows = 8  # a BatchPredict's decisions go in one statement of their own

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        pool_size: int = 8,
        statement_cache_size: int = 100,
        relay_only: bool = False,
    ) -> None:
        super().__init__()
        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self.statement_cache_size = statement_cache_size
        # SKIP LOCKED: concurrent claims take disjoint rows. Each holds a connection for its whole
        # delivery, so the relay may take only what the commits leave of the pool; in a process that
        # only delivers (relay_only: mlpair relay) nothing commits, and one connection is kept for
        # health's reads.
        self.relay_claims = max(1, pool_size - (1 if relay_only else self.commit_concurrency))
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        """Creates the pool (connections are made on first use, so a ledger that is down now only
        delays readiness) and, when reachable, checks the table's columns."""
        self._pool = await asyncpg.create_pool(
            self.dsn,
            min_size=0,
            max_size=self.pool_size,
            timeout=self.timeout_s,
            command_timeout=self.timeout_s,
            statement_cache_size=self.statement_cache_size,
            reset=_keep_session,
        )
        try:
            async with self._connection() as conn:
                await conn.execute(
                    f"SELECT {_COLUMNS}, recorded_at, delivered_at, lease_until FROM {TABLE} WHERE false"
                )
        except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError, asyncpg.InvalidSchemaNameError) as exc:
            raise SchemaNotReady(
                f"the decision ledger lacks the {TABLE} table or columns this release uses: run `mlpair migrate` with the same ledger URL (--ledger-url / PREDICTION_LEDGER_URL)"
            ) from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            self.reachable = False  # not ready until a probe reaches it

    async def close(self) -> None:
        await super().close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def find(self, request_id: str) -> Recorded | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(SELECT_RECORDED, [request_id])
        return None if row is None else ledger.on_record(row, _same)

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[list[CrmRow]]:
        async with self._connection() as conn, conn.transaction():
            rows = await conn.fetch(CLAIM, limit)
            yield [row[1:] for row in rows]
            if rows:
                await conn.execute(MARK_DELIVERED, [row[0] for row in rows])

    @contextlib.asynccontextmanager
    async def claim_packed(self, limit: int) -> AsyncIterator[tuple[int, list[str]]]:
        """:meth:`claim`, with the claimed decisions as (how many, one packed text per CRM column
        in ``CRM_COLUMNS`` order: see ``crm/packed.py``); marked delivered when the body returns
        normally (the transaction commits), released when it raises (it rolls back)."""
        async with self._connection() as conn, conn.transaction():
            n, *columns = await conn.fetchrow(CLAIM_PACKED, limit)
            yield n, columns

    async def backlog(self) -> tuple[int, float]:
        """Undelivered decisions and the age of the one the relays claim next (the lowest ``seq``,
        found through the undelivered index without reading the rest: ``min(recorded_at)`` read
        every undelivered row, so on a large backlog the query ran past its timeout and the
        gauges stopped at their last value)."""
        async with self._connection() as conn:
            count, age_s = await conn.fetchrow(BACKLOG)
        return int(count), float(age_s)

    async def probe(self) -> bool:
        try:
            async with self._connection() as conn:
                await conn.execute(f"SELECT 1 FROM {TABLE} WHERE false")
        except Exception:  # noqa: BLE001  (unreachable or refusing, for whatever reason: not ready)
            self.reachable = False
            return False
        self.reachable = True
        return True

    async def import_decisions(self, decisions: Sequence[StoredDecision], *, delivered: bool) -> int:
        rows = [ledger.row_values(d, "", _same) for d in map(ledger.complete, decisions)]
        async with self._connection() as conn:
            status = await conn.execute(IMPORT, *_columns(rows), delivered)
        return int(status.rsplit(" ", 1)[-1])

    async def _commit(self, entries: list[ledger.Entry]) -> list[Recorded]:
        new = ledger.unique_new(entries, {})
        # One statement, committed on its own (no BEGIN/COMMIT round trips): the insert is atomic
        # and durable when it returns. Under READ COMMITTED a conflicting insert has waited for the
        # other transaction's commit, so the read that follows sees the row that won.
        async with self._connection() as conn:
            inserted = {
                r[0] for r in await conn.fetch(INSERT, *_columns([ledger.row_values(d, f, _same) for d, f in new]))
            }
            held = {d.request_id: Recorded(d, False, f) for d, f in new if d.request_id in inserted}
            if len(inserted) < len(new):
                for row in await conn.fetch(
                    SELECT_RECORDED, [d.request_id for d, _ in new if d.request_id not in inserted]
                ):
                    recorded = ledger.on_record(row, _same)
                    held[recorded.decision.request_id] = recorded
        return ledger.settle(entries, held)

    async def _commit_bulk(self, batch: DecisionColumns, rows: list[int]) -> dict[int, Recorded]:
        arrays = ledger_arrays(batch, rows)
        try:
            texts: list[str] | None = _packed(arrays)
        except packed.Unpackable:
            texts = None
        async with self._connection() as conn:  # one self-committing statement, as in _commit
            if texts is not None:  # answers with the request ids already on record
                on_record = {r[0] for r in await conn.fetch(INSERT_PACKED, *texts)}
            else:  # the columns as they are; answers with the request ids inserted
                inserted = {r[0] for r in await conn.fetch(INSERT, *arrays)}
                on_record = {rid for rid in arrays[0] if rid not in inserted}
            if not on_record:
                return {}
            held = {}
            for row in await conn.fetch(SELECT_RECORDED, list(on_record)):
                recorded = ledger.on_record(row, _same)
                held[recorded.decision.request_id] = recorded
        ids = batch.request_id
        return {i: held[ids[i]] for i in rows if ids[i] in on_record}

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        if self._pool is None:
            raise RuntimeError("the ledger is not open")
        async with self._pool.acquire(timeout=self.timeout_s) as conn:
            yield conn
