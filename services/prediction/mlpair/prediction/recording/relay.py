"""The relay: delivers the decision ledger's undelivered rows to the CRM database.

Every replica runs one in its serving process, or, with ``relay_in_process`` off, ``mlpair relay``
runs it in a process of its own (:mod:`mlpair.prediction.relay_server`). Each round claims a batch (:meth:`DecisionLedger.claim`: no two relays
hold the same row), delivers it in one CRM transaction (``INSERT … ON CONFLICT DO NOTHING``) and
marks it delivered. While claims leave decisions waiting (a backlog), it claims up to ``concurrency``
batches at once where the ledger allows it (PostgreSQL: ``SKIP LOCKED`` claims never overlap),
so the two databases work on several batches in parallel instead of one round trip after
another. While the CRM is down it retries with full-jitter exponential backoff and the rows wait
in the ledger, where any replica — this one after a restart, or another after a scale down —
finds them. A CRM commit whose acknowledgement was lost is retried harmlessly: the rows
already there are skipped, so each request id is in the CRM exactly once. A decision the CRM
refuses for its data (a constraint or trigger of its own) holds back no other: the batch is
halved until that decision is alone, the rest are delivered, and it is requeued in the ledger
behind the queue (:meth:`LedgerRelay._deliver_isolating`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from mlpair.background import backoff_s, stop_task
from mlpair.prediction import metrics
from mlpair.prediction.recording.codecs import CRM_COLUMNS, CrmRow
from mlpair.prediction.recording.ledger import DecisionLedger, Requeue
from mlpair.prediction.recording.packed import SEP
from mlpair.prediction.recording.store import CrmStore

logger = logging.getLogger(__name__)


async def all_delivered(ledger: DecisionLedger) -> bool:
    """Whether nothing on record in ``ledger`` waits for delivery; False while the ledger does not answer."""
    try:
        return (await ledger.backlog())[0] == 0
    except Exception:  # noqa: BLE001  (the ledger is unreachable: keep waiting)
        logger.debug("ledger backlog unavailable", exc_info=True)
        return False


class LedgerRelay:
    """Delivers the ledger to the CRM database in the background.

    Args:
        ledger: where decisions are recorded.
        crm: the CRM database (migrated by ``mlpair migrate``).
        batch_size: most decisions per claim and CRM transaction.
        backoff_base_s, backoff_max_s: full-jitter exponential backoff between failed attempts.
        poll_s: longest sleep between looks at the ledger when no local commit wakes the relay
            (rows committed by other replicas, or left by a replica that went away).
        linger_s: once woken by a commit, how long to wait for more decisions before claiming, so
            one CRM transaction carries many decisions even under light load.
        concurrency: most batches claimed and delivered at once while a backlog lasts (capped by
            the ledger's ``relay_claims``); one at a time otherwise, and after any failure.
    """

    def __init__(
        self,
        ledger: DecisionLedger,
        crm: CrmStore,
        *,
        batch_size: int = 2048,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 5.0,
        poll_s: float = 1.0,
        linger_s: float = 0.05,
        concurrency: int = 1,
    ) -> None:
        self.ledger = ledger
        self.crm = crm
        self.batch_size = batch_size
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.poll_s = poll_s
        self.linger_s = linger_s
        self.concurrency = max(1, min(concurrency, ledger.relay_claims))
        self.crm_up: bool | None = None  # None until the first attempt
        self.delivered = 0  # decisions this relay inserted into the CRM
        self._failing = "ledger"  # which database the current delivery attempt failed at
        self._idle = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._claiming = True  # False once stop_claiming() asks for no new claims

    def start(self) -> None:
        """Starts the delivery loop as a task on the running event loop: it wakes on a local commit
        (after ``linger_s``) or every ``poll_s``, claims batches from the ledger and inserts them into
        the CRM, backing off after a failure. Call from a coroutine, once; :meth:`stop` ends it.
        """
        self._claiming = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-relay")

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failed attempts (:func:`mlpair.background.backoff_s`)."""
        return backoff_s(failures, self.backoff_base_s, self.backoff_max_s)

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Delivers what it can within ``drain_timeout_s``, then stops; the rest waits in the ledger."""
        if drain_timeout_s > 0:
            await self.wait_delivered(drain_timeout_s)
        await stop_task(self._task)

    async def stop_claiming(self, grace_s: float) -> bool:
        """Claims nothing more and lets the batches in flight finish for up to ``grace_s`` seconds
        (each then commits its delivery and its mark together), then stops; a batch still in flight
        after that is cancelled, its claim released undelivered for the next relay (a CRM insert
        that had committed is skipped on redelivery: ``ON CONFLICT DO NOTHING``).

        Returns:
            True when the relay stopped within ``grace_s`` without cancelling a batch.
        """
        self._claiming = False
        if self._task is None:
            return True
        self.ledger.committed.set()  # end a wait for the next commit or poll now
        done, _ = await asyncio.wait([self._task], timeout=grace_s)
        await self.stop()
        return bool(done)

    async def wait_delivered(self, timeout_s: float) -> bool:
        """Waits until nothing on record is undelivered (whichever replica delivers it); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._idle.clear()
            self.ledger.committed.set()  # wake the relay for a fresh look
            if await all_delivered(self.ledger):
                return True
            try:
                async with asyncio.timeout(max(0.0, min(self.poll_s, deadline - time.monotonic()))):
                    await self._idle.wait()
            except TimeoutError:
                pass
        return await all_delivered(self.ledger)

    async def _run(self) -> None:
        failures = 0
        while self._claiming:
            try:  # asyncio.timeout, not wait_for, which can swallow stop()'s cancellation (gh-86296)
                async with asyncio.timeout(self.poll_s):
                    await self.ledger.committed.wait()
                if self._claiming:
                    await asyncio.sleep(self.linger_s)
            except TimeoutError:
                pass
            self.ledger.committed.clear()
            width = 1  # batches claimed at once: more only while full batches keep coming
            while self._claiming:
                self._failing = "ledger"  # until the CRM write itself fails (_write)
                try:
                    more = await self._deliver_batches(width)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001  (the CRM or the ledger is down: back off, retry)
                    failures += 1
                    self._record_failure(exc, failures, self._failing)
                    width = 1
                    await self._sleep_unless_stopping(self.backoff_s(failures))
                    continue
                if failures:
                    logger.warning("CRM delivery works again after %d failed attempt(s)", failures)
                failures = 0
                if not more:  # the ledger had no more waiting than these claims took
                    break
                width = self.concurrency
            self._idle.set()

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        """Sleeps ``seconds``, or less once :meth:`stop_claiming` wakes the relay (``committed``)."""
        try:
            async with asyncio.timeout(seconds):
                while self._claiming:
                    self.ledger.committed.clear()
                    await self.ledger.committed.wait()
        except TimeoutError:
            pass

    async def _deliver_batches(self, width: int) -> bool:
        """``width`` batches claimed and delivered at once; whether more decisions were waiting.

        Raises:
            Exception: the first failure among them, once all have ended (the others' deliveries
                stand: each batch commits or rolls back on its own).
        """
        if width == 1:
            return await self._deliver_batch()
        outcomes = await asyncio.gather(*(self._deliver_batch() for _ in range(width)), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return any(outcomes)

    async def _deliver_batch(self) -> bool:
        """Claims one batch, delivers it and marks it delivered; returns whether more were waiting.

        From a PostgreSQL ledger to a PostgreSQL CRM the batch travels packed (``recording/packed.py``):
        one text per column, never one Python object per decision.

        Raises:
            RefusedByCrm: every decision of the claim was refused by the CRM and requeued (the
                claim itself committed): a failure for the backoff, so a refused decision alone in
                the queue is not retried in a tight loop.
        """
        if getattr(self.crm, "takes_packed", False) and hasattr(self.ledger, "claim_packed"):
            async with self.ledger.claim_packed(self.batch_size) as claim:
                refused = await self._deliver_packed(claim.n, claim.columns, claim.requeue)
            n, more = claim.n, claim.more
        else:
            async with self.ledger.claim(self.batch_size) as batch:
                refused = await self._deliver(batch, getattr(batch, "requeue", None))
            n, more = len(batch), getattr(batch, "more", len(batch) >= self.batch_size)
        if refused and refused == n:
            raise RefusedByCrm(f"the CRM refused all {n} decision(s) of the claim; requeued")
        return more

    async def _deliver_packed(self, n: int, columns: list[str], requeue: Requeue | None) -> int:
        if not n:
            return 0
        models = columns[_MODEL].split(SEP)[1:]
        values: list[list[str]] = []  # each column's values, split only once the CRM refuses a part

        def split() -> list[list[str]]:
            values[:] = values or [column.split(SEP)[1:] for column in columns]
            return values

        def part(rows: range) -> Awaitable[int]:
            if len(rows) == n:
                return self.crm.deliver_packed(columns)
            return self.crm.deliver_packed([SEP + SEP.join(v[rows.start : rows.stop]) for v in split()])

        return await self._deliver_isolating(n, part, lambda i: split()[_REQUEST_ID][i], models, requeue)

    async def _deliver(self, rows: list[CrmRow], requeue: Requeue | None) -> int:
        if not rows:
            return 0
        return await self._deliver_isolating(
            len(rows),
            lambda part: _count(self.crm.deliver_rows(rows[part.start : part.stop])),
            lambda i: rows[i][_REQUEST_ID],
            [row[_MODEL] for row in rows],
            requeue,
        )

    async def _deliver_isolating(
        self,
        n: int,
        insert: Callable[[range], Awaitable[int]],
        request_id: Callable[[int], str],
        models: list[str],
        requeue: Requeue | None,
    ) -> int:
        """Delivers decisions ``0..n-1`` (``insert(part)`` writes a contiguous part in one CRM
        transaction and returns how many were new); the number the CRM refused.

        A part the CRM refuses for its data (a constraint, a value it cannot store: IntegrityError,
        DataError), never for being away, is halved and each half tried again, so the decisions it
        does take are delivered in about 2·log2(n) transactions per refused one; a decision refused
        alone is requeued (``requeue``), counted and logged by its request id (the database's message,
        which may quote the row's values, is not). Without ``requeue`` (a ledger that cannot hold a
        decision back) the refusal fails the claim, as any other failure does.
        """
        refused: list[str] = []
        parts = [range(n)]
        while parts:
            rows = parts.pop()
            try:
                await self._write(
                    len(rows),
                    Counter(models[rows.start : rows.stop]),
                    lambda r=rows: insert(r),
                    split=requeue is not None,
                )
            except Exception as exc:
                if requeue is None or not _refused_for_its_data(exc):
                    raise
                if len(rows) > 1:
                    middle = rows.start + len(rows) // 2
                    parts += [range(middle, rows.stop), range(rows.start, middle)]
                else:
                    refused.append(request_id(rows.start))
        if refused and requeue is not None:  # (never without it: a refusal then raised above)
            await requeue(refused)
            metrics.CRM_REFUSED.inc(len(refused))
            logger.warning(
                "the CRM refused %d decision(s) for their data; they wait in the ledger and are retried "
                "behind the queue: request ids %s",
                len(refused),
                ", ".join(refused[:MAX_NAMED]) + (" …" if len(refused) > MAX_NAMED else ""),
            )
        return len(refused)

    async def _write(self, n: int, models: Counter, insert, *, split: bool = False) -> None:
        """One CRM transaction of ``n`` decisions (``models``: how many per model); ``insert()``
        returns how many were new in the CRM. With ``split``, a part of several decisions refused
        for its data is not counted as failed writes: the caller halves it, and each decision ends
        counted once. A refusal for data never marks the CRM down."""
        started = time.perf_counter()
        try:
            inserted = await insert()
        except Exception as exc:
            refused = _refused_for_its_data(exc)
            if refused and split and n > 1:
                raise
            if not refused:
                self.crm_up = False
            self._failing = "CRM"
            metrics.CRM_WRITE_DURATION.labels("error").observe(time.perf_counter() - started)
            _count_models(models, "error")
            raise
        metrics.CRM_WRITE_DURATION.labels("ok").observe(time.perf_counter() - started)
        _count_models(models, "ok")
        self.crm_up = True
        self.delivered += inserted
        metrics.OUTBOX_DELIVERED.inc(inserted)
        metrics.OUTBOX_ALREADY_IN_CRM.inc(n - inserted)

    def _record_failure(self, exc: Exception, failures: int, failing: str) -> None:
        """Counts a failed delivery; ``failing``: ``"CRM"`` when the CRM write raised, ``"ledger"``
        when the claim or its mark did (the line then says which database an operator should look at)."""
        metrics.RELAY_FAILURES.inc()
        if failures == 1 or failures % 20 == 0:  # one line per outage, then a reminder, not one per retry
            logger.warning(
                "CRM delivery failed (%d attempt(s) so far): %s from the %s; decisions wait in the ledger",
                failures,
                type(exc).__name__,
                failing,
            )


_MODEL = CRM_COLUMNS.index("model_name")
_REQUEST_ID = CRM_COLUMNS.index("request_id")
MAX_NAMED = 10  # request ids named in one log line


class RefusedByCrm(Exception):
    """Every decision of a claim was refused by the CRM for its data, and requeued."""


def _refused_for_its_data(exc: BaseException) -> bool:
    """Whether the CRM refused a write for what it holds (a constraint, a value it cannot store),
    not because it is unreachable: SQLAlchemy's IntegrityError and DataError, whatever the driver."""
    from sqlalchemy.exc import DataError, IntegrityError

    return isinstance(exc, (IntegrityError, DataError))


async def _count(inserting) -> int:
    """How many request ids an insert returned as new."""
    return len(await inserting)


def _count_models(models: Counter, outcome: str) -> None:
    """``prediction_crm_writes_total`` per model for one relay transaction's decisions."""
    for model, n in models.items():
        metrics.CRM_WRITES.labels(model, outcome).inc(n)
