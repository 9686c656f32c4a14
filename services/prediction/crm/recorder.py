"""Durable, exactly-once decision recording: the outbox now, the CRM database soon after.

The one object the prediction core talks to about the CRM: :meth:`DecisionRecorder.record`
returns only after the decision is committed locally, and the relay delivers it to the CRM
database whether that is up now or comes back later.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from mlpair.prediction import metrics
from mlpair.prediction.crm.outbox import Outbox, OutboxRelay, Recorded
from mlpair.prediction.crm.store import CrmStore, StoredDecision
from mlpair.prediction.errors import OutboxUnavailable

logger = logging.getLogger(__name__)


class DecisionRecorder:
    """The outbox, its relay and the CRM database, started and stopped together."""

    def __init__(self, outbox: Outbox, crm: CrmStore, relay: OutboxRelay) -> None:
        self.outbox = outbox
        self.crm = crm
        self.relay = relay
        self._tracer = None  # set by instrument(): spans for the durable write of each decision

    def instrument(self, tracer_provider=None) -> None:
        """Traces each outbox commit (``outbox INSERT``, child of the Predict span: the durable
        write the response waits for) and each CRM statement of the relay (``crm INSERT``, in the
        relay's own trace, since delivery happens after the response)."""
        from opentelemetry import trace

        from mlpair.observability.tracing import INSTRUMENTATION_NAME, instrument_engine

        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        instrument_engine(self.crm.engine, tracer_provider)

    @classmethod
    def open(cls, outbox_url: str, crm_url: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0,
             crm_timeout_s: float = 5.0,
             batch_size: int = 2048, linger_s: float = 0.05, backoff_max_s: float = 5.0,
             retention_s: float = 86400.0) -> DecisionRecorder:
        """Builds the three parts (no I/O yet)."""
        outbox = Outbox(outbox_url, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
        crm = CrmStore(crm_url, timeout_s=crm_timeout_s)
        relay = OutboxRelay(outbox, crm, batch_size=batch_size, linger_s=linger_s, backoff_max_s=backoff_max_s,
                            retention_s=retention_s)
        return cls(outbox, crm, relay)

    async def start(self) -> None:
        """Migrates the outbox and the CRM database, and starts the relay. The CRM database may
        be down: then the relay migrates it before its first delivery, retrying until it can.

        Raises:
            sqlalchemy.exc.SQLAlchemyError, OSError: the outbox cannot be created or written.
        """
        await self.outbox.migrate()
        if not await self.outbox.probe():
            raise OSError("the outbox database is not writable")
        try:
            await self.crm.create_schema()
            self.relay.crm_migrated = True
        except Exception as exc:
            logger.warning("CRM database not reachable at start-up (%s); decisions wait in the outbox",
                           type(exc).__name__)
        self.relay.start()

    async def record(self, decision: StoredDecision) -> Recorded:
        """Commits ``decision`` locally (see :meth:`Outbox.record`); the relay delivers it later.

        Raises:
            OutboxUnavailable: it could not be recorded, so it must not be returned.
        """
        [outcome] = await self.record_many([decision])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def record_many(self, decisions: Sequence[StoredDecision]) -> list[Recorded | OutboxUnavailable]:
        """Commits many decisions locally together; each outcome is its :class:`Recorded`, or the
        :class:`OutboxUnavailable` that kept it from being recorded (so it must not be returned)."""
        if self._tracer is None:
            span = contextlib.nullcontext()
        else:
            from opentelemetry.trace import SpanKind

            span = self._tracer.start_as_current_span("outbox INSERT", kind=SpanKind.CLIENT,
                                                      attributes={"db.system": "sqlite", "db.operation.name": "INSERT"})
        with span:
            outcomes = await self.outbox.record_many(decisions)
        for outcome in outcomes:
            if isinstance(outcome, Recorded) and outcome.replayed:
                metrics.labelled(metrics.IDEMPOTENT_REPLAYS, outcome.decision.model_name).inc()
        return outcomes

    async def wait_delivered(self, timeout_s: float) -> bool:
        """Waits until every decision recorded so far is in the CRM database; False on timeout."""
        return await self.relay.wait_delivered(timeout_s)

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Stops the relay after delivering what it can within ``drain_timeout_s``; what is left
        stays in the outbox and is delivered after the next start."""
        await self.relay.stop(drain_timeout_s)
        backlog, _ = await self.outbox.backlog()
        if backlog:
            logger.warning("%d decision(s) not yet in the CRM stay in the outbox for the next start", backlog)
        await self.outbox.close()
        await self.crm.close()
