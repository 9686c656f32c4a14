"""The decision ledger and its relay, on both engines: one decision per request id, durable before
the answer, exactly once in the CRM (C39, C40), whatever number of ledger clients and relays share it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import uuid
from datetime import UTC
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import make_url

from mlpair.prediction.errors import LedgerUnavailable
from mlpair.prediction.recording import codecs
from mlpair.prediction.recording.admin import migrate
from mlpair.prediction.recording.ledger import open_ledger
from mlpair.prediction.recording.migrate import SchemaNotReady
from mlpair.prediction.recording.recorder import DecisionRecorder
from mlpair.prediction.recording.relay import LedgerRelay
from mlpair.prediction.recording.store import CrmStore
from mlpair.prediction.records import StoredDecision, decision_id_for, decision_ids_for
from tests.fault_support import TcpProxy, eventually
from tests.support.ledger import SLOW_MACHINE_S, crm_rows, decision, opened_ledger

ENGINES = ["sqlite", "postgresql"]


@dataclasses.dataclass
class Databases:
    ledger_url: str
    crm_url: str
    proxy: TcpProxy | None = None  # PostgreSQL only: both URLs through it, when asked for

    def proxied(self) -> tuple[str, str]:
        """Both URLs through the proxy (the test cuts and restores it)."""
        def through(url: str) -> str:
            return make_url(url).set(host="127.0.0.1", port=self.proxy.port).render_as_string(hide_password=False)
        return through(self.ledger_url), through(self.crm_url)


@pytest.fixture(params=ENGINES)
def fresh_database(request, tmp_path):
    """Two SQLite files, or one fresh PostgreSQL database for both (a sync fixture: creating the
    database runs its own short event loop)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}", f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}"
        return
    url = request.getfixturevalue("fresh_postgres")
    yield url, url


@pytest.fixture
async def databases(fresh_database):
    """A migrated ledger and CRM: two SQLite files, or one PostgreSQL database holding both (the
    ledger in its ``prediction`` schema), with a TCP proxy in front of it."""
    ledger_url, crm_url = fresh_database
    await migrate(ledger_url, crm_url)
    if ledger_url.startswith("sqlite"):
        yield Databases(ledger_url, crm_url)
        return
    target = make_url(ledger_url)
    proxy = TcpProxy(target.host, target.port)
    await proxy.start()
    try:
        yield Databases(ledger_url, crm_url, proxy)
    finally:
        await proxy.close()


@pytest.fixture
async def ledger(databases):
    async with opened_ledger(databases.ledger_url, synchronous="NORMAL") as ledger:
        yield ledger


async def record(ledger, d: StoredDecision, fingerprint: str = "fp"):
    [outcome] = await ledger.record_many([d], [fingerprint])
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


async def test_c39_a_retried_request_id_gets_the_decision_recorded_first(ledger):
    first = await record(ledger, decision("r1", probability=0.2), "fp-1")
    retry = await record(ledger, decision("r1", probability=0.9, decision="DECLINE"), "fp-2")
    assert not first.replayed and retry.replayed
    assert retry.decision == first.decision and retry.decision.decision_id == decision_id_for("r1")
    assert retry.fingerprint == "fp-1"  # the recorded request's, for the payload check
    assert (await ledger.find("r1")).decision == first.decision
    assert (await ledger.backlog())[0] == 1


async def test_the_backlog_age_is_the_oldest_undelivered_decision_s_and_its_count_every_one(ledger):
    """What the backlog gauges show: every undelivered decision counted, and the age of the oldest
    (the one the relays claim next), not of the newest."""
    assert await ledger.backlog() == (0, 0.0)
    await record(ledger, decision("age-1"))
    await asyncio.sleep(0.5)
    for i in range(2, 6):
        await record(ledger, decision(f"age-{i}"))
    count, age_s = await ledger.backlog()
    assert count == 5 and 0.5 <= age_s < 0.5 + SLOW_MACHINE_S


