"""The decision record holds what the decision was based on (issue 40, part 4): a decision's stored
audit record equals what was sent and what the model saw, personal data never stored raw;
`mlpair decision REQUEST_ID` shows it."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.commands.decision import decision_record
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.prediction.recording.audit import AuditRecords, read_record
from tests.e2e.conftest import prediction_service
from tests.support.ledger import mlpair_cli, opened_ledger

KEY = "a-test-hmac-key-of-32-characters"


@pytest.fixture(scope="module")
async def hashing(inference_server, model_repository, tmp_path_factory):
    """PredictionService keeping audit records with personal data as keyed hashes."""
    folder = tmp_path_factory.mktemp("audit-hash")
    async with prediction_service(inference_server, model_repository, folder, audit_personal_data="hash",
                                  audit_hash_key=KEY) as served:
        yield served, f"sqlite+aiosqlite:///{folder / 'ledger.sqlite'}"


@pytest.fixture(scope="module")
async def dropping(inference_server, model_repository, tmp_path_factory):
    """PredictionService with the default: personal data left out of audit records."""
    folder = tmp_path_factory.mktemp("audit-drop")
    async with prediction_service(inference_server, model_repository, folder) as served:
        yield served, f"sqlite+aiosqlite:///{folder / 'ledger.sqlite'}"


async def test_the_stored_record_is_what_was_sent_and_what_the_model_saw(hashing, credit_entry, credit_holdout):
    (stub, _), ledger_url = hashing
    schema = credit_entry.preprocessing.feature_schema
    sent = dict(credit_holdout.records[5])
    sent.pop("Seniority")  # a guard fires: the missing attribute takes its default
    reply = await stub.Predict(pb.PredictRequest(request_id="audit-1", entity_id="e-1", attributes=to_attributes(sent),
                                                 explain=True), timeout=30)
    found = await decision_record(ledger_url, "audit-1")
    assert found is not None and found["decision_id"] == reply.decision_id
    assert (found["decision"], found["probability"]) == (reply.decision_label, pytest.approx(reply.probability))
    record = found["record"]
    personal = schema.personal_data
    assert personal  # the test means something only with personal fields in the schema
    hasher = AuditRecords("hash", KEY.encode())
    expected = {name: hasher.keyed_hash(name, value) if name in personal else value
                for name, value in sent.items() if name in schema.attribute_names}
    assert record["attributes"] == expected
    text = json.dumps(record)
    for name in personal:  # never stored raw: only as "hmac-sha256:<hex>"
        assert record["attributes"][name].startswith("hmac-sha256:")
        if isinstance(sent[name], str):
            assert json.dumps(sent[name]) not in text
    assembler = FeatureAssembler(credit_entry.preprocessing)
    assembled = assembler.assemble(sent)
    personal_columns = {i for name in personal
                        for i in range(*assembler.feature_slices[name].indices(assembler.n_features))}
    assert personal_columns  # the vector's personal columns are null: the preprocessing would reverse them
    assert record["features"] == [None if i in personal_columns else v  # the others are the float32 values, exactly
                                  for i, v in enumerate(assembled.vector.tolist())]
    assert ["Seniority", "MISSING_DEFAULTED"] in record["guards"]
    logits = ort.InferenceSession(str(credit_entry.model_path), providers=["CPUExecutionProvider"]).run(
        None, {"features": assembled.vector[None, :]})[0][0]
    np.testing.assert_allclose(record["logits"], logits, atol=1e-5)
    contributions = {feature: value for feature, value, _ in record["explanation"]["contributions"]}
    assert contributions == {c.feature: pytest.approx(c.contribution, abs=1e-9) for c in reply.contributions}
    assert record["explanation"]["top_reasons"] == list(reply.top_reasons)
    assert record["preprocessing_hash"] == credit_entry.preprocessing.hash


async def test_personal_data_is_left_out_by_default_and_a_replay_keeps_the_first_record(dropping, credit_entry,
                                                                                        credit_holdout):
    (stub, _), ledger_url = dropping
    schema = credit_entry.preprocessing.feature_schema
    sent = credit_holdout.records[7]
    first = await stub.Predict(pb.PredictRequest(request_id="audit-2", entity_id="e-2",
                                                 attributes=to_attributes(sent)), timeout=30)
    replay = await stub.Predict(pb.PredictRequest(request_id="audit-2", entity_id="e-2",
                                                  attributes=to_attributes(sent), explain=True), timeout=30)
    assert replay.replayed and replay.decision_id == first.decision_id
    record = (await decision_record(ledger_url, "audit-2"))["record"]
    assert set(record["attributes"]) == set(sent) - schema.personal_data
    assert record["explanation"] is None  # the first call asked for none; the replay records nothing new
    done = mlpair_cli("decision", "audit-2", "--ledger-url", ledger_url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["record"] == record
    missing = mlpair_cli("decision", "never-decided", "--ledger-url", ledger_url)
    assert missing.returncode == 1 and "no decision on record" in missing.stderr


async def test_a_batch_keeps_one_record_per_decided_item(dropping, credit_holdout):
    (stub, _), ledger_url = dropping
    items = [pb.PredictRequest(request_id=f"audit-batch-{i}", entity_id=f"e-{i}",
                               attributes=to_attributes(credit_holdout.records[i])) for i in range(40)]
    items.append(pb.PredictRequest(request_id="audit-batch-bad", entity_id="e-bad",
                                   attributes=to_attributes({"Income": "lots"})))
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=items), timeout=60)
    assert sum(r.WhichOneof("outcome") == "error" for r in reply.results) == 1
    async with opened_ledger(ledger_url) as ledger:
        kept = [await ledger.audit_record(f"audit-batch-{i}") for i in range(40)]
        assert all(k is not None for k in kept)
        assert await ledger.audit_record("audit-batch-bad") is None  # refused: no decision, no record
        assert read_record(kept[3])["features"] != read_record(kept[4])["features"]
