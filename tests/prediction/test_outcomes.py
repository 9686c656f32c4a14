"""Realised outcomes beside the decisions (ledger_0003), on both engines: one outcome per decision
(the same again stored once, another label refused), unknown decisions kept for a later join, bad
items and rows named with the valid ones stored, 10,000 outcomes imported twice stored once, and
realised figures that equal scikit-learn's on the same join."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import brier_score_loss, roc_auc_score
from sqlalchemy import func, select

from mlpair.prediction.errors import UnknownModel
from mlpair.prediction.feedback.importing import UnreadableFile, import_file
from mlpair.prediction.feedback.items import FamilyLabels, InvalidOutcome, OutcomeConflict, check
from mlpair.prediction.feedback.performance import Threshold
from mlpair.prediction.feedback.refresh import FamilyPolicy, measure
from mlpair.prediction.feedback.store import OutcomeStore, Stored
from mlpair.prediction.recording.admin import migrate
from mlpair.prediction.recording.models import OutcomeEntry
from tests.support.ledger import decision, opened_ledger

LABELS = {"credit-risk": FamilyLabels(("not bad", "bad"), "bad"), "churn": FamilyLabels(("not Yes", "Yes"), "Yes")}
POLICY = FamilyPolicy((Threshold("REVIEW", 0.25), Threshold("DECLINE", 0.55)), ("APPROVE", "REVIEW", "DECLINE"))
NOW = datetime.now(UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_database(request, tmp_path):
    """Ledger and CRM URLs: two SQLite files, or one throw-away PostgreSQL database (a sync fixture:
    creating the database runs its own short event loop)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}", f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}"
        return
    url = request.getfixturevalue("fresh_postgres")
    yield url, url


@pytest.fixture
async def ledger_url(fresh_database):
    """A migrated ledger (on PostgreSQL in its ``prediction`` schema)."""
    await migrate(*fresh_database)
    return fresh_database[0]


@pytest.fixture
async def store(ledger_url):
    store = OutcomeStore(ledger_url, LABELS, "credit-risk")
    yield store
    await store.close()


async def record_decisions(url: str, decisions) -> None:
    async with opened_ledger(url) as ledger:
        for start in range(0, len(decisions), 500):
            part = decisions[start : start + 500]
            outcomes = await ledger.record_many(part, ["fp"] * len(part))
            assert not any(isinstance(o, BaseException) for o in outcomes)


def item(n: int, **raw):
    return check(f"item {n}", {"observed_at": NOW, **raw})


async def rows_in(store: OutcomeStore) -> int:
    async with store.engine.connect() as conn:
        return await conn.scalar(select(func.count()).select_from(OutcomeEntry.__table__))


async def test_one_outcome_per_decision_conflicts_refused_unknown_decisions_kept(store, ledger_url):
    await record_decisions(ledger_url, [decision("r1", 0.7, "DECLINE"), decision("r2", 0.1)])
    results = await store.record([
        item(0, request_id="r1", label="bad"),
        item(1, request_id="r1", label="bad"),  # the same again, in the same call
        item(2, request_id="r2", label="not bad"),
        item(3, request_id="r1", label="not bad"),  # another label for r1
        item(4, request_id="later", label="bad"),  # no decision on record yet
        item(5, request_id="r2", label="Yes"),  # a churn label for a credit-risk decision
        item(6, request_id="r2", label="bad", model_name="churn"),  # another family than the decision's
        item(7, request_id="x", label="bad", model_name="fraud"),
    ])
    assert results[:3] == [Stored("r1", False, True), Stored("r1", True, True), Stored("r2", False, True)]
    assert isinstance(results[3], OutcomeConflict) and results[3].metadata == {"recorded_label": "bad"}
    assert results[4] == Stored("later", False, False)
    assert isinstance(results[5], InvalidOutcome) and results[5].metadata == {"item": "5", "field": "label"}
    assert isinstance(results[6], InvalidOutcome) and results[6].metadata == {"item": "6", "field": "model_name"}
    assert isinstance(results[7], UnknownModel)
    again = await store.record([item(0, request_id="r1", label="bad"), item(1, request_id="r1", label="not bad")])
    assert again[0] == Stored("r1", True, True) and isinstance(again[1], OutcomeConflict)
    assert await rows_in(store) == 3
    assert await store.count() == (3, 1)  # "later" waits for its decision
    await record_decisions(ledger_url, [decision("later", 0.3, "REVIEW")])
    assert await store.count() == (3, 0)  # the late join
    joined = await store.joined()
    assert sorted(zip(joined.decision.tolist(), joined.positive.tolist())) == [
        ("APPROVE", 0), ("DECLINE", 1), ("REVIEW", 1)]


async def test_an_outcome_named_by_entity_and_time_finds_its_decision_then_or_later(store, ledger_url):
    at = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    await record_decisions(ledger_url, [dataclasses.replace(decision("r1", 0.6), entity_id="app-1", decided_at=at)])
    results = await store.record([
        item(0, entity_id="app-1", decided_at=at, label="bad"),
        item(1, request_id="r1", label="bad"),  # the same decision by its request id
        item(2, entity_id="app-2", decided_at=at, label="not bad"),  # not on record yet
        item(3, entity_id="app-2", decided_at=at.isoformat(), label="not bad"),  # the same, as text
    ])
    assert results == [Stored("r1", False, True), Stored("r1", True, True), Stored("", False, False),
                       Stored("", True, False)]
    assert await store.count() == (2, 1)
    later = dataclasses.replace(decision("r2", 0.1), entity_id="app-2", decided_at=at)
    await record_decisions(ledger_url, [later])
    assert await store.count() == (2, 0)