async def test_c40_two_ledger_clients_on_one_database_make_one_decision_per_request_id(databases):
    """Two replicas' ledgers, concurrent first calls with the same 50 ids: each id has one winner,
    and both replicas answer with it."""
    ids = [f"both-{i}" for i in range(50)]
    a, b = (open_ledger(databases.ledger_url, synchronous="NORMAL", timeout_s=SLOW_MACHINE_S) for _ in range(2))
    await a.open()
    await b.open()
    try:
        from_a, from_b = await asyncio.gather(
            a.record_many([decision(i, 0.1, "APPROVE") for i in ids], ["fp"] * 50),
            b.record_many([decision(i, 0.9, "DECLINE") for i in reversed(ids)], ["fp"] * 50))
    finally:
        await a.close()
        await b.close()
    answers_a = {r.decision.request_id: r for r in from_a}
    answers_b = {r.decision.request_id: r for r in from_b}
    for rid in ids:
        assert answers_a[rid].decision == answers_b[rid].decision
        assert answers_a[rid].replayed != answers_b[rid].replayed  # exactly one of them made it
    assert sum(not r.replayed for r in [*from_a, *from_b]) == 50


async def test_concurrent_decisions_share_commits(ledger):
    commits_before = REGISTRY.get_sample_value("prediction_ledger_commit_rows_count") or 0
    recorded = await asyncio.gather(*(record(ledger, decision(f"g{i}")) for i in range(200)))
    commits = REGISTRY.get_sample_value("prediction_ledger_commit_rows_count") - commits_before
    assert len({r.decision.decision_id for r in recorded}) == 200 and not any(r.replayed for r in recorded)
    assert commits <= 2  # group commit: not one transaction per decision
    assert (await ledger.backlog())[0] == 200


async def test_c39_duplicates_in_one_commit_are_recorded_once(ledger):
    recorded = await asyncio.gather(*(record(ledger, decision("dup", probability=p)) for p in (0.1, 0.5, 0.9)))
    assert [r.replayed for r in recorded] == [False, True, True]
    assert {r.decision.probability for r in recorded} == {0.1}
    assert (await ledger.backlog())[0] == 1


async def test_a_call_larger_than_one_commit_gets_every_outcome_in_order(ledger):
    first = [decision(f"split-a-{i}") for i in range(3)]
    large = [decision(f"split-b-{i}") for i in range(ledger.max_commit_rows + 7)]
    recorded_first, recorded_large = await asyncio.gather(ledger.record_many(first, ["fp"] * 3),
                                                          ledger.record_many(large, ["fp"] * len(large)))
    assert [r.decision.request_id for r in recorded_first] == [d.request_id for d in first]
    assert [r.decision.request_id for r in recorded_large] == [d.request_id for d in large]
    assert not any(r.replayed for r in [*recorded_first, *recorded_large])


async def test_recording_nothing_returns_at_once(ledger):
    assert await ledger.record_many([], []) == []


async def test_a_ledger_that_cannot_be_reached_refuses_the_decision_then_recovers(databases, tmp_path):
    """Fail closed: a decision the ledger did not commit is never returned (UNAVAILABLE), and the
    ledger takes decisions again once it is back."""
    if databases.proxy is None:  # SQLite: another process holds the file's write lock
        ledger = open_ledger(databases.ledger_url, synchronous="NORMAL", timeout_s=0.2)
        await ledger.open()
        holder = sqlite3.connect(make_url(databases.ledger_url).database, isolation_level=None)
        cut, restore = (lambda: holder.execute("BEGIN IMMEDIATE")), (lambda: holder.execute("ROLLBACK"))
    else:
        ledger = open_ledger(databases.proxied()[0], timeout_s=0.5)
        await ledger.open()
        cut, restore = databases.proxy.cut, databases.proxy.restore
    try:
        await record(ledger, decision("before"))
        await _maybe_await(cut())
        assert not await ledger.probe()
        with pytest.raises(LedgerUnavailable):
            await record(ledger, decision("during"))
        await _maybe_await(restore())
        assert await ledger.probe()
        assert await ledger.find("during") is None and await ledger.find("before") is not None
        assert not (await record(ledger, decision("after"))).replayed
    finally:
        await ledger.close()


