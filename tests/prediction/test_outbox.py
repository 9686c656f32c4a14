"""The local outbox and its relay: durable before the answer, exactly once in the CRM (C39)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import make_url

from mlpair.prediction.crm.outbox import Outbox
from mlpair.prediction.crm.recorder import DecisionRecorder
from mlpair.prediction.crm.store import StoredDecision, decision_id_for
from mlpair.prediction.errors import OutboxUnavailable
from tests.fault_support import TcpProxy


def decision(request_id: str, probability: float = 0.2, decision: str = "APPROVE") -> StoredDecision:
    return StoredDecision("", request_id, "e", "credit-risk", "1", "credit-risk/v1", "policy/v1", probability,
                          decision, ("LOW_DEFAULT_RISK",))


@pytest.fixture
async def outbox(tmp_path):
    box = Outbox(f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}", synchronous="NORMAL")
    await box.migrate()
    yield box
    await box.close()


async def test_c39_a_retried_request_id_gets_the_decision_recorded_first(outbox):
    first = await outbox.record(decision("r1", probability=0.2))
    retry = await outbox.record(decision("r1", probability=0.9, decision="DECLINE"))
    assert not first.replayed and retry.replayed
    assert retry.decision == first.decision and retry.decision.decision_id == decision_id_for("r1")
    assert (await outbox.backlog())[0] == 1


async def test_concurrent_decisions_share_commits(outbox):
    commits_before = REGISTRY.get_sample_value("prediction_outbox_commit_rows_count") or 0
    recorded = await asyncio.gather(*(outbox.record(decision(f"g{i}")) for i in range(200)))
    commits = REGISTRY.get_sample_value("prediction_outbox_commit_rows_count") - commits_before
    assert len({r.decision.decision_id for r in recorded}) == 200 and not any(r.replayed for r in recorded)
    assert commits <= 2  # group commit: not one transaction per decision
    assert (await outbox.backlog())[0] == 200


async def test_c39_duplicates_in_one_commit_are_recorded_once(outbox):
    recorded = await asyncio.gather(*(outbox.record(decision("dup", probability=p)) for p in (0.1, 0.5, 0.9)))
    assert [r.replayed for r in recorded] == [False, True, True]
    assert {r.decision.probability for r in recorded} == {0.1}
    assert (await outbox.backlog())[0] == 1


async def test_an_outbox_that_cannot_write_refuses_the_decision(tmp_path):
    import sqlite3

    box = Outbox(f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}", synchronous="NORMAL", busy_timeout_s=0.2)
    await box.migrate()
    try:
        await box.record(decision("before"))
        holder = sqlite3.connect(tmp_path / "outbox.sqlite", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process holds the file's write lock
        assert not await box.probe()
        with pytest.raises(OutboxUnavailable):
            await box.record(decision("during"))
        holder.execute("ROLLBACK")
        holder.close()
        assert await box.probe()
        assert await box.find("during") is None and await box.find("before") is not None
    finally:
        await box.close()


def proxied(url: str, proxy: TcpProxy) -> str:
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


@pytest.fixture
async def postgres_proxy(postgres_url):
    target = make_url(postgres_url)
    proxy = TcpProxy(target.host, target.port)
    await proxy.start()
    yield proxy
    await proxy.close()


async def crm_rows(crm, request_ids: list[str]) -> tuple[int, int]:
    from sqlalchemy import func, select

    from mlpair.prediction.crm.models import DecisionRecord

    async with crm.engine.connect() as conn:
        total, distinct = (await conn.execute(
            select(func.count(), func.count(func.distinct(DecisionRecord.request_id)))
            .where(DecisionRecord.request_id.in_(request_ids)))).one()
    return total, distinct


async def test_c39_decisions_wait_durably_through_a_crm_outage_and_a_restart_then_arrive_once(
        postgres_url, postgres_proxy, tmp_path):
    outbox_url = f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}"
    crm_url = proxied(postgres_url, postgres_proxy)
    ids = [f"outage-{uuid.uuid4()}" for _ in range(30)]
    recorder = DecisionRecorder.open(outbox_url, crm_url, crm_timeout_s=1, backoff_max_s=0.2)
    await recorder.start()
    await postgres_proxy.cut()
    recorded = await asyncio.gather(*(recorder.record(decision(i)) for i in ids))  # answered while the CRM is down
    assert len(recorded) == 30
    assert not await recorder.wait_delivered(1.0)
    await recorder.close()  # the process stops with the CRM still down
    await postgres_proxy.restore()
    recorder = DecisionRecorder.open(outbox_url, crm_url, crm_timeout_s=1, backoff_max_s=0.2)
    await recorder.start()
    try:
        assert await recorder.wait_delivered(20)
        assert await crm_rows(recorder.crm, ids) == (30, 30)
        assert (await recorder.crm.find(ids[0])).decision_id == recorded[0].decision.decision_id
    finally:
        await recorder.close()


async def test_c39_connections_cut_in_the_middle_of_deliveries_lose_and_double_nothing(
        postgres_url, postgres_proxy, tmp_path):
    outbox_url = f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}"
    ids = [f"cut-{uuid.uuid4()}" for _ in range(600)]
    recorder = DecisionRecorder.open(outbox_url, proxied(postgres_url, postgres_proxy), crm_timeout_s=1,
                                     batch_size=20, backoff_max_s=0.1)
    await recorder.start()
    failures_before = REGISTRY.get_sample_value("prediction_relay_failures_total") or 0
    try:
        await postgres_proxy.cut()  # the relay starts against a CRM that is down...
        await asyncio.gather(*(recorder.record(decision(i)) for i in ids[:300]))
        await asyncio.sleep(0.1)
        await postgres_proxy.restore()
        await asyncio.gather(*(recorder.record(decision(i)) for i in ids[300:]))
        for _ in range(5):  # ...then loses its connection again and again while working through the backlog
            await asyncio.sleep(0.05)
            await postgres_proxy.cut()
            await asyncio.sleep(0.1)
            await postgres_proxy.restore()
        assert await recorder.wait_delivered(30)
        assert await crm_rows(recorder.crm, ids) == (600, 600)
        assert REGISTRY.get_sample_value("prediction_relay_failures_total") > failures_before
    finally:
        await recorder.close()


async def test_c39_a_commit_whose_acknowledgement_is_lost_is_retried_without_doubling(
        postgres_url, postgres_proxy, tmp_path):
    ids = [f"lost-ack-{uuid.uuid4()}" for _ in range(10)]
    recorder = DecisionRecorder.open(f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}",
                                     proxied(postgres_url, postgres_proxy), crm_timeout_s=1, backoff_max_s=0.1)
    await recorder.start()
    skipped_before = REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") or 0
    postgres_proxy.lose_reply_after(b"COMMIT")  # the delivery transaction commits; the relay never hears of it
    try:
        await asyncio.gather(*(recorder.record(decision(i)) for i in ids))
        assert await recorder.wait_delivered(20)
        assert postgres_proxy.replies_lost == 1
        assert await crm_rows(recorder.crm, ids) == (10, 10)
        # the retried transaction found every row already there and inserted none of them again
        assert REGISTRY.get_sample_value("prediction_outbox_already_in_crm_total") - skipped_before == 10
    finally:
        await recorder.close()


def test_relay_backoff_is_bounded_however_long_the_outage(tmp_path):
    from mlpair.prediction.crm.outbox import OutboxRelay

    relay = OutboxRelay(Outbox(f"sqlite+aiosqlite:///{tmp_path / 'o.sqlite'}"), None, backoff_base_s=0.05,
                        backoff_max_s=5.0)
    waits = [relay.backoff_s(failures) for failures in (1, 10, 2000, 10**6)]
    assert all(0.0 <= w <= 5.0 for w in waits)


async def test_the_relay_falls_back_to_the_file_when_its_hand_off_overflows(
        postgres_url, postgres_proxy, tmp_path, monkeypatch):
    from mlpair.prediction.crm import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "MAX_FRESH", 50)
    ids = [f"overflow-{uuid.uuid4()}" for _ in range(150)]
    recorder = DecisionRecorder.open(f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}",
                                     proxied(postgres_url, postgres_proxy), crm_timeout_s=1, backoff_max_s=0.1)
    await recorder.start()
    try:
        await postgres_proxy.cut()
        await asyncio.gather(*(recorder.record(decision(i)) for i in ids))  # more than the hand-off holds
        assert recorder.outbox.overflows >= 1 and recorder.outbox.backlog_on_disk
        await postgres_proxy.restore()
        assert await recorder.wait_delivered(20)
        assert await crm_rows(recorder.crm, ids) == (150, 150)
        later = [f"after-{uuid.uuid4()}" for _ in range(20)]  # caught up: new decisions use the hand-off again
        await asyncio.gather(*(recorder.record(decision(i)) for i in later))
        assert await recorder.wait_delivered(20)
        assert await crm_rows(recorder.crm, later) == (20, 20) and not recorder.outbox.backlog_on_disk
    finally:
        await recorder.close()


def test_decision_ids_are_rfc_4122_uuid5_of_the_request_id():
    from mlpair.prediction.crm.store import _DECISION_NAMESPACE

    for request_id in ("r1", "", "é" * 64, "x" * 128, "日本語-id"):
        assert decision_id_for(request_id) == str(uuid.uuid5(_DECISION_NAMESPACE, request_id))


def test_a_stored_decision_serialises_every_field():
    import dataclasses
    from datetime import datetime, timezone

    d = dataclasses.replace(decision("every-field"), decision_id="d", decided_at=datetime(2026, 1, 2, tzinfo=timezone.utc),
                            served_from="stale_cache", cache_age_ms=7, degraded_reason="CIRCUIT_OPEN")
    assert StoredDecision.from_json(d.to_json()) == d
    assert set(d.to_row()) == {f.name for f in dataclasses.fields(StoredDecision)}


async def test_recording_nothing_returns_at_once(outbox):
    assert await outbox.record_many([]) == []


async def test_a_call_larger_than_one_commit_gets_every_outcome_in_order(outbox):
    from mlpair.prediction.crm.outbox import MAX_COMMIT_ROWS

    first = [decision(f"split-a-{i}") for i in range(3)]
    large = [decision(f"split-b-{i}") for i in range(MAX_COMMIT_ROWS + 7)]
    recorded_first, recorded_large = await asyncio.gather(outbox.record_many(first), outbox.record_many(large))
    assert [r.decision.request_id for r in recorded_first] == [d.request_id for d in first]
    assert [r.decision.request_id for r in recorded_large] == [d.request_id for d in large]
    assert not any(r.replayed for r in recorded_first + recorded_large)
