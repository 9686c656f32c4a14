"""Decision events end to end (issue 40, part 5): PredictionService records into the PostgreSQL ledger,
`mlpair relay` publishes each decision as a CloudEvent to a NATS JetStream stream of the test's own.
The relay is killed with SIGKILL mid-stream and the broker restarted; after deduplication by id the
stream holds exactly one event per recorded decision, and each event carries what the ledger holds."""

from __future__ import annotations

import asyncio
import os
import signal

import asyncpg
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.prediction.recording.events import EVENT_TYPE, tail
from tests.e2e.conftest import prediction_service
from tests.fault_support import eventually
from tests.support.events import start_nats
from tests.support.ledger import relay_process
from tests.support.pair import asyncpg_dsn, scratch_postgres

BATCHES, ITEMS = 30, 20  # 600 decisions, recorded while the relay dies and the broker restarts


@pytest.fixture
def postgres():
    with scratch_postgres(prefix="mlpair_events") as url:
        if url is None:
            pytest.skip("PostgreSQL is not reachable")
        yield url


async def outbox_waiting(url: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await conn.fetchval("SELECT COALESCE(sum(n), 0) FROM prediction.decision_event_outbox")
    finally:
        await conn.close()


async def ledger_decisions(url: str) -> dict[str, tuple]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch("SELECT decision_id, request_id, decision, probability, caller, model_version "
                                "FROM prediction.decision_ledger")
    finally:
        await conn.close()
    return {r[0]: tuple(r[1:]) for r in rows}


async def test_every_recorded_decision_is_one_event_through_a_relay_kill_and_a_broker_restart(
        postgres, inference_server, model_repository, credit_holdout, credit_entry, tmp_path):
    nats = start_nats(tmp_path)
    try:
        events = {"events_url": nats.url, "events_subject": "test.decisions", "events_stream": "TEST_DECISIONS"}
        async with prediction_service(inference_server, model_repository, tmp_path, ledger_url=postgres,
                                      crm_url=postgres, relay_in_process=False, **events) as (stub, predictor):
            records = credit_holdout.records

            async def decide(batch: int) -> None:
                items = [pb.PredictRequest(request_id=f"ev-{batch}-{i}", entity_id=f"e-{batch}-{i}",
                                           attributes=to_attributes(records[(batch * ITEMS + i) % len(records)]))
                         for i in range(ITEMS)]
                await stub.BatchPredict(pb.BatchPredictRequest(requests=items), timeout=60)

            relay_env = dict(events)
            async with relay_process(postgres, postgres, **relay_env) as (first, _, _):
                for batch in range(BATCHES // 3):
                    await decide(batch)
                    if batch == BATCHES // 6:  # mid-stream: a claim in flight rolls back with its connection
                        os.kill(first.pid, signal.SIGKILL)
            for batch in range(BATCHES // 3, 2 * BATCHES // 3):
                await decide(batch)  # recorded while no relay runs: they wait in the event outbox
            assert await outbox_waiting(postgres) > 0
            async with relay_process(postgres, postgres, **relay_env):
                await asyncio.to_thread(nats.restart)  # the broker goes away and comes back mid-stream
                for batch in range(2 * BATCHES // 3, BATCHES):
                    await decide(batch)

                async def drained() -> bool:
                    return await outbox_waiting(postgres) == 0

                await eventually(drained, timeout_s=60)
            ledger = await ledger_decisions(postgres)
        assert len(ledger) == BATCHES * ITEMS
        seen: dict[str, dict] = {}
        async for event in tail(nats.url, subject="test.decisions", stream="TEST_DECISIONS", from_start=True,
                                timeout_s=3.0):
            assert event["id"] not in seen  # tail deduplicates by id
            seen[event["id"]] = event
        assert set(seen) == set(ledger)  # exactly one event per recorded decision, none for anything else
        for decision_id, (request_id, decision, probability, caller, version) in ledger.items():
            event = seen[decision_id]
            data = event["data"]
            assert (event["type"], event["subject"]) == (EVENT_TYPE, request_id)
            assert (data["decision"], data["probability"], data["caller"], data["model_version"]) == \
                (decision, probability, caller, version)
        sample = seen[next(iter(ledger))]["data"]
        schema = credit_entry.preprocessing.feature_schema
        assert not set(sample["attributes"]) & schema.personal_data  # personal data left out by default
        assert len(sample["features"]) == credit_entry.preprocessing.n_features and len(sample["logits"]) == 2
        assembler = FeatureAssembler(credit_entry.preprocessing)
        for name in schema.personal_data:  # nor can the vector give them away
            assert all(v is None for v in sample["features"][assembler.feature_slices[name]]), name
    finally:
        nats.stop()