async def _maybe_await(value):
    if asyncio.iscoroutine(value):
        await value


async def test_a_ledger_without_its_schema_refuses_to_open(tmp_path):
    missing = open_ledger(f"sqlite+aiosqlite:///{tmp_path / 'never-migrated.sqlite'}")
    with pytest.raises(SchemaNotReady, match="mlpair migrate"):
        await missing.open()
    assert not (tmp_path / "never-migrated.sqlite").exists()  # opening never creates it


@pytest.mark.parametrize("fresh_database", ["postgresql"], indirect=True)
async def test_a_postgresql_ledger_without_its_schema_refuses_to_open(fresh_database):
    ledger = open_ledger(fresh_database[0])
    with pytest.raises(SchemaNotReady, match="mlpair migrate"):
        await ledger.open()
    await ledger.close()


@pytest.mark.parametrize("fresh_database", ["postgresql"], indirect=True)  # a server behind a TCP proxy
async def test_c39_decisions_wait_durably_through_a_crm_outage_and_a_restart_then_arrive_once(databases):
    ids = [f"outage-{uuid.uuid4()}" for _ in range(30)]
    _, crm_url = databases.proxied()
    recorder = DecisionRecorder.open(databases.ledger_url, crm_url, crm_timeout_s=1, backoff_max_s=0.2)
    await recorder.start()
    await databases.proxy.cut()
    recorded = await recorder.ledger.record_many([decision(i) for i in ids], ["fp"] * 30)  # answered while the CRM is down
    assert not any(isinstance(r, BaseException) for r in recorded)
    assert not await recorder.wait_delivered(1.0)
    await recorder.close()  # the process stops with the CRM still down
    await databases.proxy.restore()
    other = DecisionRecorder.open(databases.ledger_url, crm_url, crm_timeout_s=1, backoff_max_s=0.2)  # another replica
    await other.start()
    try:
        assert await other.wait_delivered(20)
        assert await crm_rows(other.crm, ids) == (30, 30)
        assert (await other.crm.find(ids[0])).decision_id == recorded[0].decision.decision_id
    finally:
        await other.close()


def _after_barrier(write, barrier: asyncio.Barrier):
    """A relay's ``_write`` whose first call waits at ``barrier`` (at most 10 s)."""
    first = True

    async def gated(n, models, insert, **options):
        nonlocal first
        if first:
            first = False
            async with asyncio.timeout(10):
                await barrier.wait()
        return await write(n, models, insert, **options)

    return gated


@pytest.mark.parametrize(("fresh_database", "claims"), [("sqlite", 1), ("postgresql", 1), ("postgresql", 3)],
                         indirect=["fresh_database"])  # a SQLite ledger (one writer) claims one batch at a time
async def test_three_relays_deliver_each_decision_exactly_once(databases, claims):
    """Three replicas' relays working through one backlog at once, each claiming one batch at a
    time or (PostgreSQL, a pool of 6) up to three: every decision is inserted into the CRM by
    exactly one claim (none skipped as already there: no double delivery)."""
    ids = [f"relays-{uuid.uuid4()}" for _ in range(900)]
    writer = open_ledger(databases.ledger_url, synchronous="NORMAL", timeout_s=SLOW_MACHINE_S)
    await writer.open()
    await writer.record_many([decision(i) for i in ids], ["fp"] * len(ids))
    skipped_before = REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") or 0
    parts = []
    for _ in range(3):
        ledger = open_ledger(databases.ledger_url, synchronous="NORMAL", timeout_s=SLOW_MACHINE_S, pool_size=6)
        await ledger.open()
        crm = CrmStore(databases.crm_url, timeout_s=5)
        relay = LedgerRelay(ledger, crm, batch_size=25, poll_s=0.05, linger_s=0, concurrency=claims)
        assert relay.concurrency == claims
        parts.append((ledger, crm, relay))
    # each relay's first CRM write waits until all three hold a claim: all three take part, and
    # their claims are held at the same time, whatever order the event loop starts them in
    barrier = asyncio.Barrier(len(parts))
    for _, _, relay in parts:
        relay._write = _after_barrier(relay._write, barrier)
    try:
        for _, _, relay in parts:
            relay.start()
        assert await parts[0][2].wait_delivered(30)
        assert sum(relay.delivered for _, _, relay in parts) == 900
        assert all(relay.delivered > 0 for _, _, relay in parts)  # all three took part
        assert REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") - skipped_before == 0
        assert await crm_rows(parts[0][1], ids) == (900, 900)
    finally:
        for ledger, crm, relay in parts:
            await relay.stop()
            await ledger.close()
            await crm.close()
        await writer.close()


