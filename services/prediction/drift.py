"""Drift monitor: live feature and score distributions against the model's training baselines.

Per model family, a sliding window holds the last ``window_rows`` assembled feature vectors
(after guards, transforms and standardisation: the space the model sees) and calibrated
scores. Each evaluation compares the window with the baselines training wrote into the
manifest (``mlpair.training.pipeline.baselines``):

- **numeric features**: two-sample Kolmogorov–Smirnov test against the training quantiles
  (standardised space). The statistic D is the largest gap between the window's empirical
  CDF and the training CDF, read piecewise-linearly between its quantiles (exact at ties, so
  discrete features such as loan term are not penalised); the p-value is the asymptotic
  two-sample one, ``kstwo.sf(D, round(n·m/(n+m)))`` with m the training rows, as in
  ``scipy.stats.ks_2samp(method="asymp")`` (Hodges 1958).
- **categorical features**: chi-square test of homogeneity (``scipy.stats.chi2_contingency``)
  between window counts and training counts (frequency × training rows), categories with an
  expected count below 5 pooled (Cochran's rule); effect size is the total variation distance
  between the two frequency vectors (for a two-category feature it equals the KS statistic).
- **score**: the same KS test on the calibrated probability against the score quantiles
  training took on its calibration split (manifest key ``"__score__"``), when present.

A test reports drift only when both hold: its effect size exceeds the threshold (KS 0.15 by
default, docs/design.md's alarm) *and* its p-value is below ``alpha / k`` — Bonferroni over the
k tests evaluated together, so a window of ordinary noise across 14 tests stays quiet at a
family-wise error rate ≤ ``alpha``. Fewer than ``min_rows`` rows in the window: no verdict.

Observing costs one row copy into a ring buffer (the hot path); evaluating runs off the
event loop every ``interval_s`` and sets the ``prediction_drift_*`` gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

# at import, not on first use: importing scipy.stats takes ~0.5 s holding the GIL, which would
# stall the serving event loop at the first drift report under load
from scipy.stats import chi2_contingency, kstwo

from mlpair.contracts.manifest import SCORE_BASELINE, ModelEntry
from mlpair.prediction import metrics

if TYPE_CHECKING:
    from mlpair.prediction.families import ModelFamily
    from mlpair.prediction.signals import FamilySignals

logger = logging.getLogger(__name__)

MIN_EXPECTED_COUNT = 5.0  # Cochran's rule for chi-square cells
# Training rounds baseline quantiles to 6 decimals; window values are rounded the same way so
# an atom (e.g. every applicant with no debt) sits at exactly the same point in both.
BASELINE_DECIMALS = 6


@dataclass(frozen=True)
class DriftConfig:
    """Window and thresholds (see the module docstring for where each comes from)."""

    window_rows: int = 1000
    min_rows: int = 200
    ks_threshold: float = 0.15
    categorical_threshold: float = 0.15
    alpha: float = 0.01


@dataclass(frozen=True)
class TestResult:
    """One feature's (or the score's) drift test over the window."""

    feature: str
    test: str  # "ks" or "chi2"
    statistic: float  # effect size: KS D, or total variation distance for chi2
    p_value: float
    threshold: float
    drifted: bool


@dataclass(frozen=True)
class DriftReport:
    """All tests of one model family's window, evaluated together."""

    model_name: str
    model_version: str
    window_rows: int
    min_rows: int
    alpha: float
    corrected_alpha: float  # alpha / number of tests (Bonferroni)
    features: tuple[TestResult, ...]
    score: TestResult | None

    @property
    def drifted_features(self) -> list[str]:
        return [t.feature for t in self.features if t.drifted]

    @property
    def judged(self) -> bool:
        """Whether the window held enough decisions (``min_rows``) for a verdict."""
        return self.window_rows >= self.min_rows

    @property
    def drifted(self) -> bool:
        """True when any feature or the score drifted."""
        return bool(self.drifted_features) or bool(self.score and self.score.drifted)

    def to_dict(self) -> dict:
        return {**asdict(self), "drifted": self.drifted, "drifted_features": self.drifted_features}


