"""The outbox relay in a process of its own (``mlpair relay``): PredictionService with
``relay_in_process`` off only records, and relay processes over one PostgreSQL ledger deliver each
decision to the CRM exactly once, through several relays, a SIGTERM mid-backlog and a restart
(and over a SQLite ledger, on its machine).

Each relay is a real ``mlpair relay`` subprocess, started and ended by its PID."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import urllib.request
import uuid

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, make_url, select

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction.recording.admin import migrate
from mlpair.prediction.recording.models import DecisionRecord
from mlpair.prediction.recording.store import CrmStore
from tests.fault_support import TcpProxy, eventually, health_of, prediction_service, prediction_settings
from tests.support.ledger import decision, in_crm, opened_ledger, record_all, relay_process

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
pytestmark = pytest.mark.timeout(60)


async def sigterm(process: subprocess.Popen, timeout_s: float = 15) -> int:
    """SIGTERM to ``process`` by its PID; its exit code (fails if it runs on past ``timeout_s``)."""
    os.kill(process.pid, signal.SIGTERM)
    return await asyncio.to_thread(process.wait, timeout_s)


async def scrape(url: str, labelled: str | None = None) -> dict:
    """The relay's unlabelled samples, by name; or, given ``labelled``, that sample's series by
    their (model, outcome) labels."""
    def read() -> str:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.read().decode()

    families = text_string_to_metric_families(await asyncio.to_thread(read))
    if labelled:
        return {(s.labels["model"], s.labels["outcome"]): s.value for family in families
                for s in family.samples if s.name == labelled}
    return {s.name: s.value for family in families for s in family.samples if not s.labels}


async def crm_total(crm_url: str) -> int:
    """Every row of the CRM's decisions table (the database is this test's alone)."""
    crm = CrmStore(crm_url, timeout_s=5)
    try:
        async with crm.engine.connect() as conn:
            return (await conn.execute(select(func.count()).select_from(DecisionRecord))).scalar_one()
    finally:
        await crm.close()


async def exactly_once(crm_url: str, ids: list[str]) -> tuple[int, int, int]:
    """(rows of these request ids, distinct ones, rows in the whole CRM table)."""
    total, distinct = await in_crm(crm_url, ids)
    return total, distinct, await crm_total(crm_url)


async def record_backlog(url: str, n: int, prefix: str) -> list[str]:
    """``n`` undelivered decisions committed to the ledger, as serving processes leave them."""
    ids = [f"{prefix}-{uuid.uuid4()}" for _ in range(n)]
    async with opened_ledger(url) as ledger:
        await record_all(ledger, ids)
    return ids


async def backlog(url: str) -> int:
    async with opened_ledger(url) as ledger:
        return (await ledger.backlog())[0]


async def test_a_service_without_its_relay_only_records_and_a_relay_process_delivers_each_decision_once(
        migrated_postgres, model_repository, inference_server, credit_holdout, tmp_path):
    settings = prediction_settings(tmp_path, model_repository, inference_server, ledger_url=migrated_postgres,
                                   crm_url=migrated_postgres, relay_in_process=False)
    records = credit_holdout.records
    batch_ids = [f"batch-{uuid.uuid4()}" for _ in range(300)]
    single_ids = [f"single-{uuid.uuid4()}" for _ in range(20)]
    async with prediction_service(settings) as (stub, predictor, _, _):
        assert predictor.recorder.relay is None
        for start in range(0, len(batch_ids), 100):
            reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
                pb.PredictRequest(request_id=rid, entity_id="e", attributes=to_attributes(records[k % len(records)]))
                for k, rid in enumerate(batch_ids[start:start + 100], start)]), timeout=20)
            assert all(r.WhichOneof("outcome") == "prediction" for r in reply.results)
        for k, rid in enumerate(single_ids):
            await stub.Predict(pb.PredictRequest(request_id=rid, entity_id="e",
                                                 attributes=to_attributes(records[k])), timeout=10)
        await asyncio.sleep(0.5)  # ten times the linger an in-process relay would wait before delivering
        assert (await predictor.recorder.ledger.backlog())[0] == 320
        assert await crm_total(migrated_postgres) == 0
        # the drain's delivery waits for no relay: the rows stay in the ledger
        assert not await predictor.recorder.wait_delivered(0.2)
    ids = batch_ids + single_ids
    assert await backlog(migrated_postgres) == 320

    async with relay_process(migrated_postgres, migrated_postgres) as (relay, _, metrics_url):
        async def delivered() -> bool:
            return await backlog(migrated_postgres) == 0

        await eventually(delivered, timeout_s=20)
        assert await exactly_once(migrated_postgres, ids) == (320, 320, 320)
        samples = await scrape(metrics_url)
        assert samples["prediction_outbox_delivered_total"] == 320
        assert samples["prediction_outbox_already_in_crm_total"] == 0
        assert await sigterm(relay) == 0


async def test_a_service_without_its_relay_stops_at_once_leaving_its_backlog_in_the_ledger(
        migrated_postgres, model_repository, inference_server, credit_holdout, tmp_path):
    """SIGTERM's delivery step (up to 5 s of the grace with a relay in process) is skipped: the
    process stops while every decision it made is still undelivered."""
    from mlpair.prediction.server import stop
    from tests.support import start_prediction

    settings = prediction_settings(tmp_path, model_repository, inference_server, ledger_url=migrated_postgres,
                                   crm_url=migrated_postgres, relay_in_process=False)
    server, _, health, predictor = await start_prediction(settings)
    try:
        await predictor.recorder.ledger.record_many([decision(f"stop-{i}") for i in range(10)], ["fp"] * 10)
    finally:
        async with asyncio.timeout(3):  # well under SHUTDOWN_DELIVERY_S: no wait for a delivery
            await stop(server, health, predictor, grace_s=10)
    assert await backlog(migrated_postgres) == 10 and await crm_total(migrated_postgres) == 0


async def test_two_relay_processes_over_one_backlog_deliver_each_decision_exactly_once(migrated_postgres):
    settings = dict(relay_batch_size="20", ledger_pool_size="6")  # three claims at once per relay
    async with relay_process(migrated_postgres, migrated_postgres, **settings) as (a, _, a_metrics), \
            relay_process(migrated_postgres, migrated_postgres, **settings) as (b, _, b_metrics):
        ids = await record_backlog(migrated_postgres, 3000, "two")  # both relays are up and polling

        async def delivered() -> bool:
            return await backlog(migrated_postgres) == 0

        await eventually(delivered, timeout_s=30)
        assert await exactly_once(migrated_postgres, ids) == (3000, 3000, 3000)
        by_a, by_b = await scrape(a_metrics), await scrape(b_metrics)
        assert by_a["prediction_outbox_delivered_total"] + by_b["prediction_outbox_delivered_total"] == 3000
        assert by_a["prediction_outbox_already_in_crm_total"] == by_b["prediction_outbox_already_in_crm_total"] == 0
        assert by_a["prediction_outbox_delivered_total"] > 0 and by_b["prediction_outbox_delivered_total"] > 0
        assert await sigterm(a) == 0 and await sigterm(b) == 0


async def test_a_relay_stopped_mid_backlog_exits_0_and_the_next_relay_delivers_the_rest_once(migrated_postgres):
    ids = await record_backlog(migrated_postgres, 10_000, "sigterm")
    async with relay_process(migrated_postgres, migrated_postgres, relay_batch_size="10", relay_linger_ms="0") as (first, _, _):
        async def started() -> bool:
            return await crm_total(migrated_postgres) > 0

        await eventually(started, timeout_s=20, interval_s=0.02)
        assert await sigterm(first, timeout_s=10) == 0  # its batches in flight finish, then it exits
    left = await backlog(migrated_postgres)
    assert 0 < left < 10_000  # stopped mid-backlog
    assert await exactly_once(migrated_postgres, ids) == (10_000 - left, 10_000 - left, 10_000 - left)

    async with relay_process(migrated_postgres, migrated_postgres) as (second, _, metrics_url):
        async def delivered() -> bool:
            return await backlog(migrated_postgres) == 0

        await eventually(delivered, timeout_s=30)
        assert await exactly_once(migrated_postgres, ids) == (10_000, 10_000, 10_000)
        samples = await scrape(metrics_url)
        assert samples["prediction_outbox_delivered_total"] == left  # none had reached the CRM before
        assert samples["prediction_outbox_already_in_crm_total"] == 0
        assert await sigterm(second) == 0


async def test_the_relay_process_answers_health_and_metrics_and_is_unready_while_the_ledger_is_away(migrated_postgres):
    target = make_url(migrated_postgres)
    proxy = TcpProxy(target.host, target.port)
    await proxy.start()
    through_proxy = target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        async with relay_process(through_proxy, migrated_postgres, health_interval_ms="200", ledger_timeout_ms="500",
                                 models='["credit-risk", "churn"]') as (relay, address, metrics_url):
            assert await health_of(address, "liveness") == await health_of(address, "relay") == SERVING
            assert await health_of(address, "ledger") == await health_of(address, "crm") == SERVING
            samples = await scrape(metrics_url)
            assert samples["prediction_outbox_depth"] == 0
            assert "prediction_relay_failures_total" in samples
            # the CRM write SLO's series exist at zero before any delivery (rate() then sees a first failure)
            writes = await scrape(metrics_url, labelled="prediction_crm_writes_total")
            assert writes == {(m, o): 0.0 for m in ("credit-risk", "churn") for o in ("ok", "error")}

            await proxy.cut()

            async def unready() -> bool:
                return await health_of(address, "") == NOT_SERVING

            await eventually(unready, timeout_s=10)
            assert await health_of(address, "ledger") == await health_of(address, "relay") == NOT_SERVING
            assert await health_of(address, "liveness") == SERVING  # not restarted for a ledger outage
            await proxy.restore()

            async def ready() -> bool:
                return await health_of(address, "") == SERVING

            await eventually(ready, timeout_s=10)
            assert await sigterm(relay) == 0
    finally:
        await proxy.close()


async def test_two_relay_processes_over_a_sqlite_ledger_on_one_machine_deliver_each_decision_once(tmp_path):
    """A SQLite ledger's relays claim leases in short write transactions, so relay processes on
    the ledger's machine share its backlog as its serving workers do."""
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}"
    crm_url = f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}"
    await migrate(ledger_url, crm_url)
    settings = dict(relay_batch_size="20", ledger_synchronous="NORMAL")
    async with relay_process(ledger_url, crm_url, **settings) as (a, _, a_metrics), \
            relay_process(ledger_url, crm_url, **settings) as (b, _, b_metrics):
        ids = await record_backlog(ledger_url, 1000, "sqlite")

        async def delivered() -> bool:
            return await backlog(ledger_url) == 0

        await eventually(delivered, timeout_s=30)
        assert await exactly_once(crm_url, ids) == (1000, 1000, 1000)
        by_a, by_b = await scrape(a_metrics), await scrape(b_metrics)
        assert by_a["prediction_outbox_delivered_total"] + by_b["prediction_outbox_delivered_total"] == 1000
        assert by_a["prediction_outbox_already_in_crm_total"] == by_b["prediction_outbox_already_in_crm_total"] == 0
        assert await sigterm(a) == 0 and await sigterm(b) == 0


def test_a_relay_process_claims_with_the_connections_a_server_keeps_for_commits():
    """Nothing commits in ``mlpair relay``: with the default ledger pool of 4 its relay claims three
    batches at once (one connection kept for health's reads) where a serving process's relay, next to
    its three commit connections, claims one. No I/O: the pools are only built."""
    from mlpair.prediction.recording.recorder import recorder_for
    from mlpair.prediction.relay_server import build_recorder
    from mlpair.prediction.settings import PredictionSettings

    settings = PredictionSettings(ledger_url="postgresql+asyncpg://nobody@127.0.0.1:9/none",
                                  crm_url="postgresql+asyncpg://nobody@127.0.0.1:9/none")
    assert (settings.ledger_pool_size, settings.relay_concurrency) == (4, 3)
    assert build_recorder(settings).relay.concurrency == 3
    assert recorder_for(settings, relay=True).relay.concurrency == 1