@pytest.mark.parametrize("fresh_database", ["postgresql"], indirect=True)  # SKIP LOCKED claims
async def test_a_relay_claiming_three_batches_at_once_delivers_each_decision_exactly_once(databases):
    """Through a backlog a relay claims up to three batches at once (a pool of 6: 3 kept for
    commits); every decision is inserted by exactly one claim, none skipped as already there."""
    ids = [f"parallel-{uuid.uuid4()}" for _ in range(900)]
    ledger = open_ledger(databases.ledger_url, synchronous="NORMAL", timeout_s=SLOW_MACHINE_S, pool_size=6)
    await ledger.open()
    await ledger.record_many([decision(i) for i in ids], ["fp"] * len(ids))
    crm = CrmStore(databases.crm_url, timeout_s=5)
    relay = LedgerRelay(ledger, crm, batch_size=25, poll_s=0.05, linger_s=0, concurrency=5)
    assert relay.concurrency == 3  # capped by what the commits leave of the pool
    assert open_ledger(databases.ledger_url).relay_claims == 1  # the default pool of 4: one claim at a time
    in_flight, most = 0, 0
    deliver = relay._deliver_batch

    async def counted() -> int:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await deliver()
        finally:
            in_flight -= 1

    relay._deliver_batch = counted
    skipped_before = REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") or 0
    try:
        relay.start()
        assert await relay.wait_delivered(30)
        assert most == 3 and relay.delivered == 900
        assert REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") - skipped_before == 0
        assert await crm_rows(crm, ids) == (900, 900)
    finally:
        await relay.stop()
        await ledger.close()
        await crm.close()


@pytest.mark.parametrize("relay_concurrency", [1, 3])
@pytest.mark.parametrize("fresh_database", ["postgresql"], indirect=True)  # a server behind a TCP proxy
async def test_c39_connections_cut_in_the_middle_of_deliveries_lose_and_double_nothing(databases, relay_concurrency):
    ids = [f"cut-{uuid.uuid4()}" for _ in range(600)]
    _, crm_url = databases.proxied()
    recorder = DecisionRecorder.open(databases.ledger_url, crm_url, crm_timeout_s=1, batch_size=20, backoff_max_s=0.1,
                                     pool_size=6, relay_concurrency=relay_concurrency)
    assert recorder.relay.concurrency == relay_concurrency
    await recorder.start()
    failures_before = REGISTRY.get_sample_value("prediction_relay_failures_total") or 0
    try:
        await databases.proxy.cut()  # the relay starts against a CRM that is down...
        await recorder.ledger.record_many([decision(i) for i in ids[:300]], ["fp"] * 300)
        await asyncio.sleep(0.1)
        await databases.proxy.restore()
        await recorder.ledger.record_many([decision(i) for i in ids[300:]], ["fp"] * 300)
        for _ in range(5):  # ...then loses its connection again and again while working through the backlog
            await asyncio.sleep(0.05)
            await databases.proxy.cut()
            await asyncio.sleep(0.1)
            await databases.proxy.restore()
        assert await recorder.wait_delivered(30)
        assert await crm_rows(recorder.crm, ids) == (600, 600)
        assert REGISTRY.get_sample_value("prediction_relay_failures_total") > failures_before
    finally:
        await recorder.close()


