"""The decision ledger in a SQLite file: the embedded default, for processes on one machine.

Every process on the machine (``make demo``'s PredictionService, or several workers) opens the
same file: SQLite's write lock serialises commits across processes, so one request id still gets
one decision. Relays claim rows with a **lease** (``lease_until``), not a lock held while the CRM
is called: a claim is one short write transaction, delivery happens outside it, and a relay that
died mid-delivery leaves its rows to others once the lease expires. For replicas on several
machines use PostgreSQL (:mod:`.ledger_postgres`).

Statements run through the standard library's ``sqlite3`` on one dedicated thread (one thread
hop per group commit) rather than SQLAlchemy's asyncio layer and aiosqlite (four thread hops and
far more CPU per insert-and-commit: docs/decisions/0001-decision-ledger-in-postgresql.md). With
synchronous FULL every commit adds one fsync. Alembic owns the schema (``mlpair migrate``);
timestamps are Unix seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from sqlalchemy import make_url

from mlpair.prediction.recording import ledger
from mlpair.prediction.recording.migrate import SchemaNotReady
from mlpair.prediction.recording.models import AUDIT_TABLE, LEDGER_TABLE
from mlpair.prediction.records import DecisionColumns, Recorded, StoredDecision

LEASE_S = 60.0  # how long a relay's claim keeps other relays off its rows (longer than a CRM transaction)
REQUEUE_AFTER_S = 30.0  # a decision the CRM refused is claimed again after this (not before the others)
_REQUEST_ID = 1 + ledger.CLAIMED_COLUMNS.split(", ").index("request_id")  # in a claimed row (seq first)
_COLUMNS = ", ".join(ledger.DECISION_COLUMNS)
_SELECT = f"SELECT {_COLUMNS} FROM {LEDGER_TABLE}"


def _iso(value: datetime) -> str:
    return value.isoformat()


class SqliteLedger(ledger.DecisionLedger):
    """The ledger in one SQLite file (WAL), shared by the processes of one machine.

    Args:
        url: SQLAlchemy URL of the file (``sqlite+aiosqlite:///path``), created by ``mlpair migrate``.
        synchronous: ``FULL`` (fsync per commit: survives power loss) or ``NORMAL`` (survives a
            process crash, not an OS crash).
        busy_timeout_s: how long a write waits for another process's write lock.
    """

    db_system = "sqlite"

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> None:
        super().__init__()
        database = make_url(url).database
        if not database or database == ":memory:":
            raise ValueError("a SQLite decision ledger is a file (sqlite+aiosqlite:///path)")
        self.path = Path(database)
        self.synchronous = "FULL" if synchronous == "FULL" else "NORMAL"
        self.busy_timeout_s = busy_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        """Opens the ledger file in WAL mode with the configured ``synchronous`` level and checks its schema.

        Raises:
            SchemaNotReady: no file at the path, or it lacks the table or columns this release uses
                (run ``mlpair migrate`` with the same ledger URL).
        """
        await self._run(self._open)

    async def close(self) -> None:
        """Waits for pending group commits, closes the connection and lets its worker thread end."""
        await super().close()
        if self._conn is not None:
            await self._run(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=False)

    async def find(self, request_id: str) -> Recorded | None:
        """The decision on record for ``request_id`` (``replayed`` True), or None."""
        row = await self._run(self._one, f"{_SELECT} WHERE request_id = ?", (request_id,))
        return None if row is None else ledger.on_record(row, datetime.fromisoformat)

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[ledger.Claimed]:
        """Leases up to ``limit`` undelivered decisions, lowest ``seq`` first, that no other relay
        holds (``lease_until`` unset or past), for ``LEASE_S`` seconds.

        On a normal exit of the ``async with`` body they are marked delivered, except those the body
        requeued (the CRM refused them), which are leased again for ``REQUEUE_AFTER_S`` seconds; on an
        exception the lease is released for the next claim.
        """
        now = time.time()
        rows = await self._run(
            self._write_returning,
            f"UPDATE {LEDGER_TABLE} SET lease_until = ? WHERE seq IN (SELECT seq FROM {LEDGER_TABLE} "
            "WHERE delivered_at IS NULL AND (lease_until IS NULL OR lease_until < ?) ORDER BY seq "
            f"LIMIT ?) RETURNING seq, {ledger.CLAIMED_COLUMNS}",
            (now + LEASE_S, now, limit),
        )
        rows.sort(key=lambda row: row[0])  # RETURNING does not keep the subquery's order
        seqs = [row[0] for row in rows]
        refused: list[int] = []  # requeued: leased until REQUEUE_AFTER_S from now, not delivered

        async def requeue(request_ids: list[str]) -> None:
            wanted = set(request_ids)
            refused.extend(row[0] for row in rows if row[_REQUEST_ID] in wanted)

        try:
            # decided_at is ISO text here
            yield ledger.Claimed(
                [(*row[1:-2], datetime.fromisoformat(row[-2]), row[-1]) for row in rows],  # (…, decided at, caller)
                more=len(rows) == limit,
                requeue=requeue,
            )
        except BaseException:
            if seqs:
                await asyncio.shield(
                    self._run(
                        self._write,
                        f"UPDATE {LEDGER_TABLE} SET lease_until = NULL WHERE seq IN ({_marks(seqs)})",
                        tuple(seqs),
                    )
                )
            raise
        if refused:
            await self._run(
                self._write,
                f"UPDATE {LEDGER_TABLE} SET lease_until = ? WHERE seq IN ({_marks(refused)})",
                (time.time() + REQUEUE_AFTER_S, *refused),
            )
            held_back = set(refused)
            seqs = [seq for seq in seqs if seq not in held_back]
        if seqs:
            await self._run(
                self._write,
                f"UPDATE {LEDGER_TABLE} SET delivered_at = ?, lease_until = NULL WHERE seq IN ({_marks(seqs)})",
                (time.time(), *seqs),
            )

    async def backlog(self) -> tuple[int, float]:
        """Undelivered decisions and the age in seconds (wall clock) of the oldest recorded; 0 when none."""
        count, oldest = await self._run(
            self._one, f"SELECT count(*), min(recorded_at) FROM {LEDGER_TABLE} WHERE delivered_at IS NULL", ()
        )
        return int(count), (time.time() - oldest) if oldest is not None else 0.0

    async def probe(self) -> bool:
        """Whether the ledger can still take a write: takes SQLite's write lock, changes nothing."""
        try:
            await self._run(self._write, f"UPDATE {LEDGER_TABLE} SET seq = seq WHERE 0", ())
        except Exception:  # noqa: BLE001  (unwritable for whatever reason: not ready)
            self.reachable = False
            return False
        self.reachable = True
        return True

    async def import_decisions(self, decisions: Sequence[StoredDecision], *, delivered: bool) -> int:
        """Adds ``decisions`` recorded elsewhere (an old outbox, the CRM) with an empty fingerprint;
        request ids already on record are left alone (``INSERT OR IGNORE``). ``delivered`` marks the
        added rows delivered now. Returns how many were added.
        """
        now = time.time()
        rows = [
            (*ledger.row_values(d, "", _iso), now, now if delivered else None) for d in map(ledger.complete, decisions)
        ]
        return await self._run(
            self._executemany,
            f"INSERT OR IGNORE INTO {LEDGER_TABLE} ({_COLUMNS}, recorded_at, delivered_at) "
            f"VALUES ({_marks(ledger.DECISION_COLUMNS)}, ?, ?)",
            rows,
        )

    async def _commit_rows(self, batch: DecisionColumns, rows: list[int], columns: list[list]) -> dict[int, Recorded]:
        return await self._run(self._commit_rows_sync, batch.request_id, rows, columns, batch.audit)

    async def audit_record(self, request_id: str) -> str | None:
        """The audit record of ``request_id`` (JSON text), or None."""
        row = await self._run(
            self._one,
            f"SELECT a.record FROM {AUDIT_TABLE} a JOIN {LEDGER_TABLE} l ON l.seq = a.seq WHERE l.request_id = ?",
            (request_id,),
        )
        return None if row is None else row[0]

    async def prune_audit(self, older_than_s: float) -> int:
        """Deletes audit records recorded more than ``older_than_s`` seconds ago; how many."""
        cutoff = time.time() - older_than_s
        return await self._run(self._write, f"DELETE FROM {AUDIT_TABLE} WHERE recorded_at < ?", (cutoff,))

    # Everything below runs on the ledger thread, one call at a time.

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        if not self.path.is_file():
            raise SchemaNotReady(
                f"no decision ledger at {self.path}: run `mlpair migrate` with the same ledger URL (--ledger-url / PREDICTION_LEDGER_URL)"
            )
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        try:
            conn.execute(f"SELECT {_COLUMNS}, recorded_at, delivered_at, lease_until FROM {LEDGER_TABLE} WHERE 0")
            conn.execute(f"SELECT seq, record, recorded_at FROM {AUDIT_TABLE} WHERE 0")
        except sqlite3.OperationalError as exc:
            conn.close()
            raise SchemaNotReady(
                f"the decision ledger at {self.path} lacks the {LEDGER_TABLE} table or columns "
                "this release uses: run `mlpair migrate` with the same ledger URL (--ledger-url / PREDICTION_LEDGER_URL)"
            ) from exc
        self._conn = conn

    @property
    def _db(self) -> sqlite3.Connection:
        """The open connection.

        Raises:
            RuntimeError: the ledger was not opened (or is closed).
        """
        if self._conn is None:
            raise RuntimeError("the SQLite decision ledger is not open")
        return self._conn

    def _one(self, sql: str, params: tuple):
        return self._db.execute(sql, params).fetchone()

    def _write(self, sql: str, params: tuple) -> int:
        with self._transaction():
            return self._db.execute(sql, params).rowcount

    def _write_returning(self, sql: str, params: tuple) -> list:
        with self._transaction():
            return self._db.execute(sql, params).fetchall()

    def _executemany(self, sql: str, rows: list) -> int:
        with self._transaction():
            return self._db.executemany(sql, rows).rowcount

    @contextlib.contextmanager
    def _transaction(self):
        self._db.execute("BEGIN IMMEDIATE")  # take the write lock now, not halfway through
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _commit_rows_sync(
        self, request_ids: list[str], rows: list[int], columns: list[list], audit: list[str] | None
    ) -> dict[int, Recorded]:
        ids = [request_ids[i] for i in rows]
        with self._transaction():  # the write lock first: what is on record cannot change before the insert
            found = self._db.execute(f"{_SELECT} WHERE request_id IN ({_marks(ids)})", ids).fetchall()
            held = {r.decision.request_id: r for r in (ledger.on_record(row, datetime.fromisoformat) for row in found)}
            new = [i for i in rows if request_ids[i] not in held] if held else rows
            if new:
                now = time.time()
                *fields, decided_at, caller = columns
                self._db.executemany(
                    f"INSERT INTO {LEDGER_TABLE} ({_COLUMNS}, recorded_at) VALUES ({_marks(ledger.DECISION_COLUMNS)}, ?)",
                    [(*(column[i] for column in fields), decided_at[i].isoformat(), caller[i], now) for i in new],
                )
                if audit is not None:  # what each new decision was based on, in the same transaction
                    self._db.executemany(
                        f"INSERT INTO {AUDIT_TABLE} (seq, record, recorded_at) "
                        f"SELECT seq, ?, ? FROM {LEDGER_TABLE} WHERE request_id = ?",
                        [(audit[i], now, request_ids[i]) for i in new if audit[i]],
                    )
        return {i: held[request_ids[i]] for i in rows if request_ids[i] in held} if held else {}


def _marks(values: Sequence) -> str:
    return ", ".join("?" * len(values))
