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

Statements go straight through an asyncpg pool (no SQLAlchemy on the request path: its
per-statement processing cost more CPU than the statement); Alembic owns the schema.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from datetime import datetime

import asyncpg
from sqlalchemy import make_url

from mlpair.prediction.crm import ledger, packed
from mlpair.prediction.crm.codecs import ledger_arrays
from mlpair.prediction.crm.migrate import SchemaNotReady
from mlpair.prediction.crm.models import LEDGER_SCHEMA, LEDGER_TABLE, OUTBOX_TABLE
from mlpair.prediction.records import DecisionColumns, Recorded, StoredDecision

TABLE = f'"{LEDGER_SCHEMA}".{LEDGER_TABLE}'
OUTBOX = f'"{LEDGER_SCHEMA}".{OUTBOX_TABLE}'
# delivered_at of the decisions this release records: "delivered through the outbox", so a relay of
# the previous release (WHERE delivered_at IS NULL) leaves them alone during a rollout
IN_OUTBOX = "'infinity'::timestamptz"
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
# The commit's outbox rows, in the insert's statement (atomic with it): one per OUTBOX_CHUNK
# decisions inserted, so several relays can claim parts of one large commit at once (a claim locks
# whole rows); none when nothing was new.
OUTBOX_CHUNK = 64
MIN_DECISIONS_PER_OUTBOX_ROW = 16  # what a claim's sizing assumes at the least (_outbox_rows)
_QUEUED = (
    f"queued AS (INSERT INTO {OUTBOX} (seqs, n) SELECT array_agg(seq ORDER BY seq), count(*) FROM "
    f"(SELECT seq, (row_number() OVER (ORDER BY seq) - 1) / {OUTBOX_CHUNK} AS chunk FROM inserted) AS c "
    "GROUP BY chunk)"
)
INSERT = (
    f"WITH inserted AS (INSERT INTO {TABLE} ({_COLUMNS}, delivered_at) SELECT *, {IN_OUTBOX} FROM unnest({_UNNEST}) "
    f"ON CONFLICT (request_id) DO NOTHING RETURNING seq, request_id), {_QUEUED} SELECT request_id FROM inserted"
)
SELECT_RECORDED = f"SELECT {_COLUMNS} FROM {TABLE} WHERE request_id = ANY($1::text[])"
# A relay's claim of $1 decisions: up to $2 of the oldest outbox rows no other relay holds, locked;
# in order, each that fits whole within $1 deleted, and of the first that does not, its first seqs
# taken and the rest left in it (an update of one narrow row); their decisions read by primary key.
# Commits with the delivery.
_TAKEN = (
    f"WITH locked AS (SELECT id, n, seqs FROM {OUTBOX} ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED), "
    "w AS (SELECT id, n, seqs, sum(n) OVER (ORDER BY id) - n AS before FROM locked), "
    "cut AS (SELECT id, $1 - before AS k FROM w WHERE before < $1 AND before + n > $1), "
    f"taken AS (DELETE FROM {OUTBOX} AS o USING w WHERE o.id = w.id AND w.before + w.n <= $1 RETURNING o.seqs), "
    f"kept AS (UPDATE {OUTBOX} AS o SET seqs = o.seqs[cut.k + 1:], n = o.n - cut.k FROM cut WHERE o.id = cut.id "
    "RETURNING o.id), "
    f"claimed AS (SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE seq = ANY(ARRAY("
    "SELECT unnest(seqs) FROM taken UNION ALL SELECT unnest(w.seqs[1:cut.k]) FROM w JOIN cut ON w.id = cut.id)))"
)
# more: the locked rows held more than the claim took, or as many were locked as asked (more behind)
# and the outbox rows locked and their decisions, which size the next claim's $2
_MORE = (
    "((SELECT sum(n) FROM locked) > $1 OR (SELECT count(*) FROM locked) = $2), "
    "(SELECT count(*) FROM locked), (SELECT COALESCE(sum(n), 0) FROM locked)"
)
# A claim's statements are planned for each execution, with the tables' sizes of the moment: a
# prepared statement's generic plan, made while the ledger was small (a fresh database, the first
# claims), read the decisions by a sequential scan of the whole ledger once it had grown (3–5 s per
# claim at 200,000 rows, measured). SET LOCAL ends with the claim's transaction.
CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"
CLAIM_OUTBOX = f"{_TAKEN} SELECT *, {_MORE} FROM claimed ORDER BY seq"
# The previous release's rows (delivered_at IS NULL), claimed and marked one by one.
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
    f"WITH inserted AS (INSERT INTO {TABLE} ({_COLUMNS}, delivered_at) SELECT "
    + ", ".join(packed.cast(f"c{k}", t) for k, t in enumerate(_ARRAY_TYPES))
    + f", {IN_OUTBOX} FROM unnest("
    + ", ".join(packed.unpacked(k) for k in range(1, len(_ARRAY_TYPES) + 1))
    + f") AS t({_NAMES}) ON CONFLICT (request_id) DO NOTHING RETURNING seq, request_id), {_QUEUED} "
    + f"SELECT r FROM unnest({packed.unpacked(1)}) AS r WHERE r NOT IN (SELECT request_id FROM inserted)"
)
# A relay's claim, packed: one row of (count, one packed text per CRM column), no object per decision.
# The outbox rows are deleted (or the previous release's rows marked delivered) by the same statement,
# inside the claim's transaction: it commits only once the CRM has them, and a failed delivery rolls
# the claim back with it.
_CLAIMED_TYPES = dict(zip(ledger.DECISION_COLUMNS, _ARRAY_TYPES))
_PACKED_CLAIMED = (
    "SELECT count(*), "
    + ", ".join(
        packed.packed_agg(packed.as_text(c, _CLAIMED_TYPES[c]), "seq") for c in ledger.CLAIMED_COLUMNS.split(", ")
    )
    + " FROM claimed"
)
CLAIM_OUTBOX_PACKED = f"{_TAKEN} {_PACKED_CLAIMED.replace('count(*), ', f'count(*), {_MORE}, ', 1)}"
CLAIM_PACKED = (
    f"WITH claimed AS (SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE delivered_at IS NULL "
    "ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED), "
    f"marked AS (UPDATE {TABLE} AS l SET delivered_at = now() FROM claimed WHERE l.seq = claimed.seq) "
    + _PACKED_CLAIMED.replace("count(*), ", "count(*), count(*) = $1, ", 1)
)
# undelivered decisions (the outbox's, and the previous release's rows) and the age of the oldest
# of the two that the relays claim next
BACKLOG = (
    f"SELECT (SELECT count(*) FROM {TABLE} WHERE delivered_at IS NULL) + COALESCE((SELECT sum(n) FROM {OUTBOX}), 0), "
    f"GREATEST(COALESCE((SELECT extract(epoch FROM now() - recorded_at) FROM {TABLE} WHERE delivered_at IS NULL "
    f"ORDER BY seq LIMIT 1), 0), COALESCE((SELECT extract(epoch FROM now() - recorded_at) FROM {OUTBOX} "
    "ORDER BY id LIMIT 1), 0))"
)
# A rollback's last step (mlpair migrate --hand-back-outbox): the outbox's decisions back to the
# per-row work list of a release before ledger_0002: the rows up to $1 (the last when it started, so
# a pod still recording cannot keep it going), 100 a statement. FOR UPDATE waits for a claim in
# flight and then skips what it delivered, so nothing delivered is handed back.
HAND_BACK = (
    f"WITH handed AS (DELETE FROM {OUTBOX} WHERE id IN (SELECT id FROM {OUTBOX} WHERE id <= $1 ORDER BY id "
    "LIMIT 100 FOR UPDATE) "
    f"RETURNING seqs) UPDATE {TABLE} SET delivered_at = NULL WHERE seq IN (SELECT unnest(seqs) FROM handed)"
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
    # A claim locks whole outbox rows (SKIP LOCKED: other relays pass over them) and those it does
    # not take stay locked until its commit, so it asks for as many rows as should hold its limit,
    # judged from the decisions per row it last saw: locking 256 at once left a second relay
    # nothing to claim while the first delivered 25 decisions.
    most_outbox_rows_per_claim = 4096
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
                await conn.execute(
                    f"SELECT {_COLUMNS}, recorded_at, delivered_at, lease_until FROM {TABLE} WHERE false"
                )
                await conn.execute(f"SELECT id, seqs, n, recorded_at FROM {OUTBOX} WHERE false")
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
    async def claim(self, limit: int) -> AsyncIterator[ledger.Claimed]:
        """Claims the previous release's rows first (``delivered_at IS NULL``: none once a rollout
        is over, and while it lasts they must not wait behind a steady outbox), then outbox rows for
        the rest of ``limit``."""
        async with self._connection() as conn, conn.transaction():
            await conn.execute(CUSTOM_PLANS)
            previous = await conn.fetch(CLAIM, limit)
            batch = ledger.Claimed([row[1:] for row in previous], more=len(previous) == limit)
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
        text per CRM column in ``CRM_COLUMNS`` order, see ``crm/packed.py``); delivered when the
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
            yield ledger.PackedClaim(n, columns, bool(more))

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

    async def hand_back_outbox(self) -> int:
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
