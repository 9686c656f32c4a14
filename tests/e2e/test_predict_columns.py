"""PredictColumns against real servers and a PostgreSQL ledger and CRM: a table decided exactly as
the same rows sent as BatchPredict items (bit-identical probabilities), per-row errors, replays and
refusals with exact counts, chunks refused as a whole while the stream goes on."""

from __future__ import annotations

import asyncio
import math

import asyncpg
import pyarrow as pa
import pytest
from google.rpc import code_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import predict_request
from mlpair.client.tables import DECISION_SCHEMA, ChunkResult, chunk_result, request_chunks, to_ipc
from mlpair.prediction.recording.models import LEDGER_SCHEMA, LEDGER_TABLE
from tests.e2e.conftest import prediction_service

MAX_CHUNK_ROWS = 500


@pytest.fixture(scope="module")
async def prediction(inference_server, model_repository, tmp_path_factory, postgres_url):
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("crm"),
                                  ledger_url=postgres_url, crm_url=postgres_url,
                                  max_batch_items=1000, max_chunk_rows=MAX_CHUNK_ROWS) as served:
        yield served


def item(request_id: str, entity_id: str, attributes: dict) -> pb.PredictRequest:
    return predict_request("credit-risk", entity_id, attributes, request_id)


def table(ids: list[str], records: list[dict], entity_ids: list[str] | None = None) -> pa.Table:
    """A request chunk: ``request_id``, ``entity_id`` and the records' attributes as columns."""
    columns = {"request_id": ids, "entity_id": entity_ids or [f"e-{i}" for i in ids]}
    names = list(dict.fromkeys(name for r in records for name in r))
    for name in names:
        columns[name] = [r.get(name) for r in records]
    return pa.table(columns)


async def decide(stub, *chunks: pa.Table | bytes, model_name: str = "credit-risk") -> list[ChunkResult]:
    """Each chunk's result, through one PredictColumns stream (bytes are sent as they are)."""
    def requests():
        for n, chunk in enumerate(chunks):
            if isinstance(chunk, bytes):
                yield pb.PredictColumnsRequest(model_name=model_name, arrow_ipc=chunk, chunk_id=n)
            else:
                yield from request_chunks([chunk], model_name, first_chunk_id=n)

    return [chunk_result(reply) async for reply in stub.PredictColumns(requests())]


async def rows_on_record(postgres_url: str, prefix: str) -> tuple[int, int]:
    """(ledger rows, CRM rows) whose request id starts with ``prefix``."""
    conn = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        ledger = await conn.fetchval(f"SELECT count(*) FROM {LEDGER_SCHEMA}.{LEDGER_TABLE} WHERE request_id LIKE $1", prefix + "%")
        crm = await conn.fetchval("SELECT count(*) FROM decisions WHERE request_id LIKE $1", prefix + "%")
        return ledger, crm
    finally:
        await conn.close()


def edge_records(credit_holdout) -> list[dict]:
    """Rows that fire guards, miss values, carry an unknown category or cannot be converted."""
    r = credit_holdout.records
    return [
        {**r[1], "Income": 99999999.0, "Age": None},          # clamped, missing
        {**r[2], "Home": "castle", "Job": ""},                # unknown category, empty string
        {**r[3], "Income": math.inf},                         # an infinity, as a Predict's number
        {**r[4], "Income": math.nan},                         # NaN: missing
        r[5],                                                 # sent without an entity id: this row fails
    ]


async def test_a_table_is_decided_as_the_same_batch_predict_items(prediction, credit_holdout, postgres_url):
    stub, predictor = prediction
    records = list(credit_holdout.records[:300]) + edge_records(credit_holdout)
    ids = [f"cols-parity-{i}" for i in range(len(records))]
    entities = [f"e{i}" for i in range(len(records) - 1)] + [None]
    [result] = await decide(stub, table(ids, records, entities))
    assert result.error is None
    decisions = result.decisions
    assert decisions.schema == DECISION_SCHEMA and decisions.num_rows == len(records)
    assert decisions.column("request_id").to_pylist() == ids

    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
        item(f"batch-parity-{i}", e or "", r) for i, (r, e) in enumerate(zip(records, entities))]))
    rows = decisions.to_pylist()
    failed = 0
    for row, single in zip(rows, reply.results):
        if single.WhichOneof("outcome") == "error":
            failed += 1
            assert row["error_code"] == code_pb2.Code.Name(single.error.code)
            assert row["decision_id"] is None and row["probability"] is None
            continue
        p = single.prediction
        assert row["error_code"] is None
        assert (row["decision"], row["probability"], row["reason_codes"], row["model_version"]) \
            == (p.decision_label, p.probability, list(p.reason_codes), p.model_version)
        assert row["served_from"] == "inference" and not p.from_cache  # a table's rows never fill the cache
    assert failed == 1 and result.failed == 1
    assert result.decided == len(records) - 1 and result.replayed == 0
    assert {"APPROVE", "DECLINE", "REVIEW"} <= set(decisions.column("decision").to_pylist())
    assert any(codes and any(c.endswith("_CLAMPED_MAX") for c in codes) for codes in decisions.column("reason_codes").to_pylist())
    await predictor.recorder.wait_delivered(20)
    assert await rows_on_record(postgres_url, "cols-parity-") == (len(records) - 1, len(records) - 1)


