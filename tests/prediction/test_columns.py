"""A batch handled at once is each of its rows handled alone: fingerprints, decisions, drift signals, scoring.

The pipeline decides a batch column by column (``deciding.decisions.decide``, ``signals.observe_many``,
the scorer's fill); these tests compare each with one row at a time on the real holdout and on
generated records full of what the guards handle. The assembler's own comparison is in
``tests/contracts/test_columns.py``.
"""

from __future__ import annotations

import math
from datetime import UTC

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.columns import ColumnAssembler
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.monitoring.signals import FamilySignals
from mlpair.prediction.preparing.idempotency import request_fingerprint, request_fingerprints
from tests.support import CONFIG_DIR
from tests.support.records import messy_values

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fingerprints_of_generated_records_are_each_request_s_own(data, credit_entry, credit_holdout):
    features = credit_entry.preprocessing.feature_schema.features
    records = []
    for record in credit_holdout.records[:40]:
        record = dict(record)
        for feat in data.draw(st.lists(st.sampled_from(features), max_size=4, unique_by=lambda f: f.name)):
            record[feat.name] = data.draw(messy_values(feat))
        if data.draw(st.integers(0, 9)) == 0:
            record["not_in_schema"] = 1.0
        records.append(record)
    entities = [f"e{i}" for i in range(len(records))]
    assert request_fingerprints("credit-risk", entities, records) == [
        request_fingerprint("credit-risk", e, r) for e, r in zip(entities, records)]


def test_fingerprints_of_a_batch_are_each_request_s_own(credit_holdout):
    records = [dict(r) for r in credit_holdout.records]
    records[3]["Amount"] = float("inf")
    records[4]["Home"] = ""
    records[5]["Age"] = True
    records[6]["extra"] = "x"
    entities = [f"entity-\"{i}\u00e9" for i in range(len(records))]
    expected = [request_fingerprint("credit-risk", e, r) for e, r in zip(entities, records)]
    assert request_fingerprints("credit-risk", entities, records) == expected
    assert len(set(expected)) == len(expected)


@pytest.mark.parametrize("model", ["credit-risk", "churn"])
def test_the_policy_routes_every_row_by_its_rules_in_their_order(model):
    """``DecisionPolicy.decide`` against the policy file's rules written out here: the band whose
    lower bound the probability meets, insufficient data first, then ensemble disagreement; a value
    not finite or outside [0, 1] is refused."""
    policy = DecisionPolicy.from_toml(CONFIG_DIR / model / "policy.toml")
    edges = [b.min_probability for b in policy.bands]
    rng = np.random.default_rng(3)
    p = np.concatenate([rng.uniform(0, 1, 2000), edges, np.nextafter(edges, 1.0), np.nextafter(edges, 0.0),
                        [0.0, 1.0, math.nan, -0.1, 1.5]])
    spread = np.concatenate([rng.uniform(0, 0.5, len(p) - 2), [math.nan, 2.0]])
    fraction = rng.choice([0.0, 0.1, 0.3, 0.5, 0.9, 1.0], len(p))
    scarce, uncertainty = policy.insufficient_data, policy.uncertainty
    routed = set()
    for pk, sk, fk in zip(p.tolist(), spread.tolist(), fraction.tolist()):
        if not (0 <= pk <= 1 and 0 <= sk <= 1 and 0 <= fk <= 1):
            with pytest.raises(ValueError):
                policy.decide(pk, sk, fk)
            continue
        band = [b for b in policy.bands if (pk >= b.min_probability if policy.comparison == ">=" else
                                            pk > b.min_probability or b.min_probability == 0.0)][-1]
        if scarce is not None and fk > scarce.max_defaulted_fraction:
            expected = (scarce.decision, (scarce.reason_code, band.reason_code))
        elif uncertainty is not None and sk > uncertainty.max_spread:
            expected = (uncertainty.decision, (uncertainty.reason_code, band.reason_code))
        else:
            expected = (band.decision, (band.reason_code,))
        verdict = policy.decide(pk, sk, fk)
        assert (verdict.decision, verdict.reason_codes, verdict.band) == (*expected, band)
        routed.add(expected[0])
    assert len(routed) >= 3  # several bands and at least one override were met


def _samples(model: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for metric in REGISTRY.collect()
            if metric.name.startswith("prediction_drift_") or metric.name == "prediction_near_threshold"
            for s in metric.samples if s.labels.get("model") == model and not s.name.endswith("_created")}


