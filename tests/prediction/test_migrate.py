"""`mlpair migrate`: the schema owner's pre-deploy step, the serving role's privileges, and
expand/contract compatibility with the previous release's code.

The serving process never migrates: these tests start it as a role that cannot change any
schema, refuse to start it on an unmigrated database, and run the previous release's code (read
from git history) against this release's schema, next to this release, as during a rollout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import grpc
import pytest
from sqlalchemy import make_url

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import to_attributes
from mlpair.prediction.recording.admin import migrate
from mlpair.prediction.recording.migrate import SchemaNotReady
from tests.fault_support import free_port, prediction_service, prediction_settings
from tests.support import pair as harness
from tests.support.ledger import mlpair_cli
from tests.support.pair import asyncpg_dsn

pytestmark = pytest.mark.timeout(180)


def as_user(url: str, user: str) -> str:
    return make_url(url).set(username=user, password=None).render_as_string(hide_password=False)


@pytest.fixture
def serving_role(fresh_postgres):
    """A login role created for the test (cluster-wide: its grants in the test's database and the
    role itself are dropped afterwards)."""
    name = f"mlpair_serving_{uuid.uuid4().hex[:8]}"

    async def admin(*statements: str) -> None:
        conn = await asyncpg.connect(asyncpg_dsn(fresh_postgres))
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE ROLE "{name}" LOGIN'))
    yield name
    asyncio.run(admin(f'DROP OWNED BY "{name}"', f'DROP ROLE "{name}"'))


def test_migrate_creates_both_schemas_and_is_idempotent(tmp_path):
    ledger, crm = f"sqlite+aiosqlite:///{tmp_path / 'l.sqlite'}", f"sqlite+aiosqlite:///{tmp_path / 'c.sqlite'}"
    for _ in range(2):
        done = mlpair_cli("migrate", "--ledger-url", ledger, "--crm-url", crm)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "ledger at ledger_0005, CRM at crm_0003"


def test_migrate_names_an_unreachable_database_in_one_line(tmp_path):
    done = mlpair_cli("migrate", "--ledger-url", f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none",
                      "--crm-url", f"sqlite+aiosqlite:///{tmp_path / 'c.sqlite'}")
    assert done.returncode == 1 and done.stderr.startswith("mlpair migrate: ") and len(done.stderr.splitlines()) == 1


async def test_the_service_refuses_to_start_on_a_database_nobody_migrated(model_repository, tmp_path):
    from mlpair.prediction.server import start

    settings = prediction_settings(tmp_path, model_repository, f"127.0.0.1:{free_port()}")
    with pytest.raises(SchemaNotReady, match="mlpair migrate"):
        await start(settings)
    done = mlpair_cli("serve", "prediction", env={
        "PREDICTION_PORT": "0", "PREDICTION_METRICS_PORT": "0", "PREDICTION_HOST": "127.0.0.1",
        "PREDICTION_LEDGER_URL": settings.ledger_url, "PREDICTION_CRM_URL": settings.crm_url,
        "PREDICTION_MODEL_REPOSITORY": str(model_repository), "PREDICTION_CONFIG_DIR": str(settings.config_dir)})
    assert done.returncode != 0 and "run `mlpair migrate`" in done.stderr.splitlines()[-1]


async def test_the_serving_role_decides_but_cannot_change_any_schema(
        fresh_postgres, serving_role, model_repository, inference_server, credit_holdout, tmp_path):
    done = mlpair_cli("migrate", "--ledger-url", fresh_postgres, "--crm-url", fresh_postgres,
                      "--serving-role", serving_role)
    assert done.returncode == 0, done.stderr
    assert f"serving role {serving_role} granted" in done.stdout
    as_serving = as_user(fresh_postgres, serving_role)
    settings = prediction_settings(tmp_path, model_repository, inference_server, ledger_url=as_serving,
                                   crm_url=as_serving)
    from mlpair.prediction.server import start, stop  # the server as the serving role: it never migrates

    server, port, health, predictor = await start(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await pb_grpc.PredictionServiceStub(channel).Predict(pb.PredictRequest(
                request_id="as-serving-role", entity_id="e", attributes=to_attributes(credit_holdout.records[0])),
                timeout=20)
        assert reply.decision_label and await predictor.recorder.wait_delivered(20)
        assert (await predictor.crm.find("as-serving-role")).decision_id == reply.decision_id
    finally:
        await stop(server, health, predictor, 0)

    conn = await asyncpg.connect(asyncpg_dsn(as_serving))
    try:
        for ddl in ("CREATE TABLE prediction.sneaky (x int)", "CREATE TABLE public.sneaky (x int)",
                    "ALTER TABLE prediction.decision_ledger ADD COLUMN x int", "DROP TABLE decisions",
                    "DELETE FROM prediction.decision_ledger", "DELETE FROM decisions",
                    "UPDATE decisions SET decision = 'APPROVE'", "TRUNCATE prediction.decision_ledger"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(ddl)
    finally:
        await conn.close()


def previous_release(tmp_path: Path) -> Path:
    """The previous release's code from git history (see :func:`tests.support.pair.previous_release`)."""
    ref = harness.PREVIOUS_SCHEMA_RELEASE
    if (release := harness.previous_release(tmp_path / "previous", ref)) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"git history with {ref} is needed to run the previous release's code")
        pytest.skip(f"no git history with {ref} (a clone with history runs this test)")
    return release


