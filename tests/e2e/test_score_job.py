"""``mlpair score`` against a real pair (processes, a PostgreSQL ledger, the relay to a PostgreSQL
CRM): a job killed with SIGKILL halfway and run again decides each row exactly once; bad input is
one clear line; a chunk the service refuses stops the job with its reason, and nothing is lost.

The input is the real credit-risk holdout resampled with fresh keys (rows repeat an applicant's
attributes under other keys, as a table of many applications would).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from mlpair.jobs.sources import asyncpg_dsn
from tests.support import POSTGRES_HOST, POSTGRES_PORT, require_service
from tests.support.pair import REPO, pair, scratch_postgres

pytestmark = pytest.mark.timeout(240)
ROWS = 20_000
CHUNK_ROWS = 500
MAX_CHUNK_ROWS = 1_000  # the service's PREDICTION_MAX_CHUNK_ROWS here


def applications(holdout, rows: int, seed: int = 11) -> pa.Table:
    """``rows`` holdout applicants drawn with replacement, each under a fresh key ``loan_id``."""
    records = holdout.records
    names = sorted({name for record in records for name in record})
    picks = np.random.default_rng(seed).integers(0, len(records), rows)
    columns = {"loan_id": pa.array([f"loan-{i:07d}" for i in range(rows)])}
    for name in names:
        columns[name] = pa.array([records[i].get(name) for i in picks])
    return pa.table(columns)


@pytest.fixture(scope="module")
def scored_pair(model_repository, tmp_path_factory):
    """InferenceService and PredictionService processes over a fresh PostgreSQL database (ledger and
    CRM; the relay in PredictionService)."""
    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    with scratch_postgres(prefix="mlpair_test_score") as url:
        p = pair(tmp_path_factory.mktemp("score-pair"), model_repository, crm_url=url,
                 prediction_env={"PREDICTION_MAX_CHUNK_ROWS": str(MAX_CHUNK_ROWS),
                                 "PREDICTION_RELAY_BACKOFF_MAX_MS": "200"})
        p.start()
        try:
            yield p
        finally:
            p.stop()


def score(target: str, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mlpair.cli", "score", "--target", target, "--state-dir", str(workdir / "jobs"),
            *extra]


def run_score(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def query(url: str, sql: str):
    async def fetch():
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    return asyncio.run(fetch())


def counts(url: str, table: str) -> tuple[int, int]:
    (row,) = query(url, f"SELECT count(*) AS n, count(DISTINCT request_id) AS ids FROM {table}")
    return row["n"], row["ids"]


def settled_count(url: str, table: str, quiet_s: float = 2.0, timeout_s: float = 30.0) -> int:
    """The row count of ``table`` once it has not changed for ``quiet_s``: a chunk the killed job had
    sent is still decided and committed by the service after the client is gone."""
    last, since = counts(url, table)[0], time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = counts(url, table)[0]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return last
    raise AssertionError(f"{table} still growing after {timeout_s} s")


def test_a_job_killed_halfway_and_run_again_decides_every_row_exactly_once(scored_pair, credit_holdout, tmp_path):
    url = scored_pair.crm_url
    source = tmp_path / "applications.parquet"
    pq.write_table(applications(credit_holdout, ROWS), source)
    output, metrics = tmp_path / "decisions.parquet", tmp_path / "job.prom"
    argv = score(scored_pair.prediction.address, tmp_path, "--input", str(source), "--key", "loan_id",
                 "--model", "credit-risk", "--output", str(output), "--chunk-rows", str(CHUNK_ROWS),
                 "--parallel", "1", "--metrics-file", str(metrics), "--deadline", "2999-01-01T00:00:00Z")
    chunks = ROWS // CHUNK_ROWS

    # kill -9 once a third of the chunks are recorded done
    first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    done = 0
    while time.monotonic() < deadline and first.poll() is None:
        states = list((tmp_path / "jobs").glob("*/state.json"))
        if states:
            try:
                done = len(json.loads(states[0].read_text())["chunks"])
            except (ValueError, OSError):
                done = 0
            if done >= chunks // 3:
                os.kill(first.pid, signal.SIGKILL)
                break
        time.sleep(0.005)
    assert first.wait(30) == -signal.SIGKILL, first.communicate()[1]
    (state_file,) = (tmp_path / "jobs").glob("*/state.json")
    killed = json.loads(state_file.read_text())
    done_rows = sum(c["rows"] for c in killed["chunks"].values())
    assert 0 < len(killed["chunks"]) < chunks and not output.exists()
    ledger_at_kill = settled_count(url, "prediction.decision_ledger")
    assert done_rows <= ledger_at_kill < ROWS

    second = run_score(argv)
    assert second.returncode == 0, second.stderr
    state = json.loads(state_file.read_text())
    total = {o: sum(c[o] for c in state["chunks"].values()) for o in ("decided", "replayed", "failed")}
    # the rows the killed run decided come back replayed (those of its unrecorded chunks) or sit in
    # its recorded chunks; the rest are decided now: together, every row once
    assert total["failed"] == 0
    assert total["decided"] + total["replayed"] == ROWS
    assert total["replayed"] == ledger_at_kill - done_rows
    assert counts(url, "prediction.decision_ledger") == (ROWS, ROWS)

    decisions = pq.read_table(output)
    job_id = state["job_id"]
    assert decisions.num_rows == ROWS
    assert decisions.column("loan_id").to_pylist() == [f"loan-{i:07d}" for i in range(ROWS)]
    assert decisions.column("request_id").to_pylist() == [f"{job_id}:loan-{i:07d}" for i in range(ROWS)]
    ledger = {r["request_id"]: r["decision_id"]
              for r in query(url, "SELECT request_id, decision_id FROM prediction.decision_ledger")}
    assert dict(zip(decisions.column("request_id").to_pylist(), decisions.column("decision_id").to_pylist(),
                    strict=True)) == ledger
    assert set(decisions.column("decision").to_pylist()) <= {"APPROVE", "REVIEW", "DECLINE"}

    wait_until = time.monotonic() + 60  # the relay delivers the ledger to the CRM
    while counts(url, "decisions")[0] < ROWS and time.monotonic() < wait_until:
        time.sleep(0.2)
    assert counts(url, "decisions") == (ROWS, ROWS)

    text = metrics.read_text()
    assert f'inference_job_finished{{job="{job_id}"}} 1.0' in text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values[f'inference_job_deadline_timestamp_seconds{{job="{job_id}"}}'] == 32472144000.0
    assert values[f'inference_job_rows_total{{job="{job_id}",outcome="decided"}}'] == total["decided"]

    status = run_score(score(scored_pair.prediction.address, tmp_path, "--status", job_id))
    assert status.returncode == 0 and "state: finished at" in status.stdout
    assert f"rows: {ROWS:,} of {ROWS:,}" in status.stdout

    again = run_score(argv)  # a finished job is not run again
    assert again.returncode == 0 and "finished at" in again.stderr
    assert counts(url, "prediction.decision_ledger") == (ROWS, ROWS)


def test_bad_input_is_one_line_naming_the_problem(scored_pair, credit_holdout, tmp_path):
    source = tmp_path / "applications.parquet"
    pq.write_table(applications(credit_holdout, 10), source)
    base = score(scored_pair.prediction.address, tmp_path, "--output", str(tmp_path / "out.parquet"))
    missing = run_score([*base, "--input", str(source), "--key", "application_id"])
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"mlpair: score: {source} has no column 'application_id' (--key); its columns: "
        + ", ".join(pq.read_schema(source).names)]
    garbage = tmp_path / "not.parquet"
    garbage.write_text("id,Income\n1,2\n")
    unreadable = run_score([*base, "--input", str(garbage), "--key", "id"])
    assert unreadable.returncode == 2 and len(unreadable.stderr.strip().splitlines()) == 1
    assert f"{garbage}: cannot be read as parquet" in unreadable.stderr
    absent = run_score([*base, "--input", str(tmp_path / "absent.csv"), "--key", "id"])
    assert absent.returncode == 2 and absent.stderr.strip() == f"mlpair: score: {tmp_path / 'absent.csv'}: no such file"


def test_a_refused_chunk_stops_the_job_with_its_reason_and_a_rerun_finishes_it(scored_pair, credit_holdout, tmp_path):
    """Chunks over the service's row limit are refused whole; the rerun with smaller chunks decides
    every row once. A row's own error (a value no conversion reads) fails that row alone, in CSV."""
    url = scored_pair.crm_url
    table = applications(credit_holdout, 2_400, seed=5)
    income = table.column("Income").cast(pa.string()).to_pylist()
    income[7] = "a lot"
    table = table.set_column(table.schema.get_field_index("Income"), "Income", pa.array(income))
    source = tmp_path / "applications.csv"
    pacsv.write_csv(table, source)
    output = tmp_path / "decisions.csv"
    argv = score(scored_pair.prediction.address, tmp_path, "--input", str(source), "--key", "loan_id",
                 "--output", str(output))
    before, _ = counts(url, "prediction.decision_ledger")

    refused = run_score([*argv, "--chunk-rows", str(MAX_CHUNK_ROWS + 200)])
    assert refused.returncode == 1 and not output.exists()
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("mlpair score:")]
    assert "chunk 0 (rows 0-1,199) chunk refused" in line and "INVALID_ARGUMENT" in line
    assert f"max_chunk_rows={MAX_CHUNK_ROWS}" in line and "rerun" in line
    assert counts(url, "prediction.decision_ledger")[0] == before  # nothing of it decided

    finished = run_score([*argv, "--chunk-rows", "800"])
    assert finished.returncode == 0, finished.stderr
    decisions = pacsv.read_csv(output, convert_options=pacsv.ConvertOptions(strings_can_be_null=True))
    assert decisions.num_rows == 2_400
    errors = decisions.column("error_code").to_pylist()
    assert [i for i, e in enumerate(errors) if e is not None] == [7]
    assert "Income" in decisions.column("error_message")[7].as_py()
    assert decisions.column("decision")[7].as_py() is None
    assert counts(url, "prediction.decision_ledger")[0] == before + 2_399


