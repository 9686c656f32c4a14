"""The event relay: every recorded decision published once more, as a CloudEvent, to NATS JetStream.

A transactional outbox, like the CRM's: with ``events_url`` set, the statement that commits a group
of decisions also adds their sequence numbers to ``decision_event_outbox`` (``ledger_0005``), so an
event exists exactly for the decisions on record, never for a request left undecided. The relay
(in each serving process, or in ``mlpair relay``) claims outbox rows (``FOR UPDATE SKIP LOCKED``:
relays on several replicas take disjoint rows), reads their decisions with their audit records,
publishes one CloudEvent per decision (``recording/events.py``: ``id`` = the decision id) and
deletes the rows in the same transaction only after the broker acknowledged every event.

Delivery is at least once: a relay killed after the broker stored an event but before its commit
leaves the rows to the next claim, which publishes them again. JetStream drops a message whose
``Nats-Msg-Id`` it saw within the stream's duplicate window (``events_duplicate_window_s``), and
consumers deduplicate by the event id beyond it. While the broker is down the rows wait in the
ledger and the relay retries with full-jitter exponential backoff;
``prediction_event_backlog`` and ``prediction_event_lag_seconds`` show what waits, and the
``PredictionEventsLagging`` alert fires when the oldest has waited too long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import Counter

from mlpair.background import backoff_s
from mlpair.observability.metrics import gauge

if TYPE_CHECKING:
    from mlpair.prediction.recording.events import JetStreamSink
    from mlpair.prediction.recording.ledger_postgres import PostgresLedger

logger = logging.getLogger(__name__)

EVENTS_PUBLISHED = Counter("prediction_events_published_total", "Decision events the broker stored as new.")
EVENTS_DUPLICATE = Counter(
    "prediction_events_duplicate_total",
    "Decision events the broker had already stored (a claim published again after a failure or a relay's death).",
)
EVENT_FAILURES = Counter(
    "prediction_event_publish_failures_total", "Failed claims of the event relay (broker or ledger unreachable)."
)
EVENT_BACKLOG = gauge("prediction_event_backlog", "Recorded decisions whose event the broker has not acknowledged yet.")
EVENT_LAG = gauge(
    "prediction_event_lag_seconds",
    "Age of the oldest recorded decision whose event waits to be published (0 when none).",
)
BACKLOG_EVERY_S = 1.0  # how often the relay refreshes the two gauges


class EventRelay:
    """Publishes the ledger's event outbox to a broker in the background.

    Args:
        ledger: the PostgreSQL ledger, opened with ``events=True``.
        sink: where events go (opened by :meth:`start`).
        batch_size: most decisions per claim (rows of up to 64 decisions are claimed whole).
        mode: CloudEvents content mode, ``structured`` or ``binary``.
        poll_s: sleep between looks at an empty outbox.
        backoff_base_s, backoff_max_s: full-jitter exponential backoff after a failed claim.
    """

    def __init__(
        self,
        ledger: PostgresLedger,
        sink: JetStreamSink,
        *,
        batch_size: int = 512,
        mode: str = "structured",
        poll_s: float = 0.1,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.ledger = ledger
        self.sink = sink
        self.rows_per_claim = max(1, batch_size // 64)
        self.mode = mode
        self.poll_s = poll_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        """Starts the publishing loop on the running event loop (the sink connects in it)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="event-relay")

    async def stop(self) -> None:
        """Stops after the claim in progress (an unfinished one rolls back) and closes the sink."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), 5.0)
                except TimeoutError:
                    self._task.cancel()
                    await self._task
        with contextlib.suppress(Exception):
            await self.sink.close()

    async def publish_once(self) -> int:
        """Claims a batch, publishes its events and commits; returns how many decisions it held.

        Raises:
            EventSinkUnavailable: the broker did not acknowledge every event (the claim rolled back).
            asyncpg.PostgresError, OSError, TimeoutError: the ledger did not answer.
        """
        from mlpair.prediction.recording.events import decision_events

        async with self.ledger.claim_events(self.rows_per_claim) as decisions:
            if not decisions:
                return 0
            new = await self.sink.publish(decision_events(decisions, mode=self.mode))
        EVENTS_PUBLISHED.inc(new)
        EVENTS_DUPLICATE.inc(len(decisions) - new)
        return len(decisions)

    async def _run(self) -> None:
        failures, backlog_at, opened = 0, 0.0, False
        while not self._stopping.is_set():
            if time.monotonic() >= backlog_at:
                backlog_at = time.monotonic() + BACKLOG_EVERY_S
                with contextlib.suppress(Exception):
                    depth, age_s = await self.ledger.event_backlog()
                    EVENT_BACKLOG.set(depth)
                    EVENT_LAG.set(age_s)
            try:
                if not opened:
                    await self.sink.open()
                    opened = True
                n = await self.publish_once()
            except Exception as exc:  # noqa: BLE001  (broker or ledger down: the rows wait in the ledger)
                EVENT_FAILURES.inc()
                failures += 1
                if failures == 1:
                    logger.warning("decision events not published (%s); retrying", type(exc).__name__)
                await self._sleep(backoff_s(failures, self.backoff_base_s, self.backoff_max_s))
                continue
            if failures:
                logger.info("decision events flowing again after %d failed attempt(s)", failures)
            failures = 0
            if n == 0:  # the outbox is empty: look again shortly
                await self._sleep(self.poll_s)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
