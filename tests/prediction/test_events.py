"""Decision events (mlpair.prediction.recording.events) against a real nats-server with JetStream:
CloudEvents round trips in both content modes, msg-id de-duplication of a re-published claim, a
broker restart the sink recovers from on its own, and ``tail`` / ``mlpair events tail`` reading the
stream back, each event id once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from mlpair.prediction.recording.codecs import to_json
from mlpair.prediction.recording.events import (
    EVENT_TYPE,
    EventSinkUnavailable,
    JetStreamSink,
    decision_events,
    parse_event,
    tail,
)
from tests.support import REPO_ROOT
from tests.support.events import start_nats
from tests.support.ledger import crm_decision
from tests.support.pair import free_port


def decisions(n: int, prefix: str) -> list[dict]:
    """``n`` decisions as the relay hands them over: the outbox payload's JSON, as a dict."""
    start = datetime(2025, 3, 1, 9, 30, tzinfo=UTC)
    return [
        json.loads(
            to_json(
                dataclasses.replace(
                    crm_decision(f"{prefix}-{i}", probability=0.01 * (i % 100), caller="tests"),
                    decided_at=start + timedelta(milliseconds=i),
                )
            )
        )
        for i in range(n)
    ]


@pytest.fixture
def nats_server(tmp_path):
    server = start_nats(tmp_path)
    yield server
    server.stop()


@pytest.fixture
async def sink(nats_server):
    sink = JetStreamSink(nats_server.url, timeout_s=1.0)
    await sink.open()
    yield sink
    await sink.close()


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_each_content_mode_round_trips_the_decision(mode):
    [d] = decisions(1, f"rt-{mode}")
    [event] = decision_events([d], mode=mode)
    assert event.event_id == d["decision_id"]
    assert event.headers["Nats-Msg-Id"] == d["decision_id"]
    assert event.headers["Content-Type"] == (
        "application/cloudevents+json" if mode == "structured" else "application/json"
    )
    assert any(k.startswith("ce-") for k in event.headers) == (mode == "binary")
    assert b", " not in event.body and b'": ' not in event.body  # compact JSON

    parsed = parse_event(*event[1:])
    assert parsed["id"] == d["decision_id"]
    assert parsed["type"] == EVENT_TYPE
    assert parsed["source"] == "/mlpair/prediction/credit-risk"
    assert parsed["subject"] == d["request_id"]
    assert datetime.fromisoformat(parsed["time"]) == datetime.fromisoformat(d["decided_at"])
    assert parsed["data"] == d


def test_an_unknown_content_mode_is_refused():
    with pytest.raises(ValueError, match="content mode"):
        decision_events(decisions(1, "mode"), mode="batched")


def test_a_message_that_is_no_cloudevent_is_a_value_error():
    with pytest.raises(ValueError):
        parse_event(None, b"not json")


async def test_a_claim_published_twice_is_stored_once(sink):
    events = decision_events(decisions(50, "twice"))
    assert await sink.publish(events) == 50
    assert await sink.publish(events) == 0
    assert await sink.stream_count() == 50


async def test_the_sink_recovers_from_a_broker_restart(nats_server, sink):
    first, second = decision_events(decisions(20, "before")), decision_events(decisions(20, "after"))
    assert await sink.publish(first) == 20

    nats_server.stop()
    started = time.monotonic()
    with pytest.raises(EventSinkUnavailable) as refused:
        await sink.publish(second)
    assert time.monotonic() - started < 10.0
    assert "after-" not in str(refused.value) and "before-" not in str(refused.value)  # names the error type only

    nats_server.start()
    deadline = time.monotonic() + 30.0
    while True:  # as the relay does: the whole claim again until it is acknowledged
        try:
            await sink.publish(second + first)
            break
        except EventSinkUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    assert await sink.stream_count() == 40


