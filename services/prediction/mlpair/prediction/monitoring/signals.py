"""Distribution signals every replica contributes to: drift across replicas and threshold probing.

The drift monitor (:mod:`mlpair.prediction.monitoring.drift`) judges each process's own window, which at
ten replicas is a tenth of the stream. The signals here are Prometheus counters and histograms
instead: every replica (and every worker) adds its decisions, Prometheus sums them, and the rules
in ``deploy/observability/prometheus/rules.yaml`` compute the statistics from the sums over a
time window — the same KS 0.15 alarm and Bonferroni rule, on the whole fleet's traffic.

**Rank histograms** (``prediction_drift_rank{model, feature}``). Each numeric feature value
(standardised, as the model sees it) and each calibrated score is mapped to its rank in the
training distribution, ``u = F_train(v)`` (right-continuous, linear between the manifest's
quantiles, atoms kept: :func:`mlpair.prediction.monitoring.drift_statistics.baseline_cdf`), and counted in buckets at
rank levels 0.05, 0.10, …, 0.95. Bucket ``le=l`` therefore counts the rows at or below the
training value of rank ``l``: the live CDF at the training baseline's quantile edges. Beside it,
``prediction_drift_rank_baseline{model, feature, le}`` holds the training CDF at the same edges
(``l`` itself, or the lower end of an atom that straddles ``l``: a feature such as "no debt"
puts a third of the training rows on one value). The fleet KS statistic over a window is

    D = max over le of | live_le / live_total − baseline_le |,

the two-sample KS statistic evaluated at the 19 edges (at most 0.05 below the exact one, which
also looks between edges). Feature ``"score"`` is the calibrated probability, ranked against
the deciding version's calibration-split scores (manifest key ``"__score__"``).

**Category counters** (``prediction_drift_category_total{model, feature, category}``) count
each categorical feature's categories (vocabulary and unknown slot); with the training
frequencies in ``prediction_drift_category_baseline`` the rules compute the total variation
distance, the effect size the drift monitor uses for categorical features.

**Significance.** A feature drifts when its effect exceeds the threshold (0.15, docs/design.md)
and exceeds the critical value at the Bonferroni level ``alpha / k`` (``prediction_drift_corrected_alpha``,
k = every feature and the score), with the effective size ``n·m/(n+m)`` of the window's n rows
against the baseline's m (``prediction_drift_baseline_rows``): ``sqrt(ln(2 / α) / (2 n_e))`` for KS
(Dvoretzky–Kiefer–Wolfowitz with Massart's constant, 1990), ``sqrt((ln(2^c − 2) + ln(1 / α)) / (2 n_e))``
for the total variation over c categories (Weissman et al., "Inequalities for the L1 deviation
of the empirical distribution", 2003). Both are distribution-free bounds, so the test keeps its
level at any window size.

**Threshold probing** (``prediction_near_threshold_total{model, threshold}``): decisions whose
calibrated probability lies within :data:`PROBE_BAND_WIDTH` below a decision threshold of the
policy. Scores packed just under a threshold are what someone searching for the largest loan
that is still approved produces (a field report: ~2,000 near-identical synthetic applications in
3 minutes, scores 0.49–0.51). ``prediction_near_threshold_baseline_ratio`` is the share of
calibration-split scores in the same band, so the rules compare the live count with what the
training distribution predicts for the traffic.

Cost per decision: one vectorised comparison for all numeric features, then one histogram
observation per feature and the score and one counter per categorical feature.
"""

from __future__ import annotations

import bisect

import numpy as np

from mlpair.contracts.manifest import SCORE_BASELINE, ModelEntry
from mlpair.prediction import metrics
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.monitoring.drift_statistics import BASELINE_DECIMALS, baseline_cdf

SCORE = "score"  # the feature label of the calibrated score in the rank histogram
PROBE_BAND_WIDTH = 0.02  # probability units below each threshold: [t - 0.02, t)
# Level tolerance when an edge falls exactly on the end of an atom (levels are k/100 floats).
_LEVEL_EPS = 1e-9
_HALF_UNIT = 0.5 * 10.0**-BASELINE_DECIMALS