def test_signals_count_a_batch_as_row_by_row_observations_would(credit_entry, holdout_x):
    from mlpair.prediction.deciding.policy import DecisionPolicy

    signals = FamilySignals(credit_entry, credit_entry, DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml"))
    # besides the holdout: every rank edge exactly, a float32 step either side, and NaN and ±inf
    ranks = [(np.asarray(edges, dtype=np.float32), column) for _, edges, column in signals._ranks]
    odd = np.repeat(holdout_x[:1], len(ranks[0][0]) * 3 + 3, axis=0)
    for edges, column in ranks:
        odd[:, column] = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)),
                                         np.nextafter(edges, np.float32(-np.inf)), [np.nan, np.inf, -np.inf]])
    holdout_x = np.concatenate([holdout_x, odd])
    scores = np.random.default_rng(5).uniform(0, 1, len(holdout_x))
    before = _samples("credit-risk")
    for vector, score in zip(holdout_x, scores):
        signals.observe(vector, float(score))
    middle = _samples("credit-risk")
    signals.observe_many(holdout_x, scores)
    after = _samples("credit-risk")
    row_by_row = {k: middle[k] - before.get(k, 0.0) for k in middle}
    at_once = {k: after[k] - middle.get(k, 0.0) for k in after}
    assert set(row_by_row) == set(at_once) and any(v for v in at_once.values())
    for key, value in row_by_row.items():
        if key[0].endswith("_sum"):  # the order of additions may differ in the last bits
            assert at_once[key] == pytest.approx(value, rel=1e-9)
        else:
            assert at_once[key] == value, key


def _scored_group(entry, records: list[dict], members: int, seed: int, every_row_decided: bool = False):
    """A group of ``records`` (their real guards) as scoring leaves it, with ``members`` ensemble
    members' probabilities: inside the bands, on their edges, and a few the policy refuses; every
    source (fresh, cached, stale, fallback), unusable output, a chunk's error and explained rows.
    ``every_row_decided``: none of what keeps a row from a decision with model output (no refused
    probability, fallback, unusable output or error)."""
    from types import SimpleNamespace

    from mlpair.prediction.outcomes import PredictInput
    from mlpair.prediction.preparing.batch import Group
    from mlpair.prediction.scoring.cache import Scored, Source
    from mlpair.prediction.scoring.scorer import GroupScores, UnexpectedFailure

    policy = DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")
    schema = entry.preprocessing.feature_schema
    family = SimpleNamespace(name="credit-risk", policy=policy, schema=schema, n_schema_features=len(schema.features),
                             is_ensemble=members > 1, calibration_method="temperature", feature_version="fs-1")
    columns = ColumnAssembler(FeatureAssembler(entry.preprocessing))
    assembled = columns.assemble(records)
    n, rng = len(records), np.random.default_rng(seed)
    edges = [b.min_probability for b in policy.bands]
    probabilities = rng.uniform(0, 1, (members, n))
    probabilities[:, :len(edges) * 2] = np.concatenate([edges, np.nextafter(edges, 0.0)])
    sources = [Source.INFERENCE, Source.CACHE, Source.STALE_CACHE, *(() if every_row_decided else [Source.FALLBACK])]
    if not every_row_decided:
        probabilities[:, -3:] = [math.nan, 1.5, -0.25]  # usable yet refused by the policy
    source = [sources[k % len(sources)] for k in range(n)]
    served = [Scored(None, "", Source.FALLBACK, 0, "CIRCUIT_OPEN") if source[k] is Source.FALLBACK else
              Scored(np.zeros(2, np.float32), f"v{k % 3}", source[k], 17 * (k % 5),
                     "INFERENCE_TIMEOUT" if source[k] is Source.STALE_CACHE else "") for k in range(n)]
    usable = np.array([s.source is not Source.FALLBACK and (every_row_decided or k % 11 != 5)
                       for k, s in enumerate(served)])
    errors = {} if every_row_decided else {7: UnexpectedFailure("internal error")}
    group = Group(family, list(range(n)), [PredictInput(f"r{k}", f"e{k}", records[k]) for k in range(n)],
                  assembled.matrix, columns.guards(assembled.actions), [f"fp{k}" for k in range(n)])
    occluded = {k: rng.uniform(0, 1, (members, family.n_schema_features)) for k in range(0, n, 13) if usable[k]}
    scores = GroupScores(served, np.where(usable, probabilities, 0.0), usable, np.zeros(n),
                         [s.model_version for s in served], occluded, errors)
    return group, scores