async def test_the_previous_release_runs_against_this_schema_beside_this_release(
        fresh_postgres, model_repository, inference_server, credit_holdout, tmp_path):
    """Expand/contract: during a rollout the previous release's pods keep deciding and delivering
    against the schema `mlpair migrate` made (keeping no audit record: the new table is left alone), this
    release replays what they decided and they replay what it decided; and a CRM row written by a
    release from before the shared ledger is backfilled (`--backfill-from-crm`) and replayed."""
    release = previous_release(tmp_path)
    assert mlpair_cli("migrate", "--ledger-url", fresh_postgres, "--crm-url", fresh_postgres).returncode == 0
    port = free_port()
    env = {"PREDICTION_HOST": "127.0.0.1", "PREDICTION_PORT": str(port), "PREDICTION_METRICS_PORT": "0",
           "PREDICTION_INFERENCE_TARGET": inference_server, "PREDICTION_CRM_URL": fresh_postgres,
           "PREDICTION_LEDGER_URL": fresh_postgres, "PREDICTION_WORKERS": "1",
           "PREDICTION_MODEL_REPOSITORY": str(model_repository), "PREDICTION_CONFIG_DIR": str(release / "source" / "config"),
           "PYTHONPATH": str(release / "package")}
    with open(tmp_path / "previous-release.log", "w") as log:  # the child holds its own descriptor
        old = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "prediction"], env={**os.environ, **env},
                               stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        from mlpair.rpc import wait_until_serving

        assert await asyncio.to_thread(wait_until_serving, f"127.0.0.1:{port}", 60, lambda: old.poll() is None), \
            (tmp_path / "previous-release.log").read_text()[-2000:]
        attributes = to_attributes(credit_holdout.records[3])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            old_stub = pb_grpc.PredictionServiceStub(channel)
            old_reply = await old_stub.Predict(pb.PredictRequest(
                request_id="decided-by-previous-release", entity_id="e-old", attributes=attributes), timeout=20)
            settings = prediction_settings(tmp_path, model_repository, inference_server, ledger_url=fresh_postgres,
                                           crm_url=fresh_postgres)
            async with prediction_service(settings) as (stub, predictor, _, _):
                for _ in range(100):  # one of the two releases' relays delivers it into the CRM
                    if await predictor.crm.find("decided-by-previous-release") is not None:
                        break
                    await asyncio.sleep(0.1)
                delivered = await predictor.crm.find("decided-by-previous-release")
                assert delivered is not None and delivered.decision_id == old_reply.decision_id
                # the previous release keeps no audit record; this release keeps one for its own decisions
                assert await predictor.recorder.ledger.audit_record("decided-by-previous-release") is None
                replay = await stub.Predict(pb.PredictRequest(request_id="decided-by-previous-release",
                                                              entity_id="e-old", attributes=attributes), timeout=20)
                assert replay.replayed and (replay.decision_id, replay.decision_label, replay.probability) == \
                    (old_reply.decision_id, old_reply.decision_label, old_reply.probability)
                new_reply = await stub.Predict(pb.PredictRequest(request_id="decided-by-this-release",
                                                                 entity_id="e-new", attributes=attributes), timeout=20)
                old_replay = await old_stub.Predict(pb.PredictRequest(
                    request_id="decided-by-this-release", entity_id="e-new", attributes=attributes), timeout=20)
                assert old_replay.replayed and old_replay.decision_id == new_reply.decision_id
                assert (await predictor.recorder.ledger.find("decided-by-this-release")).decision.caller == "anonymous"
                assert await predictor.recorder.ledger.audit_record("decided-by-this-release") is not None

                # a decision only the CRM holds, as a release before the shared ledger delivered it
                conn = await asyncpg.connect(asyncpg_dsn(fresh_postgres))
                try:
                    await conn.execute(
                        "INSERT INTO decisions (decision_id, request_id, entity_id, model_name, model_version, "
                        "feature_schema_version, policy_version, probability, decision, reason_codes) VALUES "
                        "('d-crm-only', 'in-crm-only', 'e-crm', 'credit-risk', '1', 'credit-risk/v1', 'p/1', 0.25, "
                        "'APPROVE', '[\"LOW_DEFAULT_RISK\"]')")
                finally:
                    await conn.close()
                report = await migrate(fresh_postgres, fresh_postgres, backfill_from_crm=True)
                assert report.backfilled_from_crm == 1
                backfilled = await stub.Predict(pb.PredictRequest(request_id="in-crm-only", entity_id="e-crm",
                                                                  attributes=attributes), timeout=20)
                assert backfilled.replayed and (backfilled.decision_id, backfilled.decision_label) == \
                    ("d-crm-only", "APPROVE")
    finally:
        old.terminate()
        old.wait(30)
        log.close()