async def test_an_unreachable_broker_is_unavailable_within_the_timeout():
    sink = JetStreamSink(f"nats://127.0.0.1:{free_port()}", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(EventSinkUnavailable):
        await sink.open()
    assert time.monotonic() - started < 10.0


async def test_tail_reads_each_event_id_once(nats_server, sink):
    ds = decisions(40, "tail")
    # both content modes on the stream, and ten decisions re-published outside the de-duplication
    # window (a fresh msg-id): the stream holds 50 messages, the events are still 40
    events = decision_events(ds[:20], mode="structured") + decision_events(ds[20:], mode="binary")
    assert await sink.publish(events) == 40
    again = [e._replace(headers={**e.headers, "Nats-Msg-Id": f"{e.event_id}-late"}) for e in events[:10]]
    assert await sink.publish(again) == 10
    assert await sink.stream_count() == 50

    seen = [e async for e in tail(nats_server.url, from_start=True, count=None, timeout_s=1.0)]
    assert sorted(e["id"] for e in seen) == sorted(d["decision_id"] for d in ds)
    assert {e["id"]: e["data"] for e in seen} == {d["decision_id"]: d for d in ds}

    counted = [e async for e in tail(nats_server.url, from_start=True, count=40, timeout_s=10.0)]
    assert len({e["id"] for e in counted}) == 40

    assert [e async for e in tail(nats_server.url, from_start=True, count=5, timeout_s=10.0)] == seen[:5]
    assert [e async for e in tail(nats_server.url, from_start=False, count=None, timeout_s=0.5)] == []


def mlpair(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREDICTION_")}
    return subprocess.run(
        [sys.executable, "-m", "mlpair.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env
    )


async def test_the_cli_tails_the_stream_as_json_lines(nats_server, sink):
    ds = decisions(12, "cli")
    await sink.publish(decision_events(ds))
    done = await asyncio.to_thread(
        mlpair, "events", "tail", "--from-start", "--count", "5", "--json", "--url", nats_server.url
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5
    assert [json.loads(line)["data"] for line in lines] == ds[:5]
    first = json.loads(lines[0])  # each line a CloudEvent in its JSON form
    assert (first["specversion"], first["datacontenttype"], first["id"]) == ("1.0", "application/json",
                                                                            ds[0]["decision_id"])
    assert "disconnected" not in done.stderr  # a normal end is not reported as an outage

    readable = await asyncio.to_thread(
        mlpair, "events", "tail", "--from-start", "--count", "1", "--url", nats_server.url
    )
    assert readable.returncode == 0, readable.stderr
    header, line = readable.stdout.splitlines()
    assert header.split() == ["time", "request_id", "decision_id", "model", "decision", "probability", "caller"]
    assert line.split() == [
        "2025-03-01T09:30:00Z",
        ds[0]["request_id"],
        ds[0]["decision_id"],
        "credit-risk",
        "REVIEW",
        "0.0000",
        "tests",
    ]


def test_the_cli_names_an_unreachable_broker_in_one_line():
    done = mlpair("events", "tail", "--count", "1", "--url", f"nats://127.0.0.1:{free_port()}")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1
    assert "EventSinkUnavailable" in done.stderr


async def test_the_event_relay_keeps_retrying_through_an_outage_of_any_length(monkeypatch):
    """A broker down for thousands of claims in a row: each wait stays within the backoff's maximum
    (2^failures uncapped overflows a float after about 1,024 failures and would end the relay)."""
    from mlpair.prediction.recording.event_relay import EventRelay

    class DownSink:
        async def open(self):
            raise OSError("broker down")

        async def close(self):
            pass

    class Ledger:
        async def event_backlog(self):
            return 0, 0.0

    relay = EventRelay(Ledger(), DownSink(), backoff_base_s=0.05, backoff_max_s=5.0)
    waits: list[float] = []

    async def sleep(seconds):
        waits.append(seconds)
        if len(waits) == 3000:
            relay._stopping.set()

    monkeypatch.setattr(relay, "_sleep", sleep)
    await asyncio.wait_for(relay._run(), 30)
    assert len(waits) == 3000 and all(0.0 <= w <= 5.0 for w in waits)
