"""Decision events: each recorded decision as a CloudEvent 1.0 on a NATS JetStream stream.

Why: systems that react to decisions (alerting, analytics, a case queue) subscribe to a stream
instead of polling the CRM. The relay's event loop (``EventRelay``) claims decisions from the
ledger's event outbox, turns each into a plain dict, and calls :func:`decision_events` and
:meth:`JetStreamSink.publish`; it deletes the claim only once every publish was acknowledged.

Delivery is at least once: a claim whose publish failed is published again whole. JetStream's
msg-id de-duplication window absorbs a repeat within ``duplicate_window_s`` (the ``Nats-Msg-Id``
header is the decision id), and a consumer deduplicates on the event ``id`` beyond it (as
:func:`tail` does).

The CloudEvents SDK (``cloudevents``) builds and parses the events; ``nats-py`` talks to the
broker and is imported only inside the functions that connect, so importing this module needs
neither a broker nor ``nats-py``. :func:`tail` reads the stream back (``mlpair events tail``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from cloudevents.core.bindings.http import HTTPMessage, from_http, to_binary, to_structured
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

log = logging.getLogger(__name__)

EVENT_TYPE = "io.mlpair.prediction.decision.v1"
DEFAULT_SUBJECT = "mlpair.decisions"
DEFAULT_STREAM = "MLPAIR_DECISIONS"
MODES = ("structured", "binary")
# between the client's reconnection attempts to one broker, in seconds
_RECONNECT_WAIT_S = 0.5


class EventSinkUnavailable(Exception):
    """The broker did not take the events (down, unreachable, no stream, no acknowledgement in time).

    The message names only the error's type; the caller retries the whole claim later.
    """


class OutgoingEvent(NamedTuple):
    """One event ready to publish: ``event_id`` (the decision id), NATS ``headers``, the ``body``."""

    event_id: str
    headers: dict[str, str]
    body: bytes


def _rfc3339(value: datetime) -> str:
    """A timezone-aware time in RFC 3339, UTC written as ``Z`` (as the SDK writes ``time``)."""
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _dumps(value: Any) -> bytes:
    def encode(obj: Any) -> str:
        if isinstance(obj, datetime):
            return _rfc3339(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")

    return json.dumps(value, separators=(",", ":"), default=encode).encode()


class _CompactJSON(JSONFormat):
    """The SDK's JSON event format, written without spaces after separators."""

    def write(self, event: Any) -> bytes:
        """The structured envelope: the attributes and ``data`` (a JSON value), compact."""
        data = event.get_data()
        if not isinstance(data, dict):  # bytes or text: the SDK's own encoding (data_base64 …)
            return super().write(event)
        return _dumps({**event.get_attributes(), "data": data})

    def write_data(self, data: Any, datacontenttype: str | None) -> bytes:
        """The binary-mode body: the data alone, compact."""
        return _dumps(data) if isinstance(data, dict) else super().write_data(data, datacontenttype)


_FORMAT = _CompactJSON()


def decision_events(
    decisions: Sequence[Mapping[str, Any]], *, mode: str = "structured", source: str = "/mlpair/prediction"
) -> list[OutgoingEvent]:
    """One CloudEvent 1.0 per decision, in order, encoded for NATS in CloudEvents' HTTP content modes.

    Args:
        decisions: JSON-safe dicts with at least ``decision_id``, ``request_id``, ``model_name``
            and ``decided_at`` (ISO 8601 with a UTC offset); each whole dict becomes the event's data.
        mode: ``structured`` (body: the JSON envelope, ``Content-Type: application/cloudevents+json``)
            or ``binary`` (``ce-*`` headers, ``Content-Type: application/json``, body: the data).
        source: the event ``source`` prefix; each event's source is ``{source}/{model_name}``.

    Returns:
        ``OutgoingEvent(event_id, headers, body)`` per decision: ``id`` is the decision id, ``type``
        :data:`EVENT_TYPE`, ``subject`` the request id, ``time`` ``decided_at``. The headers carry
        ``Nats-Msg-Id: <decision id>``, JetStream's de-duplication key. JSON is compact.

    Raises:
        ValueError: an unknown ``mode``; a decision the CloudEvents SDK refuses (an empty id) or
            whose ``decided_at`` is not a timezone-aware ISO 8601 time.
        KeyError: a decision lacks one of the fields above.
    """
    if mode not in MODES:
        raise ValueError(f"unknown CloudEvents content mode {mode!r} (one of: {', '.join(MODES)})")
    encode = to_structured if mode == "structured" else to_binary
    events = []
    for decision in decisions:
        decided_at = datetime.fromisoformat(decision["decided_at"])
        if decided_at.tzinfo is None:
            raise ValueError("decided_at has no UTC offset")
        attributes = {
            "id": decision["decision_id"],
            "type": EVENT_TYPE,
            "source": f"{source}/{decision['model_name']}",
            "subject": decision["request_id"],
            "time": decided_at,
            "datacontenttype": "application/json",
        }
        try:
            message = encode(CloudEvent(attributes, dict(decision)), _FORMAT)
        except BaseCloudEventException as exc:
            raise ValueError(f"not a valid CloudEvent: {exc}") from exc
        # the SDK names the header in lower case; NATS headers keep the case they are given
        headers = {("Content-Type" if k.lower() == "content-type" else k): v for k, v in message.headers.items()}
        headers["Nats-Msg-Id"] = attributes["id"]
        events.append(OutgoingEvent(attributes["id"], headers, message.body))
    return events