@pytest.mark.parametrize("fresh_database", ["postgresql"], indirect=True)  # a server behind a TCP proxy
async def test_c39_a_commit_whose_acknowledgement_is_lost_is_retried_without_doubling(databases):
    ids = [f"lost-ack-{uuid.uuid4()}" for _ in range(10)]
    _, crm_url = databases.proxied()
    recorder = DecisionRecorder.open(databases.ledger_url, crm_url, crm_timeout_s=1, backoff_max_s=0.1)
    await recorder.start()
    skipped_before = REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") or 0
    # the delivery's insert (one self-committing statement, its parameters holding the request
    # ids) reaches the CRM and commits; the relay never hears of it
    databases.proxy.lose_reply_after(b"lost-ack-")
    try:
        await recorder.ledger.record_many([decision(i) for i in ids], ["fp"] * 10)
        assert await recorder.wait_delivered(20)
        assert databases.proxy.replies_lost == 1
        assert await crm_rows(recorder.crm, ids) == (10, 10)
        # the retried transaction found every row already there and inserted none of them again
        assert REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") - skipped_before == 10
    finally:
        await recorder.close()


def test_relay_backoff_is_bounded_however_long_the_outage():
    relay = LedgerRelay(SimpleNamespace(relay_claims=1), None, backoff_base_s=0.05, backoff_max_s=5.0)
    waits = [relay.backoff_s(failures) for failures in (1, 10, 2000, 10**6)]
    assert all(0.0 <= w <= 5.0 for w in waits)


@pytest.mark.parametrize("failing", ["ledger", "CRM"])
async def test_a_failed_delivery_names_the_database_that_failed(failing, caplog):
    # An operator paged for a relay failing must know which database to look at: the ledger
    # (the claim or its mark failed) or the CRM (the insert failed).
    row = tuple("credit-risk" if column == "model_name" else "x" for column in codecs.CRM_COLUMNS)

    class Ledger:
        committed = asyncio.Event()
        relay_claims = 1

        @contextlib.asynccontextmanager
        async def claim(self, limit):
            if failing == "ledger":
                raise ConnectionRefusedError
            yield [row]

    class Crm:
        async def deliver_rows(self, rows):
            raise ConnectionRefusedError

    relay = LedgerRelay(Ledger(), Crm(), poll_s=0.01, linger_s=0, backoff_base_s=0.01, backoff_max_s=0.01)
    with caplog.at_level(logging.WARNING, logger="mlpair.prediction.recording.relay"):
        relay.start()

        async def logged() -> bool:
            return "CRM delivery failed" in caplog.text

        await eventually(logged, timeout_s=5)
        await relay.stop()
    assert f"ConnectionRefusedError from the {failing}; decisions wait in the ledger" in caplog.text


def test_decision_ids_are_rfc_4122_uuid5_of_the_request_id():
    from mlpair.prediction.records import _DECISION_NAMESPACE

    # 2,000 generated ids besides: every hex digit turns up where the variant bits are set
    request_ids = ["r1", "", "é" * 64, "x" * 128, "日本語-id", *(f"r{i}" for i in range(2000))]
    expected = [str(uuid.uuid5(_DECISION_NAMESPACE, request_id)) for request_id in request_ids]
    assert [decision_id_for(request_id) for request_id in request_ids] == expected
    # a batch's ids, written at once from 32 ids on: the same, at every batch size around that
    for n in (0, 1, 8, 31, 32, 33, 64, len(request_ids)):
        assert decision_ids_for(request_ids[:n]) == expected[:n]


def test_decision_id_values_are_the_ones_ledgers_hold():
    """Pinned (every replica and every release names a request's decision alike), one at a time
    and from a batch written at once."""
    pinned = {0: "0eb5dbdc-f783-5b0e-848c-b2bf45e3499f", 39: "30c71bf1-0d9b-5271-9f99-30bd28978ce0"}
    many = decision_ids_for([f"req-{i}" for i in range(40)])
    assert {i: many[i] for i in pinned} == pinned
    assert {i: decision_id_for(f"req-{i}") for i in pinned} == pinned


