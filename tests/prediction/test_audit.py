"""Audit records in the ledger (issue 40, part 4): committed with their decisions on both engines,
read back as stored, deleted by retention while the decisions stay; the keyed hash of personal data."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from mlpair.prediction.recording.admin import migrate
from mlpair.prediction.recording.audit import AuditRecords
from mlpair.prediction.recording.ledger import as_columns
from tests.support.ledger import decision, opened_ledger


def test_personal_data_is_hashed_with_hmac_sha256_under_the_key_and_a_short_key_is_refused():
    audit = AuditRecords("hash", b"k" * 16)
    expected = hmac.new(b"k" * 16, b"Income:4200", hashlib.sha256).hexdigest()
    assert audit.keyed_hash("Income", 4200) == f"hmac-sha256:{expected}"
    assert AuditRecords("hash", b"j" * 16).keyed_hash("Income", 4200) != audit.keyed_hash("Income", 4200)
    # equal values of two attributes do not show as equal
    assert audit.keyed_hash("Assets", 0.0) != audit.keyed_hash("Debt", 0.0)
    with pytest.raises(ValueError, match="16 bytes"):
        AuditRecords("hash", b"short")
    with pytest.raises(ValueError, match="drop"):
        AuditRecords("keep")


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_and_crm(request, tmp_path):
    """Two SQLite files, or one fresh PostgreSQL database for both (a sync fixture)."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}", f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}"
    url = request.getfixturevalue("fresh_postgres")
    return url, url


async def test_retention_deletes_audit_records_and_keeps_the_decisions(ledger_and_crm):
    url, crm = ledger_and_crm
    await migrate(url, crm)
    async with opened_ledger(url) as ledger:
        batch = [decision(f"kept-{i}") for i in range(20)]
        columns = as_columns(batch, ["fp"] * 20)
        columns.audit = [json.dumps({"features": [float(i)]}) for i in range(20)]
        outcomes = await ledger.record_many(columns, columns.fingerprints)
        assert not any(isinstance(o, BaseException) for o in outcomes)
        assert json.loads(await ledger.audit_record("kept-7")) == {"features": [7.0]}
        assert await ledger.prune_audit(3600.0) == 0  # none is an hour old
        assert await ledger.prune_audit(0.0) == 20
        assert await ledger.audit_record("kept-7") is None
        assert (await ledger.find("kept-7")).decision.request_id == "kept-7"


def test_vectors_read_back_exactly_and_a_non_finite_logit_reads_as_null():
    import numpy as np

    from mlpair.prediction.recording.audit import _encode, _f32, read_record

    features = np.array([0.1, -2.5, 1e-30, 3.4e38], dtype=np.float32)
    text = _encode({"features_f32": _f32(features), "logits_f32": _f32(np.array([np.nan, 1.5], np.float32)),
                    "explanation": None})
    assert read_record(text) == {"features": features.tolist(), "logits": [None, 1.5], "explanation": None}
    assert json.loads(_encode({"contribution": float("nan")})) == {"contribution": None}  # JSON holds no NaN


async def test_a_group_commit_of_calls_with_and_without_records_keeps_each_call_s_own(ledger_and_crm):
    from mlpair.prediction.records import DecisionColumns

    url, crm = ledger_and_crm
    await migrate(url, crm)
    async with opened_ledger(url) as ledger:
        with_records = as_columns([decision(f"with-{i}") for i in range(3)], ["fp"] * 3)
        with_records.audit = [json.dumps({"n": i}) for i in range(3)]
        without = as_columns([decision(f"without-{i}") for i in range(2)], ["fp"] * 2)
        # concurrent small calls go out in one group commit, concatenated as the ledger's writer does
        batch = DecisionColumns.concat([with_records, without])
        assert batch.audit == [*with_records.audit, "", ""]
        outcomes = await ledger.record_many(batch, batch.fingerprints)
        assert not any(isinstance(o, BaseException) for o in outcomes)
        assert [json.loads(await ledger.audit_record(f"with-{i}")) for i in range(3)] == [{"n": i} for i in range(3)]
        assert [await ledger.audit_record(f"without-{i}") for i in range(2)] == [None, None]
        assert (await ledger.find("without-1")).decision.request_id == "without-1"