async def test_request_ids_replay_across_chunks_and_apis_and_refuse_another_payload(prediction, credit_holdout,
                                                                                    postgres_url):
    stub, predictor = prediction
    records = list(credit_holdout.records[20:120])
    ids = [f"cols-replay-{i}" for i in range(len(records))]
    [first] = await decide(stub, table(ids, records))
    changed = [dict(r) for r in records]
    for r in changed[:10]:
        r["Income"] = (r["Income"] or 0) + 1.0
    [again, other] = await decide(stub, table(ids, records), table(ids, changed))
    assert (again.decided, again.replayed, again.failed) == (0, len(records), 0)
    assert again.decisions.column("replayed").to_pylist() == [True] * len(records)
    for name in ("decision_id", "probability", "decision", "reason_codes", "decided_at"):
        assert again.decisions.column(name) == first.decisions.column(name)
    assert (other.decided, other.replayed, other.failed) == (0, len(records) - 10, 10)
    assert other.decisions.column("error_reason").to_pylist()[:10] == ["IDEMPOTENCY_KEY_REUSED"] * 10

    # a BatchPredict item under a table row's request id, with its values: the table's decision
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[item(ids[0], f"e-{ids[0]}", records[0])]))
    p = reply.results[0].prediction
    assert p.replayed and p.decision_id == first.decisions.column("decision_id")[0].as_py()
    assert p.probability == first.decisions.column("probability")[0].as_py()
    await predictor.recorder.wait_delivered(20)
    assert await rows_on_record(postgres_url, "cols-replay-") == (len(records), len(records))


async def test_bad_chunks_are_refused_whole_and_bad_rows_alone_while_the_stream_goes_on(prediction, credit_holdout,
                                                                                         postgres_url):
    stub, predictor = prediction
    r = credit_holdout.records
    good = table(["cols-bad-a0", "cols-bad-a1"], [r[30], r[31]])
    no_entity = table(["cols-bad-b0"], [r[32]]).drop_columns(["entity_id"])
    numeric_ids = pa.table({"request_id": [1, 2], "entity_id": ["x", "y"]})
    oversize = table([f"cols-bad-c{i}" for i in range(MAX_CHUNK_ROWS + 1)], [r[33]] * (MAX_CHUNK_ROWS + 1))
    stamps = table(["cols-bad-d0", "cols-bad-d1"], [r[34], r[35]]).append_column(
        "Age_when", pa.array([None, 1_600_000_000], type=pa.timestamp("s")))
    mistyped = table(["cols-bad-e0", "cols-bad-e1"], [r[36], r[37]])
    mistyped = mistyped.set_column(mistyped.column_names.index("Age"), "Age",
                                   pa.array([None, 1_600_000_000], type=pa.timestamp("s")))
    duplicated = table(["cols-bad-f0", "cols-bad-f1", "cols-bad-f0"], [r[38], r[39], r[40]])
    texts = table(["cols-bad-g0", "cols-bad-g1"], [{**r[41], "Age": "30"}, {**r[42], "Age": "thirty"}])
    results = await decide(stub, good, no_entity, numeric_ids, oversize, b"not arrow", stamps, mistyped, duplicated,
                           texts)
    assert [x.chunk_id for x in results] == list(range(9))
    assert results[0].decided == 2
    for refused, metadata in zip(results[1:5], [{"column": "entity_id"}, {"column": "request_id"},
                                                {"max_chunk_rows": str(MAX_CHUNK_ROWS)}, {"field": "arrow_ipc"}]):
        assert refused.decisions is None and refused.error.reason == "INVALID_REQUEST"
        assert refused.error.metadata == metadata
    unknown = results[5]
    assert (unknown.decided, unknown.failed) == (2, 0)        # a column the schema does not know: ignored
    assert unknown.warnings[0][:2] == ("UNKNOWN_ATTRIBUTE", "Age_when")
    assert (results[6].decided, results[6].failed) == (1, 1)  # a timestamp where Age is a number
    assert "Age" in results[6].decisions.column("error_message")[1].as_py()
    dup = results[7].decisions
    assert dup.column("error_code").to_pylist() == [None, None, "INVALID_ARGUMENT"]
    assert results[8].decisions.column("error_code").to_pylist() == [None, "INVALID_ARGUMENT"]  # "30" is read
    assert "Age" in results[8].decisions.column("error_message")[1].as_py()
    await predictor.recorder.wait_delivered(20)
    assert await rows_on_record(postgres_url, "cols-bad-") == (8, 8)