async def test_import_outbox_brings_the_previous_release_decisions_into_the_ledger(
        fresh_postgres, model_repository, tmp_path):
    """An old pod's outbox file (delivered and undelivered rows) imported once: the delivered ones
    replay, the undelivered ones are delivered by this release's relay."""
    import sqlite3

    from mlpair.prediction.recording.codecs import to_json
    from mlpair.prediction.recording.ledger import open_ledger
    from mlpair.prediction.records import StoredDecision

    outbox = tmp_path / "outbox.sqlite"
    with sqlite3.connect(outbox) as conn:
        conn.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, request_id TEXT UNIQUE, payload TEXT, "
                     "recorded_at REAL, delivered_at REAL)")
        for k, delivered in enumerate((1.0, None, None)):
            d = StoredDecision(f"d-{k}", f"old-{k}", "e", "credit-risk", "1", "credit-risk/v1", "p/1", 0.1 * k,
                               "APPROVE", ("LOW_DEFAULT_RISK",))
            conn.execute("INSERT INTO outbox (request_id, payload, recorded_at, delivered_at) VALUES (?, ?, 0, ?)",
                         (d.request_id, to_json(d), delivered))
    done = mlpair_cli("migrate", "--ledger-url", fresh_postgres, "--crm-url", fresh_postgres, "--import-outbox",
                      str(outbox))
    assert done.returncode == 0 and "3 decision(s) imported from outboxes" in done.stdout, done.stderr
    ledger = open_ledger(fresh_postgres)
    await ledger.open()
    try:
        assert (await ledger.find("old-1")).decision.decision_id == "d-1"
        assert (await ledger.backlog())[0] == 2  # the two the old pod had not delivered
    finally:
        await ledger.close()
