"""``mlpair score --engine ray`` on a real local Ray cluster of two one-CPU nodes (a head and a
worker node, each its own ``ray start`` process) against a real pair (processes, a PostgreSQL
ledger, the relay to a PostgreSQL CRM): the driver killed with SIGKILL halfway and run again decides
each row exactly once, and the output holds each row once.

Skipped where Ray is not installed (the ``score-ray`` extra), except under CI=true, where that is a
broken install and fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mlpair.jobs.sources import asyncpg_dsn
from tests.support import POSTGRES_HOST, POSTGRES_PORT, require_service
from tests.support.pair import REPO, pair, reachable, scratch_postgres

pytestmark = pytest.mark.timeout(300)
ROWS = 3_000
BATCH_ROWS = 100
JOB_ID = "ray-e2e"
MAX_CHUNK_ROWS = 1_000  # the service's PREDICTION_MAX_CHUNK_ROWS here


def require_ray() -> Path:
    """The ``ray`` executable beside this Python; skips without Ray (fails under CI=true)."""
    try:
        import ray.data  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("Ray is not installed (pip install -e '.[dev]' installs the score-ray extra): required in CI")
        pytest.skip("Ray is not installed: pip install -e '.[score-ray]'")
    return Path(sys.executable).parent / "ray"


@contextlib.contextmanager
def ray_cluster(ray: Path):
    """A head node and a worker node, one CPU each, with their own temporary folder and ports; yields
    the head's address and the environment its clients need. Each ``ray start --block`` runs in a
    session of its own: ended by its PID (SIGTERM stops its node), then SIGKILL to what is left of
    its process group."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port, *ports = distinct_free_ports(5)
    # HOME of its own: a token in ~/.ray (another cluster's) would make Ray's processes and clients
    # expect token authentication this cluster does not use
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HOME": temp}

    def common() -> list[str]:
        return [f"--temp-dir={temp}", "--num-cpus=1", f"--node-manager-port={ports.pop()}",
                f"--object-manager-port={ports.pop()}"]

    log = open(Path(temp) / "start.log", "w")  # noqa: SIM115 (closed below)
    nodes = [subprocess.Popen([ray, "start", "--block", "--head", f"--port={port}", "--include-dashboard=false",
                               *common()], env=env, start_new_session=True, stdout=log, stderr=log)]
    try:
        deadline = time.monotonic() + 120  # two Ray nodes on a loaded 2-core machine
        while not reachable("127.0.0.1", port):
            assert nodes[0].poll() is None and time.monotonic() < deadline, (Path(temp) / "start.log").read_text()
            time.sleep(0.1)
        address = f"127.0.0.1:{port}"
        nodes.append(subprocess.Popen([ray, "start", "--block", f"--address={address}", *common()], env=env,
                                      start_new_session=True, stdout=log, stderr=log))
        wait_for_nodes(address, 2, deadline, env)
        yield address, env
    finally:
        for node in nodes:
            node.terminate()
        grace = time.monotonic() + 3
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(max(0.1, grace - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def distinct_free_ports(n: int) -> list[int]:
    """``n`` different free ports (each held open until all are chosen: the kernel may hand the same
    one out again once it is closed)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def wait_for_nodes(address: str, nodes: int, deadline: float, env: dict[str, str]) -> None:
    """Until ``nodes`` nodes are alive in the cluster (asked in a child process, so this one never
    joins the cluster as a driver)."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    while True:
        done = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=60,
                              env=env)
        if done.stdout.strip() == str(nodes):
            return
        assert time.monotonic() < deadline, done.stderr[-2000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_pair(model_repository, tmp_path_factory):
    """InferenceService and PredictionService processes over a fresh PostgreSQL database (ledger and
    CRM; the relay in PredictionService), and the Ray cluster; yields (pair, Ray address, the
    environment of its clients)."""
    ray = require_ray()
    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    with scratch_postgres(prefix="mlpair_test_ray") as url:
        p = pair(tmp_path_factory.mktemp("ray-pair"), model_repository, crm_url=url,
                 prediction_env={"PREDICTION_RELAY_BACKOFF_MAX_MS": "200",
                                 "PREDICTION_MAX_CHUNK_ROWS": str(MAX_CHUNK_ROWS)})
        p.start()
        try:
            with ray_cluster(ray) as (address, env):
                yield p, address, env
        finally:
            p.stop()


def applications(holdout, rows: int, seed: int = 23) -> pa.Table:
    """``rows`` holdout applicants drawn with replacement, each under a fresh key ``loan_id``."""
    records = holdout.records
    names = sorted({name for record in records for name in record})
    picks = np.random.default_rng(seed).integers(0, len(records), rows)
    columns = {"loan_id": pa.array([f"loan-{i:06d}" for i in range(rows)])}
    for name in names:
        columns[name] = pa.array([records[i].get(name) for i in picks])
    return pa.table(columns)


def counts(url: str, table: str) -> tuple[int, int]:
    async def fetch():
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return await conn.fetchrow(f"SELECT count(*) AS n, count(DISTINCT request_id) AS ids FROM {table}")
        finally:
            await conn.close()

    row = asyncio.run(fetch())
    return row["n"], row["ids"]


def score_on_ray(p, address: str, source: Path, output: Path, job_id: str, batch_rows: int) -> list[str]:
    return [sys.executable, "-m", "mlpair.cli", "score", "--engine", "ray", "--ray-address", address,
            "--target", p.prediction.address, "--input", str(source), "--key", "loan_id", "--model", "credit-risk",
            "--job-id", job_id, "--output", str(output), "--chunk-rows", str(batch_rows), "--ray-actors", "2"]


def test_a_ray_job_whose_driver_is_killed_halfway_and_run_again_decides_every_row_once(ray_pair, credit_holdout,
                                                                                        tmp_path):
    p, address, env = ray_pair
    url = p.crm_url
    source = tmp_path / "applications"
    source.mkdir()
    table = applications(credit_holdout, ROWS)
    for n, start in enumerate(range(0, ROWS, ROWS // 4)):  # four partitions
        pq.write_table(table.slice(start, ROWS // 4), source / f"part-{n}.parquet")
    output = tmp_path / "decisions"
    argv = score_on_ray(p, address, source, output, JOB_ID, BATCH_ROWS)

    # kill -9 of the driver once half the rows are in the ledger
    log = tmp_path / "first-run.log"
    with log.open("wb") as sink:
        first = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 90
    at_kill = 0
    while time.monotonic() < deadline and first.poll() is None:
        at_kill, _ = counts(url, "prediction.decision_ledger")
        if at_kill >= ROWS // 2:
            os.kill(first.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    assert first.wait(30) == -signal.SIGKILL, log.read_text(errors="replace")[-3000:]
    assert ROWS // 2 <= at_kill < ROWS

    second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert counts(url, "prediction.decision_ledger") == (ROWS, ROWS)

    decisions = pq.read_table(output)
    assert decisions.num_rows == ROWS
    assert sorted(decisions.column("loan_id").to_pylist()) == [f"loan-{i:06d}" for i in range(ROWS)]
    assert pc.count_distinct(decisions.column("request_id")).as_py() == ROWS
    assert decisions.column("error_code").null_count == ROWS
    assert set(decisions.column("decision").to_pylist()) <= {"APPROVE", "REVIEW", "DECLINE"}
    # what the killed run decided comes back replayed; only the rest is decided now
    replayed = pc.sum(decisions.column("replayed")).as_py()
    assert at_kill <= replayed < ROWS
    expected = f"job {JOB_ID}: {ROWS:,} rows ({ROWS - replayed:,} decided, {replayed:,} replayed, 0 failed) in {output}"
    assert any(line.startswith(expected) for line in second.stderr.splitlines()), second.stderr[-2000:]

    wait_until = time.monotonic() + 60  # the relay delivers the ledger to the CRM
    while counts(url, "decisions")[0] < ROWS and time.monotonic() < wait_until:
        time.sleep(0.2)
    assert counts(url, "decisions") == (ROWS, ROWS)


def test_a_batch_the_service_refuses_stops_the_ray_job_with_its_reason_and_decides_nothing(ray_pair, credit_holdout,
                                                                                          tmp_path):
    p, address, env = ray_pair
    source = tmp_path / "applications.parquet"
    pq.write_table(applications(credit_holdout, MAX_CHUNK_ROWS + 200, seed=5), source)
    before, _ = counts(p.crm_url, "prediction.decision_ledger")
    argv = score_on_ray(p, address, source, tmp_path / "decisions", "ray-refused", MAX_CHUNK_ROWS + 200)
    refused = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1, refused.stderr[-3000:]
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("mlpair score:")]
    assert line == ("mlpair score: job ray-refused stopped: job ray-refused on Ray: chunk refused (chunk starting at "
                    f"key 'loan-000000'): INVALID_ARGUMENT INVALID_REQUEST: a chunk may carry at most {MAX_CHUNK_ROWS} "
                    f"rows, got {MAX_CHUNK_ROWS + 200} [max_chunk_rows={MAX_CHUNK_ROWS}]; rerun with the same job id "
                    "to resume")
    assert counts(p.crm_url, "prediction.decision_ledger") == (before, before)