async def test_an_unknown_family_refuses_the_chunk(prediction, credit_holdout):
    stub, _ = prediction
    [result] = await decide(stub, table(["cols-fam-0"], [credit_holdout.records[0]]), model_name="fraud")
    assert result.error is not None and result.error.reason == "UNKNOWN_MODEL"


def test_decision_chunks_read_back_the_same():
    chunk = pa.table({"request_id": ["a"], "entity_id": ["b"], "Income": [1.0]})
    request = next(request_chunks([chunk], "credit-risk", 7))
    assert request.chunk_id == 7 and request.arrow_ipc == to_ipc(chunk)


async def test_rows_inference_cannot_score_now_fail_alone_unrecorded_and_a_job_retries_them(
        model_repository, credit_holdout, tmp_path, postgres_url):
    """No fallback decision for a table's rows: with InferenceService down each row fails
    UNAVAILABLE (nothing recorded, so sending it again decides it), and a job's chunk raises
    RowsNotDecided, the retryable error its retries and reruns handle."""
    from mlpair.client import PredictionClient
    from mlpair.jobs.chunks import RowsNotDecided, decide_chunk
    from tests.e2e.conftest import prediction_server
    from tests.support.pair import free_port

    records = list(credit_holdout.records[50:60])
    ids = [f"cols-down-{i}" for i in range(len(records))]
    async with prediction_server(f"127.0.0.1:{free_port()}", model_repository, tmp_path, ledger_url=postgres_url,
                                 crm_url=postgres_url, inference_timeout_ms=200) as (target, predictor):
        import grpc

        from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
        async with grpc.aio.insecure_channel(target) as channel:
            [result] = await decide(pb_grpc.PredictionServiceStub(channel), table(ids, records))
        assert (result.decided, result.replayed, result.failed) == (0, 0, len(records))
        assert set(result.decisions.column("error_code").to_pylist()) == {"UNAVAILABLE"}
        assert result.decisions.column("decision_id").null_count == len(records)

        keyed = pa.table({"loan": [f"down-{i}" for i in range(len(records))],
                          **{name: [r.get(name) for r in records] for name in records[0]}})
        with PredictionClient(target) as client, pytest.raises(RowsNotDecided) as raised:
            await asyncio.to_thread(decide_chunk, client, keyed, job_id="cols-down-job", key_column="loan",
                                    entity_column=None, model_name="credit-risk")
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and raised.value.rows == len(records)
        await predictor.recorder.wait_delivered(10)
    assert await rows_on_record(postgres_url, "cols-down-") == (0, 0)