def baseline_cdf(points: np.ndarray, quantiles: np.ndarray, side: str = "right") -> np.ndarray:
    """The training CDF given by ``quantiles`` ``[k]`` (at evenly spaced levels 0 … 1), at ``points``.

    Linear between distinct quantiles; a value repeated in the quantiles is an atom where the CDF
    jumps: ``side="right"`` gives F(p) = P(X ≤ p), ``side="left"`` the limit from the left,
    P(X < p).

    Returns:
        ``[len(points)] float64`` in [0, 1].
    """
    q = np.asarray(quantiles, dtype=np.float64)
    points = np.asarray(points, dtype=np.float64)
    k = len(q)
    levels = np.linspace(0.0, 1.0, k)
    j = np.searchsorted(q, points, side=side)  # q[j-1] ≤ p < q[j] (right) or q[j-1] < p ≤ q[j] (left)
    lo, hi = np.clip(j - 1, 0, k - 1), np.clip(j, 0, k - 1)
    gap = q[hi] - q[lo]
    frac = np.divide(points - q[lo], gap, out=np.zeros_like(points), where=gap > 0)
    cdf = levels[lo] + frac * (levels[hi] - levels[lo])
    return np.where(j == 0, 0.0, np.where(j == k, 1.0, cdf))


def ks_against_quantiles(sample: np.ndarray, quantiles: np.ndarray, reference_rows: int) -> tuple[float, float]:
    """Two-sample KS statistic and p-value of ``sample`` ``[n]`` against a reference given by
    its quantiles ``[k]`` at evenly spaced levels 0 … 1, taken from ``reference_rows`` rows.

    The reference CDF is linear between quantiles and jumps at repeated quantiles (atoms);
    D is evaluated at every sample point and knot, from both sides, so it is exact for that CDF.
    Sample values are rounded to the baseline's 6 decimals first, so shared atoms coincide.
    """
    x = np.sort(np.asarray(sample, dtype=np.float64).round(BASELINE_DECIMALS))
    q = np.asarray(quantiles, dtype=np.float64)
    n = len(x)
    if n == 0:
        return 0.0, 1.0
    points = np.unique(np.concatenate([x, q]))
    sample_right = np.searchsorted(x, points, side="right") / n
    sample_left = np.searchsorted(x, points, side="left") / n
    d = float(
        max(
            np.abs(sample_right - baseline_cdf(points, q, "right")).max(),
            np.abs(sample_left - baseline_cdf(points, q, "left")).max(),
        )
    )
    effective = max(1, round(n * reference_rows / (n + reference_rows)))
    return d, float(kstwo.sf(d, effective))


def chi2_against_frequencies(
    counts: np.ndarray, frequencies: np.ndarray, reference_rows: int
) -> tuple[float, float, float]:
    """Chi-square test of homogeneity of window ``counts`` ``[c]`` against training
    ``frequencies`` ``[c]`` (summing to 1) from ``reference_rows`` rows.

    Returns:
        (chi-square statistic, p-value, total variation distance in [0, 1]).
    """
    observed = np.asarray(counts, dtype=np.float64)
    reference = np.asarray(frequencies, dtype=np.float64) * reference_rows
    n = observed.sum()
    if n == 0:
        return 0.0, 1.0, 0.0
    tv = 0.5 * float(np.abs(observed / n - reference / reference.sum()).sum())
    table = np.vstack([observed, reference])
    table = table[:, table.sum(axis=0) > 0]
    expected_small = table.sum(axis=0) * min(n, reference.sum()) / table.sum() < MIN_EXPECTED_COUNT
    if expected_small.any():
        pooled = table[:, expected_small].sum(axis=1, keepdims=True)
        table = np.hstack([table[:, ~expected_small], pooled])
    if table.shape[1] < 2:
        return 0.0, 1.0, tv
    chi2, p, _, _ = chi2_contingency(table, correction=False)
    return float(chi2), float(p), tv