def parse_event(headers: Mapping[str, str] | None, body: bytes) -> dict[str, Any]:
    """The inverse of :func:`decision_events`, for either content mode (``ce-*`` headers: binary).

    Returns:
        the event in CloudEvents' JSON form: ``{"specversion", "id", "type", "source", "subject", "time",
        "datacontenttype", "data"}``: ``time`` in RFC 3339 (UTC as
        ``Z``: the same instant as the decision's ``decided_at``, not always the same text),
        ``data`` the decision dict; ``subject`` and ``time`` are None when the event has none.

    Raises:
        ValueError: the message is not a CloudEvent (not JSON, or a required attribute missing).
    """
    try:
        event = from_http(HTTPMessage(dict(headers or {}), body), _FORMAT)
    except (BaseCloudEventException, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not a CloudEvent: {type(exc).__name__}") from exc
    time = event.get_time()
    return {
        "specversion": event.get_specversion(),
        "id": event.get_id(),
        "type": event.get_type(),
        "source": event.get_source(),
        "subject": event.get_subject(),
        "time": _rfc3339(time) if time is not None else None,
        "datacontenttype": event.get_datacontenttype(),
        "data": event.get_data(),
    }


async def _connect(url: str, timeout_s: float) -> Any:
    """A NATS connection that gives up after about ``timeout_s`` (first connect and each outage).

    Raises:
        EventSinkUnavailable: the broker did not answer.
    """
    import nats

    async def on_error(exc: Exception) -> None:  # each failed attempt: the caller reports the outcome
        log.debug("decision events: NATS connection error %s", type(exc).__name__)

    async def on_disconnected() -> None:  # also on a normal close: a failed publish is what warns
        log.info("decision events: disconnected from NATS")

    async def on_reconnected() -> None:
        log.info("decision events: reconnected to NATS")

    try:
        return await nats.connect(
            servers=[url],
            connect_timeout=max(1, math.ceil(timeout_s)),
            allow_reconnect=True,
            # nats-py treats 0 as "for ever": at least one attempt, about timeout_s of them in all
            max_reconnect_attempts=max(1, math.ceil(timeout_s / _RECONNECT_WAIT_S)),
            reconnect_time_wait=_RECONNECT_WAIT_S,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
        )
    except Exception as exc:  # noqa: BLE001  (whatever nats-py raises on connect: the broker is unreachable)
        raise EventSinkUnavailable(f"NATS at the events URL is unreachable ({type(exc).__name__})") from exc


class JetStreamSink:
    """Publishes :class:`OutgoingEvent` batches to one JetStream stream and waits for their acks.

    Args:
        url: the NATS server, ``nats://host:port``.
        subject: the subject events are published on (the stream captures it).
        stream: the stream's name; :meth:`open` creates it when missing (file storage, capturing
            ``subject``, ``duplicate_window_s``). An existing stream is left as it is (its subjects,
            limits and de-duplication window are the operator's).
        duplicate_window_s: JetStream's msg-id de-duplication window for a new stream, seconds.
        timeout_s: the wait for connecting and for each publish acknowledgement, seconds; a lost
            connection is retried for about as long before it closes.
    """

    def __init__(
        self,
        url: str,
        *,
        subject: str = DEFAULT_SUBJECT,
        stream: str = DEFAULT_STREAM,
        duplicate_window_s: float = 600.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self.subject = subject
        self.stream = stream
        self.duplicate_window_s = duplicate_window_s
        self.timeout_s = timeout_s
        self._nc: Any = None
        self._js: Any = None

    async def open(self) -> None:
        """Connects and makes sure the stream exists.

        Raises:
            EventSinkUnavailable: the broker is unreachable or refused the stream.
        """
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        await self.close()
        nc = await _connect(self.url, self.timeout_s)
        js = nc.jetstream(timeout=self.timeout_s)
        try:
            try:
                await js.stream_info(self.stream)
            except NotFoundError:
                # two relays adding the same configuration at once both succeed (the server's add is idempotent)
                config = StreamConfig(
                    name=self.stream,
                    subjects=[self.subject],
                    duplicate_window=self.duplicate_window_s,
                    storage=StorageType.FILE,
                )
                await js.add_stream(config)
        except Exception as exc:  # noqa: BLE001  (any failure here leaves no usable sink)
            await nc.close()
            raise EventSinkUnavailable(f"JetStream stream not available ({type(exc).__name__})") from exc
        self._nc, self._js = nc, js

    async def publish(self, events: Sequence[OutgoingEvent]) -> int:
        """Publishes every event at once and waits for all acknowledgements.

        A closed connection (the broker was gone longer than the client retried) is opened again,
        once, first.

        Returns:
            How many events the stream stored as new (the rest were duplicates within the window).

        Raises:
            EventSinkUnavailable: a publish failed or was not acknowledged within ``timeout_s``
                (some of the batch may have been stored: publish it again whole).
        """
        if not events:
            return 0
        if self._nc is None or self._nc.is_closed:
            await self.open()
        results = await asyncio.gather(
            *(self._js.publish(self.subject, e.body, timeout=self.timeout_s, headers=e.headers) for e in events),
            return_exceptions=True,  # a cancelled ack future (connection closed) comes back here too
        )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise EventSinkUnavailable(f"JetStream did not acknowledge the events ({type(failed).__name__})")
        return sum(1 for ack in results if not getattr(ack, "duplicate", False))

    async def stream_count(self) -> int:
        """How many messages the stream holds now.

        Raises:
            EventSinkUnavailable: the broker or the stream is not available.
        """
        if self._nc is None or self._nc.is_closed:
            await self.open()
        try:
            info = await self._js.stream_info(self.stream)
        except Exception as exc:  # noqa: BLE001
            raise EventSinkUnavailable(f"JetStream stream not available ({type(exc).__name__})") from exc
        return int(info.state.messages)

    async def close(self) -> None:
        """Closes the connection (pending publishes flushed first); a no-op when not open."""
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            await nc.close()


async def tail(
    url: str,
    *,
    subject: str = DEFAULT_SUBJECT,
    stream: str = DEFAULT_STREAM,
    from_start: bool = False,
    count: int | None = None,
    timeout_s: float | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The stream's decision events, as :func:`parse_event` dicts, each event id once.

    Reads through an ephemeral ordered consumer (nothing is left on the broker afterwards).

    Args:
        from_start: from the stream's first message; otherwise only events published from now on.
        count: stop after this many distinct events; None: no limit.
        timeout_s: stop after this many seconds without a new message (idle); None: wait for ever
            (with ``count`` None as well, the caller stops it by cancelling).

    A message that is not a CloudEvent is logged (by sequence number) and skipped; a repeated
    id (a re-published claim outside JetStream's de-duplication window) is skipped silently.

    Raises:
        EventSinkUnavailable: the broker is unreachable, or has no such stream.
    """
    import nats.errors
    from nats.js.api import DeliverPolicy

    nc = await _connect(url, timeout_s or 5.0)
    try:
        js = nc.jetstream()
        try:
            sub = await js.subscribe(
                subject,
                stream=stream,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW,
            )
        except Exception as exc:  # noqa: BLE001
            raise EventSinkUnavailable(
                f"cannot read stream {stream!r} ({type(exc).__name__}); PredictionService creates it when it "
                "starts with PREDICTION_EVENTS_URL set"
            ) from exc
        seen: set[str] = set()
        while count is None or len(seen) < count:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except nats.errors.TimeoutError:
                return
            try:
                event = parse_event(msg.headers, msg.data)
            except ValueError:
                log.warning("decision events: stream message %s is not a CloudEvent", msg.metadata.sequence.stream)
                continue
            if event["id"] in seen:
                continue
            seen.add(event["id"])
            yield event
    finally:
        await nc.close()
