"""A job's request ids and chunks, without a service: deterministic, unique, within the id limit."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest

from mlpair.jobs.chunks import MAX_REQUEST_ID_CHARS, request_chunk, request_id_for, request_ids


def test_request_ids_are_the_job_and_the_key_or_a_digest_of_a_long_or_control_key():
    keys = pa.array(["a-1", "x" * 200, "tab\there", "é"])
    ids = request_ids("nightly", keys).to_pylist()
    assert ids[0] == "nightly:a-1"
    assert ids[1] == "nightly:" + hashlib.sha256(b"x" * 200).hexdigest()[:32]
    assert ids[2] == "nightly:" + hashlib.sha256(b"tab\there").hexdigest()[:32]
    assert ids[3] == "nightly:é"
    assert ids == [request_id_for("nightly", k) for k in keys.to_pylist()]
    assert all(len(i) <= MAX_REQUEST_ID_CHARS for i in ids)
    # the same job and keys give the same ids in another run; another job, other ids
    assert request_ids("nightly", keys).to_pylist() == ids
    assert set(request_ids("weekly", keys).to_pylist()).isdisjoint(ids)


def test_integer_keys_are_their_decimal_text():
    assert request_ids("j", pa.chunked_array([[7, 12], [30]])).to_pylist() == ["j:7", "j:12", "j:30"]


@pytest.mark.parametrize(
    ("keys", "words"), [(pa.array(["a", None]), "null"), (pa.array(["a", "b", "a"]), "repeats a key")]
)
def test_a_null_or_repeated_key_is_refused(keys, words):
    with pytest.raises(ValueError, match=words):
        request_ids("j", keys)


@pytest.mark.parametrize("job_id", ["", "a\nb", "j" * 100])
def test_a_job_id_that_cannot_prefix_ids_is_refused(job_id):
    with pytest.raises(ValueError, match="job id"):
        request_ids(job_id, pa.array(["k"]))


def test_a_chunk_carries_ids_entities_and_the_attributes_only():
    table = pa.table({"loan": [1, 2], "customer": ["c1", "c2"], "Income": [100.0, None], "Home": ["rent", "own"]})
    chunk = request_chunk(table, job_id="j", key_column="loan", entity_column="customer")
    assert chunk.column_names == ["request_id", "entity_id", "Income", "Home"]
    assert chunk.column("request_id").to_pylist() == ["j:1", "j:2"]
    assert chunk.column("entity_id").to_pylist() == ["c1", "c2"]
    by_key = request_chunk(table, job_id="j", key_column="loan", entity_column=None)
    assert by_key.column("entity_id").to_pylist() == ["1", "2"]
    assert by_key.column_names == ["request_id", "entity_id", "customer", "Income", "Home"]


def test_a_missing_key_column_is_named():
    with pytest.raises(KeyError, match="'loan_id'"):
        request_chunk(pa.table({"loan": [1]}), job_id="j", key_column="loan_id")
