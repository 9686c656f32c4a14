"""Columnar decisions are the row-wise ones: assembly, guards, policy and drift signals, bit for bit.

The pipeline assembles and decides a batch column by column (``columns``, ``policy.decide_many``,
``signals.observe_many``); these tests compare each with the row-wise code training and single
requests use, on every real holdout record and on generated records full of what guards handle.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.prediction.columns import ColumnAssembler
from mlpair.prediction.idempotency import request_fingerprint, request_fingerprints
from mlpair.prediction.policy import DecisionPolicy
from mlpair.prediction.signals import FamilySignals
from tests.support import CONFIG_DIR

pytestmark = pytest.mark.timeout(120)


def row_wise(assembler: FeatureAssembler, records: list[dict]) -> list:
    """Each record as the row-wise assembler sees it: (vector bytes, guards, unknown) or the problems."""
    out = []
    for record in records:
        try:
            row = assembler.assemble(record)
        except ConversionError as exc:
            out.append(("refused", exc.problems))
        else:
            out.append((row.vector.tobytes(), row.guards, row.unknown_attributes))
    return out


def columnar(columns: ColumnAssembler, records: list[dict]) -> list:
    assembled = columns.assemble(records)
    guards = columns.guards(assembled.actions)
    return [("refused", assembled.problems[i]) if i in assembled.problems else
            (assembled.matrix[i].tobytes(), guards[i].events, assembled.unknown.get(i, ()))
            for i in range(len(records))]


@pytest.mark.parametrize("family", ["credit", "churn"])
def test_columnar_assembly_is_the_row_wise_one_on_every_holdout_record(family, credit_entry, credit_holdout,
                                                                        churn_entry, request):
    if family == "credit":
        entry, records = credit_entry, credit_holdout.records
    else:
        from mlpair.training.data import load_dataset, stratified_split

        entry = churn_entry
        data = load_dataset(churn_entry.preprocessing.feature_schema)
        seed = int(churn_entry.manifest.data_source["split"]["seed"])
        records = data.subset(stratified_split(data.labels, seed)["holdout"]).records
    assembler = FeatureAssembler(entry.preprocessing)
    expected = row_wise(assembler, records)
    assert len(expected) > 500 and sum(bool(e[1]) for e in expected) > 0  # real guards among them
    assert columnar(ColumnAssembler(assembler), records) == expected


def _messy_values(feature) -> st.SearchStrategy:
    """What a client may send for one attribute: the wire's kinds, with what the guards and the
    conversion rules exist for (missing, sentinels, out of range, infinities, words, fractions)."""
    numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
        [0.0, 1.0, -1.0, 2.5, 1e30, -1e30, *getattr(feature, "sentinels", ())]))
    strings = st.one_of(st.sampled_from(["", " ", "42", " 7 ", "1e3", "nan", "yes", "No", "abc", "A11", " a12 "]),
                        st.text(max_size=6))
    return st.one_of(st.none(), numbers, strings, st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_columnar_assembly_is_the_row_wise_one_on_generated_records(data, credit_entry, credit_holdout):
    assembler = FeatureAssembler(credit_entry.preprocessing)
    features = credit_entry.preprocessing.feature_schema.features
    base = credit_holdout.records[:40]
    records = []
    for record in base:
        record = dict(record)
        for feat in data.draw(st.lists(st.sampled_from(features), max_size=4, unique_by=lambda f: f.name)):
            record[feat.name] = data.draw(_messy_values(feat))
        if data.draw(st.booleans()):
            record.pop(features[data.draw(st.integers(0, len(features) - 1))].name, None)
        if data.draw(st.integers(0, 9)) == 0:
            record["not_in_schema"] = 1.0
        records.append(record)
    assert columnar(ColumnAssembler(assembler), records) == row_wise(assembler, records)
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
def test_decide_many_gives_decide_s_verdict_for_every_row(model):
    policy = DecisionPolicy.from_toml(CONFIG_DIR / model / "policy.toml")
    edges = [b.min_probability for b in policy.bands]
    rng = np.random.default_rng(3)
    p = np.concatenate([rng.uniform(0, 1, 2000), edges, np.nextafter(edges, 1.0), np.nextafter(edges, 0.0),
                        [0.0, 1.0, math.nan, -0.1, 1.5]])
    spread = np.concatenate([rng.uniform(0, 0.5, len(p) - 2), [math.nan, 2.0]])
    fraction = rng.choice([0.0, 0.1, 0.3, 0.5, 0.9, 1.0], len(p))
    band, route, valid = policy.decide_many(p, spread, fraction)
    for k in range(len(p)):
        try:
            expected = policy.decide(float(p[k]), float(spread[k]), float(fraction[k]))
        except ValueError:
            assert not valid[k]
            continue
        assert valid[k] and policy.verdict(int(band[k]), int(route[k])) == expected


def _samples(model: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for metric in REGISTRY.collect()
            if metric.name.startswith("prediction_drift_") or metric.name == "prediction_near_threshold"
            for s in metric.samples if s.labels.get("model") == model and not s.name.endswith("_created")}


def test_signals_count_a_batch_as_row_by_row_observations_would(credit_entry, holdout_x):
    from mlpair.prediction.policy import DecisionPolicy

    signals = FamilySignals(credit_entry, credit_entry, DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml"))
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