def test_a_stored_decision_serialises_every_field():
    from datetime import datetime

    d = dataclasses.replace(decision("every-field"), decision_id="d", decided_at=datetime(2026, 1, 2, tzinfo=UTC),
                            served_from="stale_cache", cache_age_ms=7, degraded_reason="CIRCUIT_OPEN")
    assert codecs.from_json(codecs.to_json(d)) == d


async def test_every_field_survives_the_ledger(ledger):
    from datetime import datetime

    d = dataclasses.replace(decision("round-trip", probability=None, decision="REVIEW"), decision_id="d-1",
                            decided_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
                            served_from="fallback", cache_age_ms=7, degraded_reason="CIRCUIT_OPEN",
                            reason_codes=("INFERENCE_UNAVAILABLE", "INCOME_MISSING_DEFAULTED"))
    await record(ledger, d, "fingerprint-1")
    found = await ledger.find("round-trip")
    assert found.decision == d and found.fingerprint == "fingerprint-1" and found.replayed


async def test_callers_arriving_as_a_commit_ends_are_never_left_waiting(ledger):
    """Eight callers, each recording its next decision as soon as the last one returns: some
    arrive just as a writer finishes its last commit; each must be picked up (regression: such a
    caller once waited forever while the finished writer still counted as running)."""
    async def caller(k: int) -> None:
        for i in range(60):
            await record(ledger, decision(f"arrive-{k}-{i}"))

    await asyncio.wait_for(asyncio.gather(*(caller(k) for k in range(8))), timeout=60)
    assert (await ledger.backlog())[0] == 480


async def test_a_decision_the_crm_refuses_waits_in_the_ledger_while_the_others_are_delivered(
        databases, ledger, monkeypatch):
    """One decision the CRM refuses for its data (a constraint the CRM added, here) holds back no
    other: it is requeued behind the queue, counted and named by its request id, and delivered once
    the CRM takes it; every decision ends in the CRM exactly once."""
    from sqlalchemy import text

    from mlpair.prediction.recording import ledger_sqlite

    monkeypatch.setattr(ledger_sqlite, "REQUEUE_AFTER_S", 0.2)  # SQLite holds a refused decision back 30 s
    sqlite = databases.crm_url.startswith("sqlite")
    refuse, allow = (
        ("CREATE TRIGGER refuse_poison BEFORE INSERT ON decisions WHEN NEW.entity_id = 'poison' "
         "BEGIN SELECT RAISE(ABORT, 'refused'); END", "DROP TRIGGER refuse_poison")
        if sqlite else
        ("ALTER TABLE decisions ADD CONSTRAINT refuse_poison CHECK (entity_id <> 'poison')",
         "ALTER TABLE decisions DROP CONSTRAINT refuse_poison")
    )
    crm = CrmStore(databases.crm_url, timeout_s=5)
    async with crm.engine.begin() as conn:
        await conn.execute(text(refuse))
    ids = [f"refused-{uuid.uuid4()}" for _ in range(40)]
    poison = ids[17]
    for request_id in ids:
        d = decision(request_id)
        await record(ledger, dataclasses.replace(d, entity_id="poison") if request_id == poison else d)
    refused_before = REGISTRY.get_sample_value("prediction_crm_refused_total") or 0
    relay = LedgerRelay(ledger, crm, poll_s=0.05, linger_s=0, backoff_base_s=0.01, backoff_max_s=0.2)
    relay.start()
    try:
        others = [i for i in ids if i != poison]

        async def others_delivered() -> bool:
            return await crm_rows(crm, others) == (39, 39)

        await eventually(others_delivered, timeout_s=SLOW_MACHINE_S)
        assert await crm_rows(crm, [poison]) == (0, 0)
        assert (await ledger.backlog())[0] == 1  # it waits in the ledger, not lost
        assert (REGISTRY.get_sample_value("prediction_crm_refused_total") or 0) > refused_before
        async with crm.engine.begin() as conn:
            await conn.execute(text(allow))
        assert await relay.wait_delivered(SLOW_MACHINE_S)
    finally:
        await relay.stop(drain_timeout_s=1)
    assert await crm_rows(crm, ids) == (40, 40)
    assert (await ledger.backlog())[0] == 0
    await crm.close()
