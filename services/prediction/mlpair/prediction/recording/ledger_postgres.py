"""The decision ledger on PostgreSQL: one table shared by every replica (the production engine).

``prediction.decision_ledger`` holds one row per request id (a unique index). A group commit is one
statement that commits on its own (no BEGIN/COMMIT round trips):
``INSERT … SELECT FROM unnest(…) ON CONFLICT (request_id) DO NOTHING RETURNING``, then, only for
request ids that were on record, a read of the recorded rows. Under READ COMMITTED an
insert that meets a concurrent, uncommitted insert of the same id waits for it; if that commits,
the insert does nothing and the read that follows sees the winner's row, so concurrent first calls
on several replicas all return one decision. Each batch is sorted by request id, so two replicas'
transactions take the index's locks in one order and cannot deadlock.

The same statement adds one row to ``prediction.decision_outbox`` naming the ``seq`` of every
decision it inserted: the relays' work list. Relays on any number of replicas claim outbox rows
with ``SELECT … FOR UPDATE SKIP LOCKED`` and delete them, read the decisions by primary key and
deliver them to the CRM inside that transaction, and commit once the CRM has them: each decision
is delivered by one relay, a relay that dies releases its claim with its connection (nothing waits
for a lease to expire), and a delivered decision costs PostgreSQL no write of its own (the per-row
``UPDATE … SET delivered_at`` this replaced cost more than the insert: migration ``ledger_0002``).
Rows of the previous release (``delivered_at IS NULL``) are still claimed and marked one by one,
first in each claim.

A bulk commit sends its columns packed (``recording/packed.py``). Binary COPY into a staging table of
the transaction, then one insert from it, was measured beside it for the ledger and the CRM
(``bench/ledger_rows.py``): PostgreSQL's CPU barely moved and the service's grew, so packing stays
(docs/decisions/0010-packed-ledger-columns-not-binary-copy.md).

Statements (their text: ``recording/ledger_sql.py``) go straight through an asyncpg pool (no SQLAlchemy on the request path: its
per-statement processing cost more CPU than the statement); Alembic owns the schema.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from datetime import datetime

import asyncpg
from sqlalchemy import make_url

from mlpair.prediction.recording import audit, ledger, packed
from mlpair.prediction.recording.codecs import reason_codes_from_json
from mlpair.prediction.recording.ledger_sql import (
    ARRAY_TYPES,
    AUDIT,
    BACKLOG,
    CLAIM,
    CLAIM_EVENTS,
    CLAIM_OUTBOX,
    CLAIM_OUTBOX_PACKED,
    CLAIM_PACKED,
    COLUMNS,
    CUSTOM_PLANS,
    DELETE_EVENTS,
    EVENT_BACKLOG,
    EVENT_COLUMNS,
    EVENT_DECISIONS,
    EVENT_OUTBOX,
    HAND_BACK,
    IMPORT,
    MARK_DELIVERED,
    MIN_DECISIONS_PER_OUTBOX_ROW,
    OUTBOX,
    OUTBOX_CHUNK,
    PRUNE_AUDIT,
    REQUEUE,
    SELECT_AUDIT,
    SELECT_RECORDED,
    TABLE,
    insert,
    insert_packed,
)
from mlpair.prediction.recording.migrate import SchemaNotReady
from mlpair.prediction.records import DecisionColumns, Recorded, StoredDecision


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


def _packed(columns: list[list], rows: list[int]) -> list[str]:
    """The rows ``rows`` of a batch's ledger columns (``DECISION_COLUMNS`` order), packed for
    :data:`INSERT_PACKED`.

    Raises:
        packed.Unpackable: a value holds the separator.
    """
    return [packed.pack_column(values, rows, t) for values, t in zip(columns, ARRAY_TYPES)]


class PostgresLedger(ledger.DecisionLedger):
    """The ledger in ``prediction.decision_ledger`` of a PostgreSQL database.

    Args:
        url: SQLAlchemy URL (``postgresql+asyncpg://user@host/db``); the serving role needs
            SELECT, INSERT and UPDATE on the table (``mlpair migrate --serving-role``).
        timeout_s: connect, pool acquisition and statement timeout, in seconds.
        pool_size: most connections of this process (group commits, relay claims, probes).
        statement_cache_size: asyncpg's prepared statements per connection (0 behind PgBouncer
            in transaction mode, which cannot keep them).
        events: queue each commit's decisions in the event outbox too (decision events on:
            ``recording/event_relay.py``).
    """

    max_commit_rows = 2048
    # A claim locks whole outbox rows (SKIP LOCKED: other relays pass over them) and those it does
    # not take stay locked until its commit, so it asks for as many rows as should hold its limit,
    # judged from the decisions per row it last saw: locking 256 at once left a second relay
    # nothing to claim while the first delivered 25 decisions.
    most_outbox_rows_per_claim = 4096
    commit_concurrency = 3  # chosen with bench/ledger_engines.py (docs/design.md; docs/decisions/0001)
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
        events: bool = False,
    ) -> None:
        super().__init__()
        # the commit's statements: (packed, with audit records) → SQL
        self._inserts = {
            (p, a): (insert_packed if p else insert)(audit=a, events=events)
            for p in (True, False)
            for a in (True, False)
        }
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
        self._decisions_per_outbox_row = float(OUTBOX_CHUNK)  # a full chunk, until a claim sees rows

    def _outbox_rows(self, limit: int) -> int:
        """Outbox rows a claim of ``limit`` decisions locks: enough for ``limit`` at the decisions
        per row last seen, but never counting on fewer than 16 a row, so that after a run of small
        commits one claim cannot lock 64 × its limit away from the other relays (a claim that finds
        smaller rows takes less and says ``more``)."""
        per_row = max(self._decisions_per_outbox_row, MIN_DECISIONS_PER_OUTBOX_ROW)
        return min(self.most_outbox_rows_per_claim, math.ceil(limit / per_row))

    def _saw(self, rows: int, decisions: int) -> None:
        if rows:
            self._decisions_per_outbox_row = decisions / rows

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
                await conn.execute(f"SELECT {COLUMNS}, recorded_at, delivered_at, lease_until FROM {TABLE} WHERE false")
                await conn.execute(f"SELECT id, seqs, n, recorded_at FROM {OUTBOX} WHERE false")
                await conn.execute(f"SELECT seq, record, recorded_at FROM {AUDIT} WHERE false")
                await conn.execute(f"SELECT id, seqs, n, recorded_at FROM {EVENT_OUTBOX} WHERE false")
        except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError, asyncpg.InvalidSchemaNameError) as exc:
            raise SchemaNotReady(
                f"the decision ledger lacks the {TABLE} table or columns this release uses: run `mlpair migrate` with the same ledger URL (--ledger-url / PREDICTION_LEDGER_URL)"
            ) from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            self.reachable = False  # not ready until a probe reaches it

    async def close(self) -> None:
        """Waits for pending group commits, then closes the connection pool."""
        await super().close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def find(self, request_id: str) -> Recorded | None:
        """The decision on record for ``request_id`` (``replayed`` True), or None; one indexed read.

        Raises:
            asyncpg.PostgresError, OSError, TimeoutError: the ledger did not answer (no free
                connection within ``timeout_s`` included).
        """
        async with self._connection() as conn:
            row = await conn.fetchrow(SELECT_RECORDED, [request_id])
        return None if row is None else ledger.on_record(row, _same)

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[ledger.Claimed]:
        """Claims the previous release's rows first (``delivered_at IS NULL``: none once a rollout
        is over, and while it lasts they must not wait behind a steady outbox), then outbox rows for
        the rest of ``limit``."""
        async with self._connection() as conn, conn.transaction():
            await conn.execute(CUSTOM_PLANS)
            previous = await conn.fetch(CLAIM, limit)
            batch = ledger.Claimed([row[1:] for row in previous], more=len(previous) == limit, requeue=_requeue(conn))
            if len(previous) < limit:
                rows = await conn.fetch(CLAIM_OUTBOX, limit - len(previous), self._outbox_rows(limit - len(previous)))
                if rows:
                    batch.more, locked, decisions = rows[0][-3:]
                    self._saw(locked, decisions)
                    batch.extend(row[1:-3] for row in rows)
            yield batch
            if previous:
                await conn.execute(MARK_DELIVERED, [row[0] for row in previous])

    @contextlib.asynccontextmanager
    async def claim_packed(self, limit: int) -> AsyncIterator[ledger.PackedClaim]:
        """:meth:`claim`, with the claimed decisions packed (:class:`~ledger.PackedClaim`: one
        text per CRM column in ``CRM_COLUMNS`` order, see ``recording/packed.py``); delivered when the
        body returns normally (the transaction commits), released when it raises (it rolls back)."""
        async with self._connection() as conn, conn.transaction():
            await conn.execute(CUSTOM_PLANS)
            n, more, *columns = await conn.fetchrow(CLAIM_PACKED, limit)  # the previous release's first
            if n < limit:
                rest = limit - n
                taken, more, locked, decisions, *outbox = await conn.fetchrow(
                    CLAIM_OUTBOX_PACKED, rest, self._outbox_rows(rest)
                )
                self._saw(locked, decisions)
                if taken:  # packed texts of both, joined (each value is preceded by the separator)
                    columns = [a + b for a, b in zip(columns, outbox)] if n else outbox
                    n += taken
            yield ledger.PackedClaim(n, columns, bool(more), _requeue(conn))

    async def backlog(self) -> tuple[int, float]:
        """Undelivered decisions and the age of the one the relays claim next (the lowest ``seq``,
        found through the undelivered index without reading the rest: ``min(recorded_at)`` read
        every undelivered row, so on a large backlog the query ran past its timeout and the
        gauges stopped at their last value)."""
        async with self._connection() as conn:
            count, age_s = await conn.fetchrow(BACKLOG)
        return int(count), float(age_s)

    async def probe(self) -> bool:
        """Whether a read of the ledger table succeeds now (any failure is False, never raised);
        sets :attr:`reachable`.
        """
        try:
            async with self._connection() as conn:
                await conn.execute(f"SELECT 1 FROM {TABLE} WHERE false")
        except Exception:  # noqa: BLE001  (unreachable or refusing, for whatever reason: not ready)
            self.reachable = False
            return False
        self.reachable = True
        return True

    async def hand_back_outbox(self) -> int:
        """Moves every decision waiting in the outbox back to the per-row work list (undelivered again),
        100 outbox rows per statement up to the newest present when called, so an older release's relay,
        which reads only the per-row list, delivers them. Returns how many decisions were handed back.
        """
        handed = 0
        async with self._connection() as conn:
            last = await conn.fetchval(f"SELECT max(id) FROM {OUTBOX}")
            while last is not None and await conn.fetchval(
                f"SELECT EXISTS (SELECT FROM {OUTBOX} WHERE id <= $1)", last
            ):
                status = await conn.execute(HAND_BACK, last)
                handed += int(status.rsplit(" ", 1)[-1])
        return handed

    async def import_decisions(self, decisions: Sequence[StoredDecision], *, delivered: bool) -> int:
        """Adds ``decisions`` recorded elsewhere (an old outbox, the CRM) in one statement, with an
        empty fingerprint; request ids already on record are left alone. ``delivered`` marks the added rows
        delivered now (the CRM has them already). Returns how many were added.
        """
        rows = [ledger.row_values(d, "", _same) for d in map(ledger.complete, decisions)]
        async with self._connection() as conn:
            status = await conn.execute(IMPORT, *_columns(rows), delivered)
        return int(status.rsplit(" ", 1)[-1])

    async def _commit_rows(self, batch: DecisionColumns, rows: list[int], columns: list[list]) -> dict[int, Recorded]:
        audit = batch.audit
        try:
            texts: list[str] | None = _packed(columns, rows)
            if texts is not None and audit is not None:
                texts.append(packed.pack([audit[i] for i in rows]))
        except packed.Unpackable:
            texts = None
        # One statement, committed on its own (no BEGIN/COMMIT round trips): the insert is atomic
        # and durable when it returns (with the audit records and event outbox rows of what it
        # inserted). Under READ COMMITTED a conflicting insert has waited for the other
        # transaction's commit, so the read that follows sees the row that won.
        async with self._connection() as conn:
            if texts is not None:  # answers with the request ids already on record
                on_record = {r[0] for r in await conn.fetch(self._inserts[True, audit is not None], *texts)}
            else:  # the columns as they are; answers with the request ids inserted
                arrays = [[column[i] for i in rows] for column in columns]
                if audit is not None:
                    arrays.append([audit[i] for i in rows])
                inserted = {r[0] for r in await conn.fetch(self._inserts[False, audit is not None], *arrays)}
                on_record = {rid for rid in arrays[0] if rid not in inserted}
            if not on_record:
                return {}
            held = {}
            for row in await conn.fetch(SELECT_RECORDED, list(on_record)):
                recorded = ledger.on_record(row, _same)
                held[recorded.decision.request_id] = recorded
        ids = batch.request_id
        return {i: held[ids[i]] for i in rows if ids[i] in on_record}

    async def audit_record(self, request_id: str) -> str | None:
        """The audit record of ``request_id`` (JSON text), or None (none kept, or past retention)."""
        async with self._connection() as conn:
            return await conn.fetchval(SELECT_AUDIT, request_id)

    async def prune_audit(self, older_than_s: float) -> int:
        """Deletes audit records recorded more than ``older_than_s`` seconds ago; how many."""
        pruned = 0
        async with self._connection() as conn:
            while (n := int((await conn.execute(PRUNE_AUDIT, float(older_than_s))).rsplit(" ", 1)[-1])) > 0:
                pruned += n
        return pruned

    @contextlib.asynccontextmanager
    async def claim_events(self, limit_rows: int) -> AsyncIterator[list[dict]]:
        """Claims up to ``limit_rows`` event outbox rows (each up to ``OUTBOX_CHUNK`` decisions) that no
        other relay holds, and yields their decisions as event data (the ledger's fields, reason codes
        as a list, ``decided_at`` as ISO 8601, and the audit record's fields when one was kept), in
        commit order. On a normal exit the rows are deleted with the claim's commit; on an exception
        the claim rolls back and they wait for the next one (of any relay)."""
        names = [*EVENT_COLUMNS.split(", "), "decided_at"]
        async with self._connection() as conn, conn.transaction():
            await conn.execute(CUSTOM_PLANS)
            rows = await conn.fetch(CLAIM_EVENTS, limit_rows)
            events: list[dict] = []
            if rows:
                for *fields, record in await conn.fetch(EVENT_DECISIONS, [s for r in rows for s in r[1]]):
                    data = dict(zip(names, fields))
                    data["reason_codes"] = list(reason_codes_from_json(data["reason_codes"]))
                    data.update(audit.read_record(record) or {})
                    events.append(data)
            yield events
            if rows:
                await conn.execute(DELETE_EVENTS, [r[0] for r in rows])

    async def event_backlog(self) -> tuple[int, float]:
        """Decisions waiting in the event outbox and the age in seconds of the oldest (0 when none)."""
        async with self._connection() as conn:
            count, age_s = await conn.fetchrow(EVENT_BACKLOG)
        return int(count), float(age_s)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        if self._pool is None:
            raise RuntimeError("the ledger is not open")
        async with self._pool.acquire(timeout=self.timeout_s) as conn:
            yield conn


def _requeue(conn: asyncpg.Connection) -> ledger.Requeue:
    """A claim's :data:`~ledger.Requeue`, on the claim's own connection and transaction."""

    async def requeue(request_ids: list[str]) -> None:
        await conn.execute(REQUEUE, request_ids)

    return requeue