def test_a_query_is_scored_into_a_table_and_assembling_again_replaces_the_jobs_rows(scored_pair, credit_holdout,
                                                                                      tmp_path):
    url = scored_pair.crm_url
    table = applications(credit_holdout, 1_500, seed=3)
    names = [n for n in table.column_names if n != "loan_id"]
    kinds = {n: "text" if pa.types.is_string(table.schema.field(n).type) else "double precision" for n in names}

    async def load():
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await conn.execute("CREATE TABLE applications (loan_id text PRIMARY KEY, "
                               + ", ".join(f'"{n}" {k}' for n, k in kinds.items()) + ")")
            await conn.copy_records_to_table("applications", records=list(zip(*(
                table.column(n).to_pylist() for n in table.column_names), strict=True)), columns=table.column_names)
        finally:
            await conn.close()

    asyncio.run(load())
    dsn = asyncpg_dsn(url)
    argv = score(scored_pair.prediction.address, tmp_path, "--query", "SELECT * FROM applications", "--database-url",
                 dsn, "--key", "loan_id", "--output-table", "job_decisions", "--chunk-rows", "400",
                 "--job-id", "nightly-1")
    for _ in range(2):  # the second run finds the job finished and writes its rows again, in place
        done = run_score(argv)
        assert done.returncode == 0, done.stderr
        rows = query(url, "SELECT job_id, loan_id, request_id, decision, error_code FROM job_decisions")
        assert len(rows) == 1_500 and {r["job_id"] for r in rows} == {"nightly-1"}
        assert {r["request_id"] for r in rows} == {f"nightly-1:{k}" for k in table.column("loan_id").to_pylist()}
        assert all(r["error_code"] is None and r["decision"] for r in rows)
    ids = {r["request_id"] for r in query(url, "SELECT request_id FROM prediction.decision_ledger "
                                               "WHERE request_id LIKE 'nightly-1:%'")}
    assert len(ids) == 1_500


