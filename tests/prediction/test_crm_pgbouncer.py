"""PgBouncer in transaction mode in front of the ledger and the CRM.

``crm_statement_cache_size=0``, against the real PostgreSQL: the CRM store still delivers and
reads, and no statement it leaves prepared on a server connection has asyncpg's per-connection
counter name (``__asyncpg_stmt_N__``), which two clients sharing that server connection through
PgBouncer would both use.

C58, against a real PgBouncer (Debian's package, started here on a free loopback port): without
the settings, ``mlpair serve prediction`` (one process or a supervisor) and ``mlpair relay``
refuse to start, exit 2 with one line naming the setting; with them, every Predict call is
recorded and delivered through the pooler."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from sqlalchemy import make_url, text

from mlpair.prediction.recording.store import CrmStore
from tests.support.ledger import crm_decision
from tests.support.pair import reachable


async def prepared_names(crm: CrmStore) -> tuple[list[str], list[str]]:
    """Deliveries and reads on one pooled connection, then the names prepared on it."""
    tag = uuid.uuid4().hex[:8]
    for i in range(3):
        batch = [crm_decision(f"pgb-{tag}-{i}-{j}") for j in range(2)]
        assert sorted(await crm.deliver(batch)) == sorted(d.request_id for d in batch)
        assert await crm.find(batch[0].request_id) == batch[0]
    async with crm.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
        names = (await conn.execute(text("SELECT name FROM pg_prepared_statements"))).scalars().all()
    return [n for n in names if n.startswith("__asyncpg_stmt_")], names


@pytest.mark.timeout(60)
async def test_a_crm_without_statement_cache_names_no_statement_by_counter(postgres_url):
    cached, plain = CrmStore(postgres_url), CrmStore(postgres_url, statement_cache_size=0)
    try:
        await cached.create_schema()
        counter_named, _ = await prepared_names(cached)
        assert counter_named, "the default engine caches statements under asyncpg's counter names"
        counter_named, names = await prepared_names(plain)
        assert counter_named == []
        assert all(re.fullmatch(r"__asyncpg_[0-9a-f]{32}__", n) for n in names), names
    finally:
        await cached.close()
        await plain.close()


# --- C58: the ledger and the CRM behind a real PgBouncer in transaction mode -------------------


def pgbouncer_binary() -> Path:
    """PgBouncer (``make .venv/bin/pgbouncer`` unpacks Debian's package); skips (fails under CI=true) without it."""
    for candidate in (Path(sys.prefix) / "bin" / "pgbouncer", shutil.which("pgbouncer")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    message = ("pgbouncer not found: `make .venv/bin/pgbouncer` unpacks it from Debian's pgbouncer package "
               "(tests/fetch-pgbouncer.sh); the pooler tests need a real one")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: required in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def pgbouncer_url(postgres_url, tmp_path):
    """The test database's URL through a PgBouncer of this test's own (transaction mode, a free
    127.0.0.1 port, its configuration in ``tmp_path``), stopped by its PID afterwards."""
    from tests.support.pair import free_port

    binary, target, port = pgbouncer_binary(), make_url(postgres_url), free_port()
    folder = tmp_path / "pgbouncer"
    folder.mkdir()
    folder.chmod(0o755)  # read by the unprivileged user it runs as when started by root
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"{target.database} = host={target.host} port={target.port or 5432} dbname={target.database} "
        f"user={target.username}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\ndefault_pool_size = 8\nmax_client_conn = 200\n")
    ini.chmod(0o644)
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []  # PgBouncer refuses to run as root
    with open(tmp_path / "pgbouncer.log", "w") as log:  # the child holds its own descriptor
        process = subprocess.Popen([str(binary), *as_user, str(ini)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not reachable("127.0.0.1", port):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "pgbouncer.log").read_text()
            time.sleep(0.05)
        yield target.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def refusal(command: list[str], env: dict[str, str]) -> tuple[int, list[str], float]:
    """Runs ``mlpair <command>``; its exit code, stderr lines and seconds to exit."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mlpair.cli", *command], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - started


@pytest.mark.timeout(120)
def test_c58_a_pooler_that_loses_prepared_statements_is_refused_at_start(model_repository, postgres_url,
                                                                         pgbouncer_url, tmp_path) -> None:
    from tests.support.pair import free_port, pair

    pair(tmp_path, model_repository, crm_url=postgres_url).migrate()  # as the pre-deploy job does, directly
    p = pair(tmp_path, model_repository, crm_url=pgbouncer_url, prediction_env={"PREDICTION_CACHE_BACKEND": "off"})
    env = {**p.prediction.env, "PREDICTION_INFERENCE_TARGET": "127.0.0.1:1"}  # refused before it is needed
    both, crm_only = env, {**env, "PREDICTION_LEDGER_STATEMENT_CACHE_SIZE": "0"}
    relay = {**env, "PREDICTION_RELAY_PORT": str(free_port())}
    runs = {
        "serve, 1 process": refusal(["serve", "prediction"], both),
        "serve, 2 workers": refusal(["serve", "prediction"], {**both, "PREDICTION_WORKERS": "2"}),
        "serve, CRM only": refusal(["serve", "prediction"], crm_only),
        "relay": refusal(["relay"], relay),
    }
    for name, (code, lines, took) in runs.items():
        assert code == 2 and len(lines) == 1, (name, code, lines)
        assert took < 15, (name, took)
        assert "pooler in transaction mode" in lines[0], (name, lines)
    for name in ("serve, 1 process", "serve, 2 workers", "relay"):
        assert "set PREDICTION_LEDGER_STATEMENT_CACHE_SIZE=0" in runs[name][1][0], runs[name]
    assert "set PREDICTION_CRM_STATEMENT_CACHE_SIZE=0" in runs["serve, CRM only"][1][0], runs["serve, CRM only"]


CALLS = 60


@pytest.mark.timeout(180)
def test_c58_with_the_statement_caches_off_every_predict_is_recorded_behind_the_pooler(
        model_repository, credit_holdout, postgres_url, pgbouncer_url, tmp_path) -> None:
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as ppb_grpc
    from tests.e2e.replicas import crm_rows, request
    from tests.support.pair import pair

    pair(tmp_path, model_repository, crm_url=postgres_url).migrate()
    p = pair(tmp_path, model_repository, crm_url=pgbouncer_url, prediction_env={
        "PREDICTION_CACHE_BACKEND": "off", "PREDICTION_LEDGER_STATEMENT_CACHE_SIZE": "0",
        "PREDICTION_CRM_STATEMENT_CACHE_SIZE": "0", "PREDICTION_RELAY_LINGER_MS": "10",
        "PREDICTION_INFERENCE_TIMEOUT_MS": "10000"})
    p.migrate = lambda: None  # migrated above, past the pooler
    ids = [f"pgb-{uuid.uuid4().hex[:8]}-{i}" for i in range(CALLS)]

    async def drive() -> tuple[list, dict]:
        async with grpc.aio.insecure_channel(p.prediction.address) as channel:
            stub = ppb_grpc.PredictionServiceStub(channel)
            limit = asyncio.Semaphore(16)

            async def one(i: int):
                async with limit:
                    try:
                        return await stub.Predict(request(ids[i], credit_holdout.records[i]), timeout=20)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()

            replies = await asyncio.gather(*(one(i) for i in range(CALLS)))
        deadline = time.monotonic() + 30
        while len(rows := await crm_rows(postgres_url, ids)) < CALLS and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return replies, rows

    p.start()
    try:
        replies, rows = asyncio.run(drive())
        codes = p.stop()
    finally:
        p.kill()
    failed = [r for r in replies if isinstance(r, grpc.StatusCode)]
    assert failed == [], failed
    assert len(replies) == CALLS and all(r.decision_label for r in replies)
    assert sorted(rows) == sorted(ids) and all(len(v) == 1 for v in rows.values())
    assert codes["prediction"] == 0, codes
