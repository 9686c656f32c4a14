"""The decision ledger: one durable decision per request id, shared by every replica.

Every PredictionService replica writes each decision to the ledger **before** returning it, and
reads from it what any replica recorded first for the same request id (the idempotency key):

* **One decision per request id, everywhere.** ``request_id`` is unique in the ledger. A commit
  inserts what is new and reads back what is already on record (:class:`Recorded` with
  ``replayed = True``), so a retry on any replica, at any time, gets the decision recorded first,
  and concurrent first calls on several replicas all get the one that won the insert. Rows are
  never purged by PredictionService: the ledger keeps a request id as long as the CRM keeps its row.
* **The payload is checked.** Each row keeps the request's fingerprint
  (:func:`mlpair.prediction.preparing.idempotency.request_fingerprint`); the pipeline refuses a recorded id
  sent with another payload.
* **Durable before acknowledged.** :meth:`DecisionLedger.record_many` returns once the commit is
  durable; a failed commit is :class:`LedgerUnavailable` for each of its decisions, which are then
  never returned (fail closed: no answer the ledger could later contradict).
* **One way to commit, grouped.** Every commit is a batch of decisions as columns
  (:class:`DecisionColumns`) written by the engine's one statement (``_commit_rows``). Calls
  arriving while a commit is in progress go together into the next one (group commit), so the
  per-request cost stays near one commit however many requests are in flight; a call of at
  least ``bulk_rows`` decisions (a BatchPredict) is already a group and commits at once. An
  engine may run a few commits at once (``commit_concurrency``): PostgreSQL then flushes their
  WAL together, and a decision never waits for a whole commit before its own starts.
* **It is the CRM's outbox.** Rows start undelivered; :mod:`mlpair.prediction.recording.relay` on any
  replica claims a batch (:meth:`DecisionLedger.claim`), delivers it to the CRM database with
  ``INSERT … ON CONFLICT DO NOTHING`` and marks it delivered in the same claim.

Two engines implement it: PostgreSQL for replicas (:mod:`.ledger_postgres`, the production one;
docs/design.md says why PostgreSQL rather than NATS JetStream, with measured figures) and a SQLite
file for one machine (:mod:`.ledger_sqlite`, the embedded default of ``make demo``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from mlpair.prediction import metrics
from mlpair.prediction.errors import LedgerUnavailable
from mlpair.prediction.recording.codecs import CRM_COLUMNS, CrmRow, crm_row, ledger_columns, reason_codes_from_json
from mlpair.prediction.records import DecisionColumns, Recorded, RecordedBatch, StoredDecision, decision_id_for

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

# The decision's columns in the ledger, in the order every statement of both engines uses: the
# request id, the fingerprint of its request, then the decision's other fields.
DECISION_COLUMNS = ("request_id", "fingerprint", *DecisionColumns.FIELDS[1:])
_REASON_CODES = DECISION_COLUMNS.index("reason_codes") - 3  # its place after request id, fingerprint, decision id
_DECIDED_AT = DECISION_COLUMNS.index("decided_at") - 3
NOT_RECORDED = "the decision could not be recorded; retry with the same request_id"


def row_values(decision: StoredDecision, fingerprint: str, decided_at: Callable[[datetime], Any]) -> tuple:
    """The :data:`DECISION_COLUMNS` values of a decision; ``decided_at`` encodes the timestamp."""
    if decision.decided_at is None:  # complete() sets it before anything is recorded
        raise ValueError(f"decision {decision.request_id!r} has no decided_at")
    fields = crm_row(decision)  # StoredDecision's order: decision id, request id, …, decided at, caller
    return (fields[1], fingerprint, fields[0], *fields[2:-2], decided_at(decision.decided_at), fields[-1])


def decision_from_row(row: Sequence, decided_at: Callable[[Any], datetime]) -> tuple[StoredDecision, str]:
    """A decision and its fingerprint from the :data:`DECISION_COLUMNS` values of a row."""
    request_id, fingerprint, decision_id, *fields = row  # fields: entity id … decided at, caller
    fields[_REASON_CODES] = reason_codes_from_json(fields[_REASON_CODES])
    fields[_DECIDED_AT] = decided_at(fields[_DECIDED_AT])
    return StoredDecision(decision_id, request_id, *fields), fingerprint


def on_record(row: Sequence, decided_at: Callable[[Any], datetime]) -> Recorded:
    """What a ledger row holds, as a :class:`Recorded` replay (its :data:`DECISION_COLUMNS` values)."""
    decision, fingerprint = decision_from_row(row, decided_at)
    return Recorded(decision, True, fingerprint)


Requeue = Callable[[list[str]], Awaitable[None]]
"""Given request ids of a claim's decisions the CRM refused, keeps them undelivered for a later
claim (after the others of the queue), while the claim delivers the rest."""


class Claimed(list):
    """A claim's CRM rows (a list of ``CRM_COLUMNS`` tuples) and ``more``: whether undelivered
    decisions were left for the next claim, so a relay keeps claiming while a backlog lasts;
    ``requeue``: see :data:`Requeue`."""

    def __init__(self, rows: Iterable[CrmRow] = (), *, more: bool = False, requeue: Requeue | None = None) -> None:
        super().__init__(rows)
        self.more = more
        self.requeue = requeue


class PackedClaim(NamedTuple):
    """A claim's decisions packed (``recording/packed.py``): how many, one text per CRM column in
    ``CRM_COLUMNS`` order, whether more were waiting, and ``requeue`` (:data:`Requeue`)."""

    n: int
    columns: list[str]
    more: bool
    requeue: Requeue | None = None


class DecisionLedger(abc.ABC):
    """The ledger's interface and its group commit; the engines implement the statements.

    Attributes:
        committed: set after each commit; wakes this process's relay.
        reachable: whether the last commit or probe reached the ledger.
    """

    max_commit_rows = 500  # decisions per transaction
    commit_concurrency = 1  # transactions in progress at once
    db_system = ""  # OpenTelemetry's name of the engine
    bulk_rows = 0  # a DecisionColumns batch of at least this many rows commits on its own (0: never)
    relay_claims = 1  # claims one relay may hold at once (more only where claims never overlap and run in parallel)

    def __init__(self) -> None:
        self.committed = asyncio.Event()
        self.reachable = True
        self._pending: list[tuple[DecisionColumns, asyncio.Future[RecordedBatch]]] = []  # calls waiting
        self._writers: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None  # commits in progress at once: commit_concurrency
        self._tracer: Tracer | None = None  # set by instrument()

    @abc.abstractmethod
    async def open(self) -> None:
        """Connects (lazily where the engine allows) and checks the schema when reachable.

        Raises:
            mlpair.prediction.recording.migrate.SchemaNotReady: the ledger table lacks what this release
                uses (``mlpair migrate`` has not run).
        """

    async def close(self) -> None:
        """Waits for pending commits, then releases the connections."""
        if self._writers:
            await asyncio.gather(*self._writers, return_exceptions=True)

    async def record_many(
        self, decisions: Sequence[StoredDecision], fingerprints: Sequence[str]
    ) -> Sequence[Recorded | LedgerUnavailable]:
        """Commits the decisions not yet on record: with the calls waiting beside it (group commit),
        or at once when it holds ``bulk_rows`` decisions or more.

        Args:
            decisions: the decisions made (a :class:`DecisionColumns`, or any sequence of
                :class:`StoredDecision`); an empty ``decision_id`` becomes :func:`decision_id_for`
                the request id, an unset ``decided_at`` now (UTC).
            fingerprints: the fingerprint of each decision's request.

        Returns:
            Per decision, what is on record for its request id, or the
            :class:`LedgerUnavailable` that kept it from the record (then it must not be returned).
        """
        if not decisions:
            return []
        with self._commit_span():
            batch = as_columns(decisions, fingerprints)
            if self.bulk_rows and len(batch) >= self.bulk_rows:
                return await self._record_columns(batch)
            loop = asyncio.get_running_loop()
            future: asyncio.Future[RecordedBatch] = loop.create_future()
            self._pending.append((batch, future))
            # a writer that is not done re-reads the pending list after its commit: one is enough unless
            # the engine takes more commits at once (done ones are discarded only by a later callback)
            if sum(not w.done() for w in self._writers) < self.commit_concurrency:
                writer = loop.create_task(self._write_pending())
                self._writers.add(writer)
                writer.add_done_callback(self._writers.discard)
            return await future

    def _commit_span(self) -> contextlib.AbstractContextManager[object]:
        """The ``ledger INSERT`` span of a commit the caller waits for (a child of its Predict's
        span), once :meth:`instrument` has run; otherwise nothing."""
        if self._tracer is None:
            return contextlib.nullcontext()
        from opentelemetry.trace import SpanKind

        return self._tracer.start_as_current_span(
            "ledger INSERT",
            kind=SpanKind.CLIENT,
            attributes={"db.system": self.db_system, "db.operation.name": "INSERT"},
        )

    def instrument(self, tracer: Tracer) -> None:
        """Traces each commit :meth:`record_many` waits for, with ``tracer``."""
        self._tracer = tracer

    @abc.abstractmethod
    async def find(self, request_id: str) -> Recorded | None:
        """What is on record for ``request_id`` (``replayed`` True), if anything."""

    @abc.abstractmethod
    def claim(self, limit: int) -> contextlib.AbstractAsyncContextManager[Claimed]:
        """Claims up to ``limit`` undelivered decisions, oldest first, that no other relay holds,
        as the CRM rows to insert
        (:data:`~mlpair.prediction.recording.codecs.CRM_COLUMNS` tuples: no decoding into objects on
        the way from one table to the other), with whether more were waiting (``Claimed.more``).

        On a normal exit of the ``async with`` body the decisions are marked delivered; on an
        exception they are released, undelivered, for the next claim (of any replica).
        """

    async def hand_back_outbox(self) -> int:
        """Gives the decisions waiting in an outbox back to the per-row work list; how many. Only
        the PostgreSQL ledger has an outbox: nothing to do here."""
        return 0

    @abc.abstractmethod
    async def audit_record(self, request_id: str) -> str | None:
        """The audit record of ``request_id`` (JSON text, ``recording/audit.py``), or None (none
        kept, or past retention)."""

    @abc.abstractmethod
    async def prune_audit(self, older_than_s: float) -> int:
        """Deletes audit records recorded more than ``older_than_s`` seconds ago (the decisions
        stay); returns how many."""

    @abc.abstractmethod
    async def backlog(self) -> tuple[int, float]:
        """Undelivered decisions and the age in seconds of the oldest (0 when none)."""

    @abc.abstractmethod
    async def probe(self) -> bool:
        """Whether the ledger answers a read of its table now (sets :attr:`reachable`)."""

    @abc.abstractmethod
    async def import_decisions(self, decisions: Sequence[StoredDecision], *, delivered: bool) -> int:
        """Adds decisions recorded elsewhere (an old outbox, the CRM) with an unknown fingerprint;
        request ids already on record are left alone. Returns how many were added."""

    async def _record_columns(self, batch: DecisionColumns) -> RecordedBatch:
        """Commits ``batch`` in transactions of at most ``max_commit_rows`` rows, its columns sent as
        they are. A request id repeated within the batch is a retry of its first occurrence."""
        outcome = RecordedBatch(batch)
        first: dict[str, int] = {}
        for i, request_id in enumerate(batch.request_id):
            first.setdefault(request_id, i)
        # sorted by request id: concurrent transactions take the unique index's locks in one order
        order = sorted(first.values(), key=batch.request_id.__getitem__)
        columns = ledger_columns(batch)  # encoded once for all of the batch's transactions
        for start in range(0, len(order), self.max_commit_rows):
            rows = order[start : start + self.max_commit_rows]
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.commit_concurrency)
            started = time.perf_counter()
            try:
                async with self._slots:  # commit_concurrency transactions at most: the relay keeps a connection
                    replays = await self._commit_rows(batch, rows, columns)
            except Exception as exc:  # noqa: BLE001  (every row of the transaction gets a retryable error)
                self.reachable = False
                logger.warning(
                    "decision ledger commit failed (%s); %d decision(s) not recorded", type(exc).__name__, len(rows)
                )
                error = LedgerUnavailable(NOT_RECORDED)
                outcome.errors.update((i, error) for i in rows)
                continue
            self.reachable = True
            metrics.LEDGER_COMMIT_DURATION.observe(time.perf_counter() - started)
            metrics.LEDGER_COMMIT_ROWS.observe(len(rows))
            self.committed.set()
            outcome.replays.update(replays)
        if len(first) < len(batch):  # a request id repeated within the batch: a retry of its first occurrence
            for i, request_id in enumerate(batch.request_id):
                j = first[request_id]
                if i == j:
                    continue
                if j in outcome.errors:
                    outcome.errors[i] = outcome.errors[j]
                else:
                    recorded = outcome.replays.get(j) or Recorded(batch[j], False, batch.fingerprints[j])
                    outcome.replays[i] = Recorded(recorded.decision, True, recorded.fingerprint)
        return outcome

    @abc.abstractmethod
    async def _commit_rows(self, batch: DecisionColumns, rows: list[int], columns: list[list]) -> dict[int, Recorded]:
        """One transaction inserting rows ``rows`` of ``batch`` (distinct request ids, sorted;
        ``columns``: all of the batch as the ledger's columns, :func:`~mlpair.prediction.recording.codecs.ledger_columns`)
        atomically; returns row → what was on record before, for the rows that were."""

    async def _write_pending(self) -> None:
        """Commits the waiting calls' decisions together, ``max_commit_rows`` at a time, and hands
        each call its own part of the outcome."""
        while self._pending:
            taken, rows = 0, 0
            while taken < len(self._pending) and (
                not taken or rows + len(self._pending[taken][0]) <= self.max_commit_rows
            ):
                rows += len(self._pending[taken][0])
                taken += 1
            calls, self._pending = self._pending[:taken], self._pending[taken:]
            try:
                outcome = await self._record_columns(DecisionColumns.concat([batch for batch, _ in calls]))
            except Exception as exc:  # noqa: BLE001  (a failure here must not leave a caller waiting)
                for _, future in calls:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), part in zip(calls, outcome.split([batch for batch, _ in calls])):
                if not future.done():  # a caller that went away still has its decisions on record
                    future.set_result(part)


def as_columns(decisions: Sequence[StoredDecision], fingerprints: Sequence[str]) -> DecisionColumns:
    """``decisions`` with ``fingerprints`` as one :class:`DecisionColumns`, each with its id and
    time set (:func:`complete`)."""
    if (  # as the pipeline makes them
        isinstance(decisions, DecisionColumns) and "" not in decisions.decision_id and None not in decisions.decided_at
    ):
        return (
            decisions if fingerprints is decisions.fingerprints else replace(decisions, fingerprints=list(fingerprints))
        )
    completed = list(map(complete, decisions))
    columns = {name: [getattr(d, name) for d in completed] for name in DecisionColumns.FIELDS}
    return DecisionColumns(**columns, fingerprints=list(fingerprints))


def complete(decision: StoredDecision) -> StoredDecision:
    """The decision with its id and time set (derived from the request id, and now, when unset)."""
    if decision.decision_id and decision.decided_at:  # the pipeline sets both; other callers may not
        return decision
    return replace(
        decision,
        decision_id=decision.decision_id or decision_id_for(decision.request_id),
        decided_at=decision.decided_at or datetime.now(UTC),
    )


def open_ledger(
    url: str,
    *,
    timeout_s: float = 2.0,
    synchronous: str = "FULL",
    pool_size: int = 4,
    statement_cache_size: int = 100,
    relay_only: bool = False,
    events: bool = False,
) -> DecisionLedger:
    """The ledger at ``url`` (no I/O yet): ``postgresql+asyncpg://…`` for replicas, or
    ``sqlite+aiosqlite:///path`` for one machine.

    Args:
        url: SQLAlchemy URL of the ledger database.
        timeout_s: connect and statement timeout (PostgreSQL), lock wait (SQLite), in seconds.
        synchronous: SQLite only: ``FULL`` (fsync per commit) or ``NORMAL`` (survives a process crash).
        pool_size: PostgreSQL only: most connections of this process.
        statement_cache_size: PostgreSQL only: asyncpg's prepared statements per connection
            (0 behind PgBouncer in transaction mode).
        relay_only: PostgreSQL only: this process only delivers (``mlpair relay``): no connection is
            kept for commits, so the relay may claim with all but one (kept for health's reads).
        events: PostgreSQL only: each commit queues its decisions for the event relay too.

    Raises:
        ValueError: neither a PostgreSQL nor a SQLite URL, or decision events asked of a SQLite ledger.
    """
    if url.startswith("postgresql"):
        from mlpair.prediction.recording.ledger_postgres import PostgresLedger

        return PostgresLedger(
            url,
            timeout_s=timeout_s,
            pool_size=pool_size,
            statement_cache_size=statement_cache_size,
            relay_only=relay_only,
            events=events,
        )
    if url.startswith("sqlite") and events:
        raise ValueError("decision events are relayed from the PostgreSQL ledger's outbox; this ledger is SQLite")
    if url.startswith("sqlite"):
        from mlpair.prediction.recording.ledger_sqlite import SqliteLedger

        return SqliteLedger(url, synchronous=synchronous, busy_timeout_s=timeout_s)
    raise ValueError(f"the decision ledger is a PostgreSQL or SQLite database, not {url.split(':', 1)[0]!r}")


CLAIMED_COLUMNS = ", ".join(CRM_COLUMNS)  # what a claim selects, in the CRM's order