def job_line(stderr: str) -> str:
    """The job id the command printed first (``job ID: input (N rows) -> output``)."""
    return next(line for line in stderr.splitlines() if line.startswith("job ")).split(":")[0].removeprefix("job ")


def test_a_repeated_key_is_refused_before_anything_is_sent_and_the_fixed_file_is_the_same_job(
        scored_pair, credit_holdout, tmp_path):
    """Keys repeated within chunk 0 and across chunks: exit 2 naming them and their rows, nothing
    decided, no job state. The fixed file (another size and mtime) is the same job; a column the
    schema does not know is one warning for the job, and the key column none; the finished job
    written to another output needs no service; a file replaced by other rows is refused."""
    url = scored_pair.crm_url
    table = applications(credit_holdout, 1_200, seed=9).append_column("Incme", pa.array([1.0] * 1_200))
    keys = table.column("loan_id").to_pylist()
    bad = list(keys)
    bad[5] = bad[2]  # in chunk 0
    bad[1_000] = bad[10]  # across chunks
    source = tmp_path / "applications.parquet"
    pq.write_table(table.set_column(0, "loan_id", pa.array(bad)), source)
    output = tmp_path / "decisions.parquet"
    argv = score(scored_pair.prediction.address, tmp_path, "--input", str(source), "--key", "loan_id",
                 "--output", str(output), "--chunk-rows", "400", "--parallel", "2")
    before, _ = counts(url, "prediction.decision_ledger")

    refused = run_score(argv)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"mlpair: score: {source}: --key loan_id repeats 2 key(s): '{keys[2]}' in rows 2, 5; '{keys[10]}' in rows "
        "10, 1000: each row needs a key of its own (two rows would share a request id); nothing was sent: fix the "
        "input and rerun")
    assert counts(url, "prediction.decision_ledger")[0] == before and not (tmp_path / "jobs").exists()

    time.sleep(0.01)
    pq.write_table(table, source)  # fixed
    done = run_score(argv)
    assert done.returncode == 0, done.stderr
    job_id = job_line(done.stderr)
    assert job_id == job_line(refused.stderr)
    assert counts(url, "prediction.decision_ledger")[0] == before + 1_200
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "UNKNOWN_ATTRIBUTE Incme" in warnings[0], done.stderr
    status = run_score(score(scored_pair.prediction.address, tmp_path, "--status", job_id))
    assert "warning: UNKNOWN_ATTRIBUTE Incme" in status.stdout

    # the finished job to another output: nothing left to send, so no PredictionService is needed
    elsewhere = tmp_path / "again.csv"
    offline = run_score([a if a != str(output) else str(elsewhere) for a in
                         score("127.0.0.1:9", tmp_path, *argv[argv.index("--state-dir") + 2:], "--wait-s", "5")])
    assert offline.returncode == 0, offline.stderr
    assert pacsv.read_csv(elsewhere).num_rows == 1_200

    # a file replaced by other rows under the same path: refused, told to give it its own --job-id
    pq.write_table(applications(credit_holdout, 1_200, seed=1).set_column(
        0, "loan_id", pa.array([f"other-{i}" for i in range(1_200)])), source)
    changed = run_score(argv)
    assert changed.returncode == 1 and "the input changed since job" in changed.stderr
    assert "--job-id" in changed.stderr
    assert counts(url, "prediction.decision_ledger")[0] == before + 1_200


def test_a_querys_null_and_repeated_keys_are_found_in_postgresql_before_anything_is_sent():
    from mlpair.jobs.keys import check_keys
    from mlpair.jobs.sources import InputError, open_source

    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    url = f"postgresql://postgres@{POSTGRES_HOST}:{POSTGRES_PORT}/postgres"
    rows = "('a', 1.0), ('b', 2.0), ('a', 3.0), ('c', 4.0), ('c', 5.0)"
    repeated = open_source(None, f"SELECT * FROM (VALUES {rows}) AS t(id, x)", url, "id", None)
    with pytest.raises(InputError, match=r"^query: --key id repeats 2 key\(s\): 'a' in rows 0, 1; 'c' in rows 3, 4"):
        check_keys(repeated, "id", None)
    null = open_source(None, "SELECT * FROM (VALUES ('a', 1.0), (NULL, 2.0)) AS t(id, x)", url, "id", None)
    with pytest.raises(InputError, match=r"--key id is null in 1 row\(s\)"):
        check_keys(null, "id", None)
    assert check_keys(open_source(None, "SELECT 'a' AS id, 1.0 AS x", url, "id", None), "id", None).rows == 1