def _decided(d) -> list:
    return [(k, d.columns[j], d.columns.fingerprints[j], d.spread[j], d.from_cache[j], d.calibration_method[j],
             d.explanations.get(j), d.without_model.get(j)) for j, k in enumerate(d.rows)]


@pytest.mark.parametrize("members", [1, 3, 8])
def test_each_row_decided_alone_is_the_decision_made_for_the_whole_group_bit_for_bit(
        members, credit_entry, credit_holdout):
    """Every holdout applicant's row decided alone (a Predict's group of one) gives the same record,
    reason codes, probability bits, spread, explanation and errors as deciding them all at once, and
    the verdict of each row with model output is the one ``DecisionPolicy.decide`` gives row by row."""
    from datetime import datetime

    from mlpair.prediction.deciding.decisions import STALE_REASON, decide
    from mlpair.prediction.preparing.batch import Group
    from mlpair.prediction.scoring.rows import Source
    from mlpair.prediction.scoring.scorer import GroupScores

    group, scores = _scored_group(credit_entry, credit_holdout.records, members, seed=members)
    at = datetime(2026, 1, 2, tzinfo=UTC)
    whole = decide(group, scores, at, 3, {})
    assert len(whole.errors) > 3 and whole.explanations and whole.without_model
    alone: list = []
    for k in range(len(group)):
        one = Group(group.family, [k], group.requests[k:k + 1], group.vectors[k:k + 1], group.guards[k:k + 1],
                    group.fingerprints[k:k + 1])
        one_scores = GroupScores(scores.served[k:k + 1], scores.probabilities[:, k:k + 1], scores.usable[k:k + 1],
                                 scores.margins[k:k + 1], scores.model_versions[k:k + 1],
                                 {0: scores.occluded[k]} if k in scores.occluded else {},
                                 {0: scores.errors[k]} if k in scores.errors else {})
        d = decide(one, one_scores, at, 3, {})
        assert [str(e) for e in d.errors.values()] == ([str(whole.errors[k])] if k in whole.errors else [])
        alone += [(k, *row[1:]) for row in _decided(d)]
    assert alone == _decided(whole)
    policy, n_schema = group.family.policy, group.family.n_schema_features
    for j, k in enumerate(whole.rows):
        if j in whole.without_model:
            continue
        guards, served = group.guards[k], scores.served[k]
        verdict = policy.decide(whole.columns.probability[j], whole.spread[j], guards.defaulted / n_schema,
                                guards.defaulted_features)
        stale = (STALE_REASON,) if served.source is Source.STALE_CACHE else ()
        assert whole.columns.decision[j] == verdict.decision
        assert whole.columns.reason_codes[j] == (*verdict.reason_codes, *stale, *guards.reason_codes)


@pytest.mark.parametrize("members", [1, 3])
def test_a_failed_row_leaves_every_other_rows_record_as_it_is_without_it(members, credit_entry, credit_holdout):
    """A group whose every row has model output, decided again with its last row's call failed: every
    other row's record, probability bits, spread, source, calibration method and explanation are the same."""
    from dataclasses import replace
    from datetime import datetime

    from mlpair.prediction.deciding.decisions import decide
    from mlpair.prediction.scoring.scorer import UnexpectedFailure

    group, scores = _scored_group(credit_entry, credit_holdout.records, members, seed=members, every_row_decided=True)
    at = datetime(2026, 1, 2, tzinfo=UTC)
    whole = decide(group, scores, at, 3, {})
    assert len(whole.rows) == len(group) and not whole.errors and not whole.without_model
    assert whole.explanations and any(whole.from_cache) and not all(whole.from_cache)
    failed = replace(scores, errors={len(group) - 1: UnexpectedFailure("internal error")})
    general = decide(group, failed, at, 3, {})
    assert general.rows == whole.rows[:-1]
    assert _decided(general) == _decided(whole)[:-1]
    assert [p.hex() for p in general.columns.probability] == [p.hex() for p in whole.columns.probability[:-1]]