def rank_edges(quantiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value-space edges of the rank buckets and the training CDF at each.

    Bucket ``i`` (upper bound ``metrics.RANK_BUCKETS[i]`` = l) holds the values v with
    ``F_train(v) ≤ l``: ``v ≤ e`` where F reaches l continuously at e, or ``v < a`` where l falls
    inside the jump of an atom at a. Values are compared as the drift monitor rounds them (to the
    baseline's 6 decimals), so an edge sits half a unit of that rounding above e or below a, and a
    row is bucketed with ``bisect_left(edges, v)`` without rounding it.

    Args:
        quantiles: ``[k]`` training quantiles at evenly spaced levels 0 … 1.

    Returns:
        (edges ``[19] float64`` non-decreasing, baseline ``[19] float64``: P_train(F(V) ≤ l)).
    """
    q = np.asarray(quantiles, dtype=np.float64)
    levels = np.asarray(metrics.RANK_BUCKETS, dtype=np.float64)
    # the training value of rank l; a level that is one of the quantiles' own (0.05 is the 5th of
    # 101) takes that quantile exactly, so an atom starting or ending there is not missed by float fuzz
    position = levels * (len(q) - 1)
    knot = np.rint(position).astype(int)
    at = np.where(
        np.abs(position - knot) < _LEVEL_EPS,
        q[np.clip(knot, 0, len(q) - 1)],
        np.interp(levels, np.linspace(0.0, 1.0, len(q)), q),
    )
    reached = baseline_cdf(at, q, "right") <= levels + _LEVEL_EPS
    edges = np.where(reached, at + _HALF_UNIT, at - _HALF_UNIT)
    baseline = np.where(reached, baseline_cdf(at, q, "right"), baseline_cdf(at, q, "left"))
    return edges, np.minimum(baseline, levels)


class FamilySignals:
    """The distribution signals of one model family (built once at start-up).

    Args:
        entry: the version whose preprocessing builds the vectors (its baselines describe the
            features: every version of a family shares them).
        score_entry: the version that decides (its calibration-split scores are the score baseline).
        policy: the family's decision policy (its band thresholds are probed).
    """

    def __init__(self, entry: ModelEntry, score_entry: ModelEntry, policy: DecisionPolicy) -> None:
        manifest, preprocessing = entry.manifest, entry.preprocessing
        self.model_name = name = manifest.model_name
        baselines = manifest.baselines
        split = manifest.data_source.get("split")  # {"train": rows, …} as training wrote it
        train_rows = (int(split.get("train", 0)) if isinstance(split, dict) else 0) or 1000
        self._ranks = []  # (histogram child, value edges as a list, vector column)
        for column, feat in enumerate(preprocessing.feature_schema.numeric):
            base = baselines.get(feat.name)
            if base and base.get("kind") == "numeric":
                edges = self._declare_rank(feat.name, np.asarray(base["quantiles"]), train_rows)
                self._ranks.append((metrics.labelled(metrics.DRIFT_RANK, name, feat.name), edges, column))
        # the same edges and columns as arrays, for observe_many
        self._rank_edges = [np.asarray(edges, dtype=np.float64) for _, edges, _ in self._ranks]
        self._rank_columns = [column for _, _, column in self._ranks]
        names = preprocessing.feature_names
        self._categorical = []  # (one counter per one-hot slot, the slots' vector columns)
        for category_feature in preprocessing.feature_schema.categorical:
            base = baselines.get(category_feature.name)
            if not base or base.get("kind") != "categorical":
                continue
            slots = [(j, n.split("=", 1)[1]) for j, n in enumerate(names) if n.startswith(category_feature.name + "=")]
            for _, category in slots:
                metrics.DRIFT_CATEGORY_BASELINE.labels(name, category_feature.name, category).set(
                    float(base["frequencies"].get(category, 0.0))
                )
            metrics.DRIFT_BASELINE_ROWS.labels(name, category_feature.name).set(train_rows)
            self._categorical.append(
                (
                    tuple(metrics.labelled(metrics.DRIFT_CATEGORY, name, category_feature.name, c) for _, c in slots),
                    tuple(j for j, _ in slots),
                )
            )
        score = score_entry.manifest.baselines.get(SCORE_BASELINE)
        self._score = None
        if score:
            edges = self._declare_rank(SCORE, np.asarray(score["quantiles"]), int(score["n"]))
            # (histogram child, edges as a list for observe, the same as an array for observe_many)
            self._score = (
                metrics.labelled(metrics.DRIFT_RANK, name, SCORE),
                edges,
                np.asarray(edges, dtype=np.float64),
            )
        self._probes = []  # (counter, band low, threshold)
        for band in policy.bands[1:]:
            t, label = band.min_probability, f"{band.min_probability:g}"
            self._probes.append((metrics.labelled(metrics.NEAR_THRESHOLD, name, label), t - PROBE_BAND_WIDTH, t))
            if score:
                q = np.asarray(score["quantiles"], dtype=np.float64)
                share = np.diff(baseline_cdf(np.array([t - PROBE_BAND_WIDTH, t]), q, "left"))[0]
                metrics.NEAR_THRESHOLD_BASELINE.labels(name, label).set(float(share))

    def _declare_rank(self, feature: str, quantiles: np.ndarray, rows: int) -> list[float]:
        edges, baseline = rank_edges(quantiles)
        for le, value in zip(metrics.RANK_BUCKET_LABELS, baseline):
            metrics.DRIFT_RANK_BASELINE.labels(self.model_name, feature, le).set(float(value))
        metrics.DRIFT_BASELINE_ROWS.labels(self.model_name, feature).set(rows)
        return edges.tolist()

    def observe(self, vector: np.ndarray, score: float) -> None:
        """Counts one decision: its ``[n_features] float32`` vector and calibrated probability."""
        values = vector.tolist()  # plain floats: bisect and comparisons beat numpy calls on one row
        for child, edges, column in self._ranks:
            child.observe(metrics.RANK_OBSERVED[bisect.bisect_left(edges, values[column])])
        for counters, columns in self._categorical:
            for counter, column in zip(counters, columns):
                if values[column] > 0.5:  # the one set slot of the one-hot
                    counter.inc()
                    break
        if self._score is not None:
            child, edges, _ = self._score
            child.observe(metrics.RANK_OBSERVED[bisect.bisect_left(edges, score)])
        for child, low, high in self._probes:
            if low <= score < high:
                child.inc()

    def observe_many(self, vectors: np.ndarray, scores: np.ndarray) -> None:
        """Counts many decisions at once, exactly as :meth:`observe` row by row would (the
        histograms' sums aside, which may differ in their last bits by the order of addition).

        Args:
            vectors: ``[rows, n_features] float32``. scores: ``[rows] float64`` calibrated probabilities.
        """
        if len(scores) < 8:  # a few rows: NumPy's per-call cost would exceed observing them one by one
            for vector, score in zip(vectors, scores.tolist()):
                self.observe(vector, score)
            return
        if self._ranks:  # every rank feature's buckets counted by one bincount
            values = np.ascontiguousarray(vectors[:, self._rank_columns].T, dtype=np.float64)  # [features, rows]
            values[np.isnan(values)] = -np.inf  # bucket 0, where bisect_left in observe() puts NaN (searchsorted: last)
            buckets = np.empty(values.shape, dtype=np.intp)
            for k, edges in enumerate(self._rank_edges):
                buckets[k] = edges.searchsorted(values[k], side="left")
            width = len(metrics.RANK_OBSERVED)
            buckets += np.arange(0, width * len(buckets), width)[:, None]  # feature k's buckets at k * width
            counts = np.bincount(buckets.ravel(), minlength=width * len(buckets)).reshape(-1, width).tolist()
            for (child, _, _), row in zip(self._ranks, counts):
                _observe_counts(child, row)
        for counters, columns in self._categorical:
            hot = vectors[:, list(columns)] > 0.5
            first = np.where(hot.any(axis=1), hot.argmax(axis=1), -1)  # the first set slot, as observe() breaks there
            for slot, n in enumerate(np.bincount(first + 1, minlength=len(counters) + 1)[1:].tolist()):
                if n:
                    counters[slot].inc(n)
        if self._score is not None:
            child, _, edge_array = self._score
            buckets = edge_array.searchsorted(scores, side="left")
            _observe_counts(child, np.bincount(buckets, minlength=len(metrics.RANK_OBSERVED)).tolist())
        for child, low, high in self._probes:
            n = int(np.count_nonzero((scores >= low) & (scores < high)))
            if n:
                child.inc(n)


def _observe_counts(child, counts: list[int]) -> None:
    """Observes ``metrics.RANK_OBSERVED[b]`` ``counts[b]`` times for each bucket ``b`` (0 … 19) of
    a rank histogram child: one increment per bucket instead of one observe per row.
    ``RANK_OBSERVED[b]`` is bucket ``b``'s own upper bound (the last: above every bound), so
    each count lands in the bucket ``observe`` would choose."""
    child._raise_if_not_observable()
    child._sum.inc(float(np.dot(counts, metrics.RANK_OBSERVED)))
    for bucket, n in zip(child._buckets, counts):
        if n:
            bucket.inc(n)
