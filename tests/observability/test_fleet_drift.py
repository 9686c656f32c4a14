"""The distribution signals every replica exports (mlpair.prediction.monitoring.signals), read back as
Prometheus samples: rank buckets reproduce the training distribution, the fleet KS statistic
computed from them is the exact KS at the bucket edges, category counts give the monitor's total
variation, and decisions just below a threshold are counted against the training share."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.prediction import metrics
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.families import ModelFamily
from mlpair.prediction.monitoring.drift_statistics import chi2_against_frequencies, ks_against_quantiles
from mlpair.prediction.monitoring.signals import PROBE_BAND_WIDTH, SCORE, FamilySignals, rank_edges
from mlpair.training.data import stratified_split
from tests.support import CONFIG_DIR

MODEL = "credit-risk"


class Samples:
    """The signal samples of one model, as differences since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def _read(self) -> dict:
        values = {}
        for family in REGISTRY.collect():
            if family.name in ("prediction_drift_rank", "prediction_drift_category", "prediction_near_threshold"):
                for s in family.samples:
                    if s.labels.get("model") == MODEL and not s.name.endswith(("_created", "_sum")):
                        values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return values

    def reset(self) -> None:
        self._base = self._read()

    def value(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model": MODEL, **labels}.items())))
        return self._read().get(key, 0.0) - self._base.get(key, 0.0)


def baseline(feature: str) -> np.ndarray:
    return np.array([REGISTRY.get_sample_value("prediction_drift_rank_baseline",
                                               {"model": MODEL, "feature": feature, "le": le})
                     for le in metrics.RANK_BUCKET_LABELS])


def grid_ks(samples: Samples, feature: str) -> float:
    """The fleet KS statistic as the rules compute it: max |live CDF - training CDF| over the edges."""
    n = samples.value("prediction_drift_rank_count", feature=feature)
    live = np.array([samples.value("prediction_drift_rank_bucket", feature=feature, le=le)
                     for le in metrics.RANK_BUCKET_LABELS]) / n
    return float(np.abs(live - baseline(feature)).max())


@pytest.fixture(scope="module")
def family(model_repository) -> ModelFamily:
    return ModelFamily.load(MODEL, CONFIG_DIR, model_repository)


@pytest.fixture(scope="module")
def signals(family) -> FamilySignals:
    return FamilySignals(family.entry, family.members[0].entry, family.policy)


@pytest.fixture(scope="module")
def train_records(credit_data, credit_entry) -> list[dict]:
    seed = int(credit_entry.manifest.data_source["split"]["seed"])
    return credit_data.subset(stratified_split(credit_data.labels, seed)["train"]).records


def numeric_features(entry) -> list[str]:
    return [f.name for f in entry.preprocessing.feature_schema.numeric]


def test_rank_buckets_of_the_training_rows_match_the_baseline(signals, family, train_records):
    # The training split is what the manifest's quantiles were taken from: its live CDF at every
    # edge is the baseline's (up to the interpolation between percentiles).
    samples = Samples()
    for row in FeatureAssembler(family.entry.preprocessing).assemble_many(train_records):
        signals.observe(row, 0.5)
    for feature in numeric_features(family.entry):
        assert samples.value("prediction_drift_rank_count", feature=feature) == len(train_records)
        assert grid_ks(samples, feature) < 0.02, feature


def test_fleet_ks_is_the_exact_ks_at_the_edges_and_flags_only_the_drifted_feature(signals, family,
                                                                                   credit_holdout):
    # The holdout with income x 3 (a monthly -> quarterly unit change upstream): the grid statistic
    # never exceeds the exact KS (it is that KS read at 19 points) and is at most 0.05 below it.
    records = [{**r, "Income": None if r.get("Income") is None else r["Income"] * 3} for r in credit_holdout.records]
    rows = FeatureAssembler(family.entry.preprocessing).assemble_many(records)
    samples = Samples()
    for row in rows:
        signals.observe(row, 0.5)
    manifest = family.entry.manifest
    train_rows = manifest.data_source["split"]["train"]
    names = family.entry.preprocessing.feature_names
    drifted = []
    for feature in numeric_features(family.entry):
        exact, _ = ks_against_quantiles(rows[:, names.index(feature)], np.array(manifest.baselines[feature]["quantiles"]),
                                        train_rows)
        grid = grid_ks(samples, feature)
        assert exact - 0.05 <= grid <= exact + 1e-9, (feature, grid, exact)
        if grid > 0.15:
            drifted.append(feature)
    assert drifted == ["Income"]


def test_atoms_keep_their_mass_on_one_side_of_an_edge():
    # A third of the training rows at exactly 0 (e.g. "no debt"), the rest spread over (0, 1]:
    # levels inside the jump (0.05 … 0.30) hold the values below 0, so their baseline is 0.
    quantiles = np.concatenate([np.zeros(34), np.linspace(0.015, 1.0, 67)])
    edges, base = rank_edges(quantiles)
    inside = [i for i, level in enumerate(metrics.RANK_BUCKETS) if level < 0.33]
    assert all(base[i] == 0.0 and edges[i] < 0 for i in inside)
    assert base[len(inside)] == pytest.approx(metrics.RANK_BUCKETS[len(inside)])
    assert np.all(np.diff(edges) >= 0)


def test_category_counts_give_the_drift_monitors_total_variation(signals, family, credit_holdout):
    rows = FeatureAssembler(family.entry.preprocessing).assemble_many(credit_holdout.records)
    samples = Samples()
    for row in rows:
        signals.observe(row, 0.5)
    names = family.entry.preprocessing.feature_names
    for feature in family.entry.preprocessing.feature_schema.categorical:
        columns = [j for j, n in enumerate(names) if n.startswith(feature.name + "=")]
        categories = [names[j].split("=", 1)[1] for j in columns]
        counts = np.array([samples.value("prediction_drift_category_total", feature=feature.name, category=c)
                           for c in categories])
        assert counts.sum() == len(rows)
        frequencies = np.array([REGISTRY.get_sample_value("prediction_drift_category_baseline",
                                                          {"model": MODEL, "feature": feature.name, "category": c})
                                for c in categories])
        tv = 0.5 * np.abs(counts / counts.sum() - frequencies / frequencies.sum()).sum()
        _, _, expected = chi2_against_frequencies(rows[:, columns].sum(axis=0), frequencies, 1000)
        assert tv == pytest.approx(expected, abs=1e-9)


def test_scores_just_below_each_threshold_are_counted_with_the_training_share(signals, family):
    policy: DecisionPolicy = family.policy
    thresholds = [b.min_probability for b in policy.bands[1:]]
    samples = Samples()
    row = np.zeros(family.entry.preprocessing.n_features, dtype=np.float32)
    scores = [t - PROBE_BAND_WIDTH for t in thresholds] + [t - 0.001 for t in thresholds] + \
             [t for t in thresholds] + [t - PROBE_BAND_WIDTH - 0.001 for t in thresholds]
    for score in scores:
        signals.observe(row, score)
    score_quantiles = np.array(family.members[0].entry.manifest.baselines["__score__"]["quantiles"])
    for t in thresholds:
        label = f"{t:g}"
        assert samples.value("prediction_near_threshold_total", threshold=label) == 2  # [t - 0.02, t)
        share = REGISTRY.get_sample_value("prediction_near_threshold_baseline_ratio", {"model": MODEL, "threshold": label})
        below = np.interp([t - PROBE_BAND_WIDTH, t], score_quantiles, np.linspace(0, 1, len(score_quantiles)))
        assert share == pytest.approx(below[1] - below[0], abs=0.011)  # up to one percentile's atom
    assert samples.value("prediction_drift_rank_count", feature=SCORE) == len(scores)