def _member_answers(members: int, rows: int) -> list:
    """Each ensemble member's scored rows: fresh and cached by turns, a fallback every ninth row."""
    from mlpair.prediction.scoring.rows import Scored, ScoredRows, Source

    return [ScoredRows.of([Scored(None, "", Source.FALLBACK, 0, "CIRCUIT_OPEN") if (r + m) % 9 == 4 else
                           Scored(np.zeros(2, np.float32), f"m{m}v{r % 2}", (Source.INFERENCE, Source.CACHE)[r % 2],
                                  r % 3) for r in range(rows)], 2) for m in range(members)]


def _unscored(entry, records: list[dict], members: int):
    """Scores of :func:`_scored_group`'s group as scoring starts them (nothing filled)."""
    from mlpair.prediction.scoring.scorer import GroupScores

    n = len(records)
    return GroupScores([None] * n, np.zeros((members, n)), np.zeros(n, bool), np.zeros(n), [""] * n)


@pytest.mark.parametrize("explained", [True, False])
@pytest.mark.parametrize("members", [1, 2])
def test_scoring_fills_a_few_rows_as_the_columnar_fill_does(members, explained, credit_entry, credit_holdout):
    """``scoring._fill_rows`` (groups under eight rows) leaves the group's scoring columns as ``_fill`` does,
    with explained items among them and without (one row per item, ``_fill``'s shortest path)."""
    from mlpair.prediction.scoring.scorer import ChunkScores, _fill, _fill_rows

    records = credit_holdout.records[:40]
    rng = np.random.default_rng(members)
    sizes = [1 + 5 * (k % 3 == 0) for k in range(len(records))] if explained else None  # occluded rows
    total = sum(sizes) if sizes else len(records)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist() if sizes else range(total)
    answers = _member_answers(members, total)
    probabilities, usable = rng.uniform(0, 1, (members, total)), rng.uniform(0, 1, total) > 0.1
    margins = rng.normal(size=total)
    filled = []
    for fill in (_fill, _fill_rows):
        scores = _unscored(credit_entry, records, members)
        n = len(scores.served)
        fill(scores, range(n), ChunkScores(answers, probabilities, usable, margins, offsets, sizes))
        served = [(s.source, s.model_version, s.age_ms, s.degraded_reason, s.logits is None) for s in scores.served]
        filled.append((served, scores.model_versions, scores.probabilities.tobytes(), scores.usable.tobytes(),
                       scores.margins.tobytes(), {k: v.tobytes() for k, v in scores.occluded.items()}))
    assert filled[0] == filled[1]
    assert 0 < sum(np.frombuffer(filled[0][3], bool)) < len(records) and bool(filled[0][5]) is explained


@pytest.mark.parametrize("members", [1, 2])
def test_scoring_fills_any_list_of_items_as_row_by_row_and_leaves_the_others(members, credit_entry, credit_holdout):
    """The scores of merged Predicts' items (one row each, not contiguous: items that failed or
    left are skipped) land on those items alone, ``_fill`` and ``_fill_rows`` alike."""
    from mlpair.prediction.scoring.rows import Source
    from mlpair.prediction.scoring.scorer import ChunkScores, _fill, _fill_rows

    records = credit_holdout.records[:40]
    items = [k for k in range(len(records)) if k % 3 != 1]  # 27 of 40
    rng = np.random.default_rng(members)
    answers = _member_answers(members, len(items))
    probabilities, usable = rng.uniform(0, 1, (members, len(items))), rng.uniform(0, 1, len(items)) > 0.1
    chunk = ChunkScores(answers, probabilities, usable, rng.normal(size=len(items)), range(len(items)), None)
    filled = []
    for fill in (_fill, _fill_rows):
        scores = _unscored(credit_entry, records, members)
        n = len(scores.served)
        fill(scores, items, chunk)
        skipped = [k for k in range(n) if k not in items]
        assert all(scores.served[k] is None and scores.model_versions[k] == "" for k in skipped)
        assert not scores.usable[skipped].any() and not scores.probabilities[:, skipped].any()
        filled.append(([scores.served[k][1:] for k in items], scores.model_versions, scores.probabilities.tobytes(),
                       scores.usable.tobytes(), scores.margins.tobytes()))
        decided = [k for j, k in enumerate(items) if usable[j] and all(a.sources[j] is not Source.FALLBACK for a in answers)]
        np.testing.assert_array_equal(scores.usable[items], [k in decided for k in items])
    assert filled[0] == filled[1]
