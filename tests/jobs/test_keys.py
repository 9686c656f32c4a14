"""A job's keys checked whole before anything is sent (a null or a repeat anywhere in the input is one
line naming the keys and rows), its default id across a fixed file, its status once a run ended."""

from __future__ import annotations

import os
import pickle

import grpc
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from mlpair.client.tables import ChunkError
from mlpair.jobs.chunks import ChunkRefused, RowsNotDecided
from mlpair.jobs.keys import check_keys
from mlpair.jobs.sources import InputError, default_job_id, open_source
from mlpair.jobs.state import ChunkRecord, JobState


def write(path, table):
    (pq.write_table if path.suffix == ".parquet" else pacsv.write_csv)(table, path)
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_keys_repeated_in_one_chunk_or_across_chunks_are_named_with_their_rows(tmp_path, suffix):
    keys = [f"loan-{i}" for i in range(25_000)]
    keys[3] = keys[1]  # in one chunk of 10,000
    keys[15_000] = keys[20_000] = keys[2]  # in three chunks
    path = write(tmp_path / f"in{suffix}", pa.table({"loan_id": keys, "Income": [1.0] * len(keys)}))
    with pytest.raises(InputError) as refused:
        check_keys(open_source(str(path), None, None, "loan_id", None), "loan_id", None)
    assert str(refused.value) == (
        f"{path}: --key loan_id repeats 2 key(s): 'loan-1' in rows 1, 3; 'loan-2' in rows 2, 15000, 20000: each row "
        "needs a key of its own (two rows would share a request id); nothing was sent: fix the input and rerun")


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_null_key_or_entity_is_named_with_its_rows(tmp_path, suffix):
    # CSV: pyarrow's null strings ("n/a", "NA", "null", …) are missing values, a key's too
    keys = ["a", None, "b", "c"] if suffix == ".parquet" else ["a", "", "b", "n/a"]
    path = write(tmp_path / f"in{suffix}", pa.table({"id": keys, "customer": ["x", "y", None, "z"]}))
    source = open_source(str(path), None, None, "id", "customer")
    rows = "row 1" if suffix == ".parquet" else "rows 1, 3"
    with pytest.raises(InputError, match=f"--key id is null in {1 if suffix == '.parquet' else 2} row\\(s\\) "
                                         f"\\({rows}\\)"):
        check_keys(source, "id", "customer")
    ok = write(tmp_path / f"ok{suffix}", pa.table({"id": ["a", "b", "c"], "customer": ["x", None, "z"]}))
    with pytest.raises(InputError, match=r"--entity-column customer is null in 1 row\(s\) \(row 1\)"):
        check_keys(open_source(str(ok), None, None, "id", "customer"), "id", "customer")


def test_checked_keys_give_each_chunks_rows_and_bounds(tmp_path):
    path = write(tmp_path / "in.csv", pa.table({"id": [f"k{i}" for i in range(25)], "x": list(range(25))}))
    keys = check_keys(open_source(str(path), None, None, "id", None), "id", None)
    assert keys.rows == 25
    assert keys.chunk_bounds(0, 10) == (10, "k0", "k9") and keys.chunk_bounds(2, 10) == (5, "k20", "k24")
    assert keys.chunk_bounds(3, 10) is None


def test_the_default_job_id_survives_fixing_the_file_but_not_another_model_or_key(tmp_path):
    path = write(tmp_path / "applications.parquet", pa.table({"id": ["a", "a"], "x": [1, 2]}))
    before = default_job_id(open_source(str(path), None, None, "id", None), "credit-risk", "id", None)
    write(path, pa.table({"id": ["a", "b"], "x": [1, 2]}))  # fixed: another size and mtime
    os.utime(path, (1, 1))
    fixed = open_source(str(path), None, None, "id", None)
    assert default_job_id(fixed, "credit-risk", "id", None) == before
    assert before.startswith("applications-")
    assert default_job_id(fixed, "churn", "id", None) != before
    assert default_job_id(fixed, "credit-risk", "x", None) != before


def test_refusals_and_undecided_rows_cross_processes_whole():
    refused = ChunkRefused(ChunkError(grpc.StatusCode.INVALID_ARGUMENT, "too many", "INVALID_REQUEST",
                                      {"max_chunk_rows": "1000"}), "loan-1")
    again = pickle.loads(pickle.dumps(refused))
    assert type(again) is ChunkRefused and str(again) == str(refused)
    assert (again.error, again.first_key) == (refused.error, "loan-1")
    rows = pickle.loads(pickle.dumps(RowsNotDecided(3, "UNAVAILABLE", "CIRCUIT_OPEN")))
    assert rows.code() is grpc.StatusCode.UNAVAILABLE and (rows.rows, rows.reason) == (3, "CIRCUIT_OPEN")


def stopped_state() -> JobState:
    state = JobState("j", "in", "credit-risk", "id", None, 100, 1_000, True, "out", started_at=1_000.0,
                     run_started_at=1_000.0, run_rows=200, runs=1, run_ended_at=1_010.0, deadline=5_000.0,
                     stopped="chunk 2 refused")
    for n in range(2):
        state.chunks[str(n)] = ChunkRecord(rows=100, decided=100, replayed=0, failed=0, first_key="a", last_key="b")
    return state


def test_a_stopped_job_counts_its_rate_and_duration_to_its_end_and_has_no_estimate():
    state = stopped_state()
    later = 100_000.0
    assert state.rate(later) == 20.0 and state.duration(later) == 10.0
    assert state.estimated_completion(later) is None
    lines = state.status_lines(later)
    assert "rows/s: 20 (run 1)" in lines and any(line.endswith("duration: 10 s") for line in lines)
    assert "estimated completion: none (stopped: rerun the same command to resume)" in lines
    state.stopped, state.finished_at = "", 1_010.0
    assert state.rate(later) == 20.0 and state.duration(later) == 10.0
    assert state.estimated_completion(later) == 1_010.0


def test_a_stopped_job_reports_when_it_stopped_as_its_estimate_so_the_deadline_alert_can_fire(tmp_path):
    from mlpair.jobs.metrics import JobMetrics

    path = tmp_path / "job.prom"
    JobMetrics(stopped_state(), path, None).report()
    text = path.read_text()
    assert 'inference_job_estimated_completion_timestamp_seconds{job="j"} 1010.0' in text
    assert 'inference_job_duration_seconds{job="j"} 10.0' in text
    assert 'inference_job_rows_per_second{job="j"} 20.0' in text
