"""Durable, exactly-once decision recording: the shared decision ledger now, the CRM database soon after.

The ledger, its relays and the CRM store, built, started and stopped together. The pipeline
records through the ledger itself (:meth:`DecisionLedger.record_many` returns only after the
decisions are committed, or with what another replica recorded first for the same request id);
the relay delivers them to the CRM database whether that is up now or comes back later: this
process's relay, or, with ``relay_in_process`` off, ``mlpair relay`` in a process of its own
(:mod:`mlpair.prediction.relay_server`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from mlpair.prediction.recording.event_relay import EventRelay
from mlpair.prediction.recording.ledger import DecisionLedger, open_ledger
from mlpair.prediction.recording.migrate import CRM_BRANCH, SchemaNotReady, check_columns
from mlpair.prediction.recording.relay import LedgerRelay, all_delivered
from mlpair.prediction.recording.store import CrmStore

if TYPE_CHECKING:
    from mlpair.prediction.settings import PredictionSettings

logger = logging.getLogger(__name__)


BACKLOG_POLL_S = 0.1  # how often wait_delivered looks at the backlog when another process delivers it
PRUNE_EVERY_S = 3600.0  # how often audit records past their retention are deleted


class DecisionRecorder:
    """The decision ledger, its relay and the CRM database, started and stopped together.

    ``relay`` None: this process only records; another process (``mlpair relay``) delivers the
    ledger to the CRM. The CRM database is still opened, for the schema check at start-up and the
    health check (:mod:`mlpair.prediction.health`). ``events``: the decision events' relay, run
    beside ``relay``. ``audit_retention_s`` > 0: where a relay runs, audit records older than that
    are deleted every ``PRUNE_EVERY_S`` (the decisions stay).
    """

    def __init__(
        self,
        ledger: DecisionLedger,
        crm: CrmStore,
        relay: LedgerRelay | None,
        events: EventRelay | None = None,
        audit_retention_s: float = 0.0,
    ) -> None:
        self.ledger = ledger
        self.crm = crm
        self.relay = relay
        self.events = events
        self.audit_retention_s = audit_retention_s
        self._pruning: asyncio.Task | None = None

    def instrument(self, tracer_provider=None) -> None:
        """Traces each ledger commit (``ledger INSERT``, child of the Predict span: the durable
        write the response waits for) and each CRM statement of the relay (``crm INSERT``, in the
        relay's own trace, since delivery happens after the response)."""
        from opentelemetry import trace

        from mlpair.observability.tracing import INSTRUMENTATION_NAME, instrument_engine

        self.ledger.instrument(trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider))
        instrument_engine(self.crm.engine, tracer_provider)

    @classmethod
    def open(
        cls,
        ledger_url: str,
        crm_url: str,
        *,
        ledger_timeout_s: float = 2.0,
        synchronous: str = "FULL",
        pool_size: int = 4,
        statement_cache_size: int = 100,
        crm_timeout_s: float = 5.0,
        batch_size: int = 2048,
        linger_s: float = 0.05,
        backoff_max_s: float = 5.0,
        crm_statement_cache_size: int = 100,
        relay_concurrency: int = 3,
        relay_poll_s: float = 1.0,
        relay_in_process: bool = True,
        relay_only: bool = False,
        events: dict | None = None,
        audit_retention_s: float = 0.0,
    ) -> DecisionRecorder:
        """Builds the three parts (no I/O yet); see :func:`open_ledger` for the ledger's arguments and
        :func:`~mlpair.prediction.recording.store.make_engine` for ``crm_statement_cache_size``;
        ``relay_poll_s`` is the relay's ``poll_s`` (:class:`LedgerRelay`); ``relay_in_process`` False
        builds no relay (``mlpair relay`` delivers); ``relay_only``: this process only delivers
        (``mlpair relay``), so the relay's claims may use the ledger connections commits would keep;
        ``events``: the decision events' sink (``url``, ``subject``, ``stream``, ``mode``,
        ``duplicate_window_s``, ``batch_size``), or None for none."""
        ledger = open_ledger(
            ledger_url,
            timeout_s=ledger_timeout_s,
            synchronous=synchronous,
            pool_size=pool_size,
            statement_cache_size=statement_cache_size,
            relay_only=relay_only,
            events=events is not None,
        )
        crm = CrmStore(crm_url, timeout_s=crm_timeout_s, statement_cache_size=crm_statement_cache_size)
        relay = LedgerRelay(
            ledger,
            crm,
            batch_size=batch_size,
            linger_s=linger_s,
            backoff_max_s=backoff_max_s,
            poll_s=relay_poll_s,
            concurrency=relay_concurrency,
        )
        event_relay = None
        if events is not None and relay_in_process:
            from mlpair.prediction.recording.events import JetStreamSink
            from mlpair.prediction.recording.ledger_postgres import PostgresLedger

            options = dict(events)
            sink = JetStreamSink(
                options.pop("url"),
                subject=options.pop("subject"),
                stream=options.pop("stream"),
                duplicate_window_s=options.pop("duplicate_window_s"),
            )
            assert isinstance(ledger, PostgresLedger)  # open_ledger refuses events on any other engine
            event_relay = EventRelay(ledger, sink, **options)
        relay_here = relay if relay_in_process else None
        return cls(ledger, crm, relay_here, event_relay, audit_retention_s if relay_here else 0.0)

    async def start(self) -> None:
        """Opens the ledger, checks both schemas where reachable, and starts the relay (if this
        process runs one). Nothing is
        migrated here (``mlpair migrate`` does that, with a schema-owner role). The CRM database
        may be down: decisions then wait in the ledger.

        Raises:
            SchemaNotReady: the ledger or the CRM database lacks what this release uses.
        """
        await self.ledger.open()
        try:
            await check_columns(self.crm.engine, CRM_BRANCH)
        except SchemaNotReady:
            raise
        except Exception as exc:  # noqa: BLE001  (down now: the relay keeps trying)
            logger.warning(
                "CRM database not reachable at start-up (%s); decisions wait in the ledger", type(exc).__name__
            )
        if self.relay is not None:
            self.relay.start()
        if self.events is not None:
            self.events.start()
        if self.audit_retention_s > 0:
            self._pruning = asyncio.get_running_loop().create_task(self._prune(), name="audit-retention")

    async def _prune(self) -> None:
        """Deletes audit records past their retention now and every ``PRUNE_EVERY_S``."""
        while True:
            try:
                if pruned := await self.ledger.prune_audit(self.audit_retention_s):
                    logger.info("%d audit record(s) past their retention deleted", pruned)
            except Exception as exc:  # noqa: BLE001  (the ledger is down: the next round deletes them)
                logger.warning("audit records not pruned (%s)", type(exc).__name__)
            await asyncio.sleep(PRUNE_EVERY_S)

    async def wait_delivered(self, timeout_s: float) -> bool:
        """Waits until every decision on record is in the CRM database, delivered by this process's
        relay or by another process; False on timeout (``timeout_s`` in seconds)."""
        if self.relay is not None:
            return await self.relay.wait_delivered(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            if await all_delivered(self.ledger):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(BACKLOG_POLL_S, max(0.0, deadline - time.monotonic())))

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Stops the relay after delivering what it can within ``drain_timeout_s``; what is left
        stays in the ledger, where any replica's relay delivers it. Without a relay of its own the
        process waits for no delivery: the ledger holds the rows for ``mlpair relay``."""
        if self._pruning is not None:
            self._pruning.cancel()
        if self.events is not None:
            await self.events.stop()
        if self.relay is not None:
            await self.relay.stop(drain_timeout_s)
        try:
            backlog, _ = await self.ledger.backlog()
        except Exception:  # noqa: BLE001
            backlog = 0
        if backlog:
            logger.info("%d decision(s) not yet in the CRM wait in the ledger for any relay", backlog)
        await self.ledger.close()
        await self.crm.close()


def recorder_for(
    settings: PredictionSettings, *, relay_poll_s: float = 1.0, relay: bool | None = None, relay_only: bool = False
) -> DecisionRecorder:
    """:meth:`DecisionRecorder.open` with the ledger, CRM and relay settings of ``settings`` (no I/O yet).

    Args:
        relay_poll_s: the relay's longest sleep between looks at the ledger, in seconds.
        relay: whether to build a relay; None = as ``settings.relay_in_process`` says.
        relay_only: the process only delivers (``mlpair relay``): see :meth:`DecisionRecorder.open`.
    """
    return DecisionRecorder.open(
        settings.ledger_url,
        settings.crm_url,
        ledger_timeout_s=settings.ledger_timeout_ms / 1000,
        synchronous=settings.ledger_synchronous,
        pool_size=settings.ledger_pool_size,
        statement_cache_size=settings.ledger_statement_cache_size,
        crm_timeout_s=settings.crm_timeout_ms / 1000,
        crm_statement_cache_size=settings.crm_statement_cache_size,
        batch_size=settings.relay_batch_size,
        linger_s=settings.relay_linger_ms / 1000,
        backoff_max_s=settings.relay_backoff_max_ms / 1000,
        relay_concurrency=settings.relay_concurrency,
        relay_poll_s=relay_poll_s,
        relay_in_process=settings.relay_in_process if relay is None else relay,
        relay_only=relay_only,
        events=None
        if not settings.events_url
        else {
            "url": settings.events_url,
            "subject": settings.events_subject,
            "stream": settings.events_stream,
            "duplicate_window_s": settings.events_duplicate_window_s,
            "mode": settings.events_mode,
            "batch_size": settings.events_batch_size,
        },
        audit_retention_s=settings.audit_retention_days * 86400.0,
    )