class ArrowStream:
    """A table as Polars or DuckDB hands one over: only ``__arrow_c_stream__``."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def __arrow_c_stream__(self, requested_schema=None):
        return self._table.__arrow_c_stream__(requested_schema)


async def test_the_clients_take_the_tables_data_teams_hold_and_name_any_other_type_before_the_stream(
        inference_server, model_repository, credit_holdout, tmp_path, postgres_url):
    """pandas DataFrames (whole, sliced with their index, through ``slices``) and an Arrow stream
    are decided as tables, the index never sent; a chunk of another type is a TypeError naming it,
    raised by the call before any stream, or, later in the stream, after the chunks before it."""
    pytest.importorskip("pandas")

    from mlpair.client import AsyncPredictionClient, PredictionClient
    from mlpair.client.tables import slices
    from tests.e2e.conftest import prediction_server

    records = list(credit_holdout.records[200:260])
    frame = table([f"cols-pd-{i}" for i in range(len(records))], records).to_pandas()
    frame.index = frame.index + 1_000  # an index of its own: not a column to send
    async with prediction_server(inference_server, model_repository, tmp_path, ledger_url=postgres_url,
                                 crm_url=postgres_url) as (target, predictor):
        def blocking() -> tuple[list[ChunkResult], list[ChunkResult], list[ChunkResult]]:
            with PredictionClient(target) as client:
                sliced = list(client.predict_columns([frame.iloc[:20], frame.iloc[20:40]], "credit-risk"))
                cut = list(client.predict_columns(slices(frame, 25), "credit-risk"))
                stream = list(client.predict_columns([ArrowStream(pa.Table.from_pandas(frame.iloc[40:]))],
                                                     "credit-risk"))
                with pytest.raises(TypeError, match=r"chunk 0 is a dict: expected a pyarrow Table"):
                    client.predict_columns([records[0]], "credit-risk")  # raised by the call itself
                with pytest.raises(TypeError, match=r"got one DataFrame: cut it with"):
                    client.predict_columns(frame, "credit-risk")
                answered = client.predict_columns([frame.iloc[:5], "not a table"], "credit-risk")
                assert next(answered).replayed == 5
                with pytest.raises(TypeError, match=r"chunk 1 is a str"):
                    next(answered)
                return sliced, cut, stream

        sliced, cut, stream = await asyncio.to_thread(blocking)
        outcomes = [[(r.decided, r.replayed, r.failed) for r in results] for results in (sliced, cut, stream)]
        assert outcomes == [[(20, 0, 0), (20, 0, 0)], [(0, 25, 0), (10, 15, 0), (10, 0, 0)], [(0, 20, 0)]]
        assert not any(r.warnings for r in sliced + cut + stream)  # the index was not sent as a column
        assert sliced[0].decisions.column("request_id").to_pylist() == list(frame["request_id"][:20])

        async with AsyncPredictionClient(target) as client:
            with pytest.raises(TypeError, match=r"chunk 0 is a list"):
                client.predict_columns([[1, 2]], "credit-risk")
            results = [r async for r in client.predict_columns([frame.iloc[:30]], "credit-risk")]
            assert [(r.replayed, r.decisions.num_rows) for r in results] == [(30, 30)]
        await predictor.recorder.wait_delivered(20)
    assert await rows_on_record(postgres_url, "cols-pd-") == (len(records), len(records))


async def test_a_row_whose_model_output_is_unusable_gets_the_recorded_fallback_alone_as_in_batch_predict(
        nonfinite_repository, credit_holdout, tmp_path, postgres_url):
    """The model gives NaN logits for applicants of 95+ (tests.nonfinite): in a table, such a row gets
    the policy's fallback (REVIEW, MODEL_OUTPUT_INVALID, no probability), recorded, as a
    BatchPredict item does, and every other row of the chunk is decided as if sent alone."""
    import grpc

    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from tests.e2e.conftest import inference_service, prediction_server

    records = [dict(r) for r in credit_holdout.records[60:70]]
    for r in records[:3]:
        r["Age"] = 96.0
    ids = [f"cols-nan-{i}" for i in range(len(records))]
    async with inference_service(nonfinite_repository) as inference_target, \
            prediction_server(inference_target, nonfinite_repository, tmp_path, ledger_url=postgres_url,
                              crm_url=postgres_url, cache_backend="off") as (target, components):
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.PredictionServiceStub(channel)
            [result] = await decide(stub, table(ids, records))
            reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[
                item(f"batch-nan-{i}", f"e-{rid}", r) for i, (rid, r) in enumerate(zip(ids, records))]))
        await components.recorder.wait_delivered(20)
    rows = result.decisions.to_pylist()
    assert (result.decided, result.failed) == (len(records), 0)
    for row in rows[:3]:
        assert (row["decision"], row["probability"], row["served_from"]) == ("REVIEW", None, "fallback")
        assert row["reason_codes"][0] == "MODEL_OUTPUT_INVALID"
    assert all(row["served_from"] == "inference" and 0.0 < row["probability"] < 1.0 for row in rows[3:])
    for row, single in zip(rows, reply.results):
        p = single.prediction
        assert (row["decision"], row["reason_codes"], row["probability"] or 0.0) == \
            (p.decision_label, list(p.reason_codes), p.probability)
    assert await rows_on_record(postgres_url, "cols-nan-") == (len(records), len(records))