def test_malformed_items_are_named_with_their_field():
    cases = {
        "request_id": {"label": "bad"},
        "label": {"request_id": "r"},
        "observed_at": {"request_id": "r", "label": "bad", "observed_at": "yesterday"},
    }
    for field, raw in cases.items():
        with pytest.raises(InvalidOutcome) as refused:
            check("row 7", {"observed_at": NOW, **raw})
        assert refused.value.metadata == {"row": "7", "field": field}
        assert refused.value.message.startswith(f"row 7: {field} ")
    with pytest.raises(InvalidOutcome, match="observed_at is in the future"):
        check("item 1", {"request_id": "r", "label": "bad", "observed_at": NOW + timedelta(hours=1)})
    with pytest.raises(InvalidOutcome, match="label must be a string, not int"):
        check("row 2", {"request_id": "r", "label": 1, "observed_at": NOW})
    with pytest.raises(InvalidOutcome, match="observed_at must be a time, not float"):
        check("row 3", {"request_id": "r", "label": "bad", "observed_at": 1.5})


async def test_10000_outcomes_imported_twice_are_stored_once_and_score_as_scikit_learn(store, ledger_url, tmp_path):
    rng = np.random.default_rng(40)
    n = 10_000
    probabilities = rng.random(n).round(3)  # ties, as real calibrated probabilities have
    positive = (rng.random(n) < probabilities).astype(int)
    bands = np.where(probabilities >= 0.55, "DECLINE", np.where(probabilities >= 0.25, "REVIEW", "APPROVE"))
    ids = [f"req-{i:05d}" for i in range(n)]
    await record_decisions(ledger_url, [decision(i, float(p), str(b)) for i, p, b in zip(ids, probabilities, bands)])
    path = tmp_path / "outcomes.csv"
    with path.open("w") as f:
        f.write("request_id,label,observed_at\n")
        for i, y in zip(ids, positive):
            f.write(f"{i},{'bad' if y else 'not bad'},2026-01-0{1 + int(y)}T00:00:00Z\n")
    first = await import_file(path, store, chunk_rows=3000)
    second = await import_file(path, store, chunk_rows=3000)
    assert (first.rows, first.stored, first.duplicates, first.refused) == (n, n, 0, [])
    assert (second.rows, second.stored, second.duplicates, second.refused) == (n, 0, n, [])
    assert await rows_in(store) == n

    [figures] = await measure(store, [0], {"credit-risk": POLICY})
    assert figures.n == n and figures.window == "all"
    assert abs(figures.roc_auc - roc_auc_score(positive, probabilities)) < 1e-9
    assert abs(figures.brier - brier_score_loss(positive, probabilities)) < 1e-12
    for band, t in (("REVIEW", 0.25), ("DECLINE", 0.55)):
        flagged = probabilities >= t
        assert figures.precision[band] == (positive & flagged).sum() / flagged.sum()
        assert figures.recall[band] == (positive & flagged).sum() / positive.sum()
    assert figures.decision_rates == {b: float((bands == b).mean()) for b in ("APPROVE", "REVIEW", "DECLINE")}
    assert await measure(store, [0], {"credit-risk": POLICY}, min_joined=n + 1) == []


async def test_bad_rows_are_named_by_row_and_the_valid_rows_stored(store, ledger_url, tmp_path):
    await record_decisions(ledger_url, [decision(f"r{i}") for i in range(5)])
    path = tmp_path / "mixed.csv"
    path.write_text(
        "request_id,label,observed_at,model_name\n"
        "r0,bad,2026-01-01T00:00:00+00:00,\n"
        "r1,defaulted,2026-01-01T00:00:00+00:00,\n"  # row 2: not a class name
        "r2,not bad,01/02/2026,\n"  # row 3: not an ISO time
        ",bad,2026-01-01T00:00:00+00:00,\n"  # row 4: no id
        "r3,not bad,2026-01-01T00:00:00,\n"  # naive: UTC
        "r4,bad,2026-01-01T00:00:00+00:00,fraud\n"  # row 6: unknown family
    )
    report = await import_file(path, store)
    assert (report.rows, report.stored) == (6, 2)
    assert [(e.code, e.message) for e in report.refused] == [
        ("INVALID_ARGUMENT", "row 2: label must be one of not bad, bad"),
        ("INVALID_ARGUMENT", "row 3: observed_at is not an ISO 8601 time (e.g. 2026-03-01T12:00:00+00:00)"),
        ("INVALID_ARGUMENT", "row 4: request_id is missing (or give entity_id with decided_at)"),
        ("NOT_FOUND", "row 6: model family 'fraud' is not served"),
    ]
    assert await rows_in(store) == 2

    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"request_id": ["r1", "r2"], "label": [1, 0],
                             "observed_at": pa.array([NOW, NOW], pa.timestamp("us", tz="UTC"))}), typed)
    report = await import_file(typed, store)
    assert [e.message for e in report.refused] == ["row 1: label must be a string, not int",
                                                   "row 2: label must be a string, not int"]
    with pytest.raises(UnreadableFile, match="unknown column"):
        (tmp_path / "extra.csv").write_text("request_id,label,observed_at,score\n")
        await import_file(tmp_path / "extra.csv", store)


async def test_an_unreachable_ledger_is_unavailable_and_says_to_send_again():
    from mlpair.prediction.feedback.items import OutcomesUnavailable

    store = OutcomeStore("postgresql+asyncpg://nobody@127.0.0.1:1/none", LABELS, "credit-risk", timeout_s=2)
    try:
        with pytest.raises(OutcomesUnavailable) as refused:
            await store.record([item(0, request_id="r1", label="bad")])
    finally:
        await store.close()
    assert (refused.value.code, refused.value.message) == ("UNAVAILABLE", "the outcomes could not be stored; send them again")