class DriftMonitor:
    """The sliding window and tests of one model family.

    Args:
        entry: the model entry whose manifest baselines and preprocessing define the reference.
        config: window size and thresholds.
        score_entry: the version whose calibration-split scores are the score's reference (the
            one that decides); default ``entry``.
    """

    def __init__(
        self, entry: ModelEntry, config: DriftConfig = DriftConfig(), score_entry: ModelEntry | None = None
    ) -> None:
        manifest, preprocessing = entry.manifest, entry.preprocessing
        self.model_name = manifest.model_name
        self.model_version = manifest.model_version
        self.config = config
        self.train_rows = int(manifest.data_source.get("split", {}).get("train", 0)) or 1000
        names = preprocessing.feature_names
        baselines = manifest.baselines
        # (feature, column, quantiles) and (feature, columns, frequencies)
        self._numeric: list[tuple[str, int, np.ndarray]] = []
        self._categorical: list[tuple[str, list[int], np.ndarray]] = []
        for i, feat in enumerate(preprocessing.feature_schema.numeric):
            base = baselines.get(feat.name)
            if base and base.get("kind") == "numeric":
                self._numeric.append((feat.name, i, np.asarray(base["quantiles"], dtype=np.float64)))
        for feat in preprocessing.feature_schema.categorical:
            base = baselines.get(feat.name)
            if not base or base.get("kind") != "categorical":
                continue
            cols = [j for j, name in enumerate(names) if name.startswith(feat.name + "=")]
            freq = np.array([base["frequencies"].get(names[j].split("=", 1)[1], 0.0) for j in cols])
            self._categorical.append((feat.name, cols, freq / freq.sum()))
        score = (score_entry or entry).manifest.baselines.get(SCORE_BASELINE)
        self._score = (np.asarray(score["quantiles"], dtype=np.float64), int(score["n"])) if score else None
        missing = (
            set(preprocessing.feature_schema.attribute_names)
            - {f for f, *_ in self._numeric}
            - {f for f, *_ in self._categorical}
        )
        if missing or self._score is None:
            logger.warning(
                "drift baselines missing in %s version %s for: %s",
                self.model_name,
                self.model_version,
                ", ".join(sorted(missing) + ([] if self._score else ["score"])),
            )
        self._x = np.zeros((config.window_rows, preprocessing.n_features), dtype=np.float32)
        self._scores = np.zeros(config.window_rows, dtype=np.float64)
        self._next = 0
        self._rows = 0

    @property
    def tests(self) -> int:
        """Number of tests evaluated together (the Bonferroni divisor)."""
        return len(self._numeric) + len(self._categorical) + (1 if self._score is not None else 0)

    def observe(self, vector: np.ndarray, score: float) -> None:
        """Adds one decision: its ``[n_features] float32`` vector and calibrated probability."""
        i = self._next
        self._x[i] = vector
        self._scores[i] = score
        self._next = (i + 1) % self.config.window_rows
        self._rows = min(self._rows + 1, self.config.window_rows)

    def observe_many(self, vectors: np.ndarray, scores: np.ndarray) -> None:
        """Adds many decisions in order: ``[rows, n_features] float32`` and ``[rows]`` probabilities."""
        if len(scores) < 8:  # a few rows: NumPy's per-call cost would exceed adding them one by one
            for vector, score in zip(vectors, scores.tolist()):
                self.observe(vector, score)
            return
        window, total = self.config.window_rows, len(scores)
        skipped = max(0, total - window)  # only the newest fit: they land where row-by-row adding puts them
        at = (self._next + skipped + np.arange(total - skipped)) % window
        self._x[at] = vectors[skipped:]
        self._scores[at] = scores[skipped:]
        self._next = (self._next + total) % window
        self._rows = min(self._rows + total, window)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the window's rows ``[rows, n_features]`` and scores ``[rows]`` (cheap; call
        on the thread that observes, then evaluate the copies anywhere)."""
        return self._x[: self._rows].copy(), self._scores[: self._rows].copy()

    def report(self, window: tuple[np.ndarray, np.ndarray] | None = None) -> DriftReport:
        """Evaluates every test on ``window`` (default: a snapshot of the current window)."""
        x, scores = window if window is not None else self.snapshot()
        cfg, rows = self.config, len(scores)
        corrected = cfg.alpha / max(1, self.tests)
        enough = rows >= cfg.min_rows

        def verdict(effect: float, p: float, threshold: float) -> bool:
            return enough and effect > threshold and p < corrected

        results = []
        for name, col, quantiles in self._numeric:
            d, p = ks_against_quantiles(x[:, col], quantiles, self.train_rows)
            results.append(TestResult(name, "ks", d, p, cfg.ks_threshold, verdict(d, p, cfg.ks_threshold)))
        for name, cols, freq in self._categorical:
            _, p, tv = chi2_against_frequencies(x[:, cols].sum(axis=0), freq, self.train_rows)
            results.append(
                TestResult(name, "chi2", tv, p, cfg.categorical_threshold, verdict(tv, p, cfg.categorical_threshold))
            )
        score = None
        if self._score is not None:
            d, p = ks_against_quantiles(scores, self._score[0], self._score[1])
            score = TestResult("score", "ks", d, p, cfg.ks_threshold, verdict(d, p, cfg.ks_threshold))
        return DriftReport(
            self.model_name, self.model_version, rows, cfg.min_rows, cfg.alpha, corrected, tuple(results), score
        )


def export(report: DriftReport) -> None:
    """Sets the ``prediction_drift_*`` gauges from a report."""
    model = report.model_name
    metrics.DRIFT_WINDOW_ROWS.labels(model).set(report.window_rows)
    metrics.DRIFT_MIN_ROWS.labels(model).set(report.min_rows)
    metrics.DRIFT_CORRECTED_ALPHA.labels(model).set(report.corrected_alpha)
    for t in (*report.features, *([report.score] if report.score else [])):
        metrics.DRIFT_THRESHOLD.labels(model, t.test).set(t.threshold)
    for t in report.features:
        metrics.DRIFT_STATISTIC.labels(model, t.feature, t.test).set(t.statistic)
        metrics.DRIFT_P_VALUE.labels(model, t.feature, t.test).set(t.p_value)
        metrics.DRIFT_DETECTED.labels(model, t.feature).set(int(t.drifted))
    if report.score is not None:
        metrics.SCORE_DRIFT_STATISTIC.labels(model).set(report.score.statistic)
        metrics.SCORE_DRIFT_P_VALUE.labels(model).set(report.score.p_value)
        metrics.SCORE_DRIFT_DETECTED.labels(model).set(int(report.score.drifted))


class DriftMonitors:
    """The monitors of every served model family, the periodic evaluation task, and the
    distribution signals every replica contributes to (:mod:`mlpair.prediction.signals`)."""

    def __init__(
        self, monitors: Mapping[str, DriftMonitor], signals: Mapping[str, FamilySignals] | None = None
    ) -> None:
        self.monitors = dict(monitors)
        self.signals = dict(signals or {})
        self._task: asyncio.Task | None = None

    @classmethod
    def for_entries(cls, entries: Mapping[str, ModelEntry], config: DriftConfig) -> DriftMonitors:
        return cls({name: DriftMonitor(entry, config) for name, entry in entries.items()})

    @classmethod
    def for_families(cls, families: Mapping[str, ModelFamily], config: DriftConfig) -> DriftMonitors:
        """Monitors and signals of the served families; the score's reference is the deciding
        (first) member's, the features' the family's pinned version's. Sets the static gauges
        (thresholds, Bonferroni level, baselines) at once, so the rules can use them before the
        first evaluation."""
        from mlpair.prediction.signals import FamilySignals

        monitors, signals = {}, {}
        for name, family in families.items():
            deciding = family.members[0].entry
            monitors[name] = monitor = DriftMonitor(family.entry, config, score_entry=deciding)
            signals[name] = FamilySignals(family.entry, deciding, family.policy)
            metrics.DRIFT_CORRECTED_ALPHA.labels(name).set(config.alpha / max(1, monitor.tests))
            metrics.DRIFT_THRESHOLD.labels(name, "ks").set(config.ks_threshold)
            metrics.DRIFT_THRESHOLD.labels(name, "chi2").set(config.categorical_threshold)
        return cls(monitors, signals)

    def observe(self, model_name: str, vector: np.ndarray, score: float) -> None:
        """Records one decision of ``model_name`` (ignored for a family without a monitor)."""
        for sink in self._sinks(model_name):
            sink.observe(vector, score)

    def observe_many(self, model_name: str, vectors: np.ndarray, scores: np.ndarray) -> None:
        """Records many decisions of ``model_name``: ``[rows, n_features] float32`` and ``[rows]``
        probabilities, as :meth:`observe` row by row would."""
        for sink in self._sinks(model_name):
            sink.observe_many(vectors, scores)

    def _sinks(self, model_name: str) -> list:
        return [s for s in (self.monitors.get(model_name), self.signals.get(model_name)) if s is not None]

    async def evaluate(self) -> list[DriftReport]:
        """Reports for every family, computed off the event loop, exported as gauges."""
        reports = []
        for monitor in self.monitors.values():
            window = monitor.snapshot()
            report = await asyncio.to_thread(monitor.report, window)
            export(report)
            reports.append(report)
            if report.drifted:
                logger.warning(
                    "drift in %s version %s over %d rows: %s",
                    report.model_name,
                    report.model_version,
                    report.window_rows,
                    ", ".join(report.drifted_features + (["score"] if report.score and report.score.drifted else [])),
                )
        return reports

    def start(self, interval_s: float) -> None:
        """Evaluates every ``interval_s`` seconds until :meth:`stop`."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.evaluate()
                except Exception:  # a failed evaluation must not stop monitoring or serving
                    logger.exception("drift evaluation failed")

        if interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(loop(), name="drift-evaluation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def drift_config(settings) -> DriftConfig:
    """The drift window and thresholds from ``PredictionSettings`` (``drift_*`` fields)."""
    return DriftConfig(
        window_rows=settings.drift_window_rows,
        min_rows=settings.drift_min_rows,
        ks_threshold=settings.drift_ks_threshold,
        categorical_threshold=settings.drift_categorical_threshold,
        alpha=settings.drift_alpha,
    )


def reports_from_metrics(text: str) -> list[DriftReport]:
    """Rebuilds drift reports from a PredictionService's Prometheus exposition text (what
    ``mlpair drift-report`` reads from its metrics port). ``alpha`` is not exported and reads
    as NaN."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("prediction_drift_", "prediction_score_drift_")):
            values[family.name] = family.samples
    models = sorted({s.labels["model"] for s in values.get("prediction_drift_window_rows", [])})
    reports = []
    for model in models:

        def one(name: str, model: str = model, **labels: str) -> float:
            return _sample_value(values, name, model, **labels)

        tests = []
        for s in values.get("prediction_drift_statistic", []):
            if s.labels["model"] != model:
                continue
            feature, test = s.labels["feature"], s.labels["test"]
            tests.append(
                TestResult(
                    feature,
                    test,
                    float(s.value),
                    one("prediction_drift_p_value", feature=feature, test=test),
                    one("prediction_drift_threshold", test=test),
                    one("prediction_drift_detected", feature=feature) == 1.0,
                )
            )
        score = None
        if any(s.labels["model"] == model for s in values.get("prediction_score_drift_statistic", [])):
            score = TestResult(
                "score",
                "ks",
                one("prediction_score_drift_statistic"),
                one("prediction_score_drift_p_value"),
                one("prediction_drift_threshold", test="ks"),
                one("prediction_score_drift_detected") == 1.0,
            )
        min_rows = one("prediction_drift_min_rows")
        reports.append(
            DriftReport(
                model,
                "",
                int(one("prediction_drift_window_rows")),
                int(min_rows) if min_rows == min_rows else 0,
                float("nan"),
                one("prediction_drift_corrected_alpha"),
                tuple(tests),
                score,
            )
        )
    return reports


def _sample_value(values: dict[str, list], name: str, model: str, **labels: str) -> float:
    """The value of the first sample of ``name`` for ``model`` with ``labels``; NaN if none."""
    for s in values.get(name, []):
        if s.labels.get("model") == model and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    return float("nan")


def render(reports: list[DriftReport]) -> str:
    """A plain-text table per model: every test, its effect size, p-value and verdict."""
    lines = []
    for r in reports:
        version = f" version {r.model_version}" if r.model_version else ""
        if not r.judged:
            lines.append(
                f"{r.model_name}{version}: no verdict: {r.window_rows} decisions in the window, "
                f"fewer than the {r.min_rows} needed"
            )
            continue
        verdict = "DRIFT" if r.drifted else "no drift"
        lines.append(
            f"{r.model_name}{version}: {verdict} over {r.window_rows} decisions "
            f"(per-test alpha {r.corrected_alpha:.2g}, Bonferroni)"
        )
        tests = (*r.features, *([r.score] if r.score else []))
        width = max([7, *(len(t.feature) for t in tests)])
        lines.append(f"  {'feature':<{width}} {'test':<5} {'effect':>7} {'threshold':>9} {'p-value':>10}  verdict")
        for t in tests:
            lines.append(
                f"  {t.feature:<{width}} {t.test:<5} {t.statistic:>7.3f} {t.threshold:>9.3f} "
                f"{t.p_value:>10.2e}  {'DRIFT' if t.drifted else 'ok'}"
            )
    return "\n".join(lines) if lines else "no drift monitors reported (no prediction_drift_* metrics yet)"
