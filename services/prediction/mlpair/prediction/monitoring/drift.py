"""Drift monitor: live feature and score distributions against the model's training baselines.

Per model family, a sliding window holds the last ``window_rows`` assembled feature vectors
(after guards, transforms and standardisation: the space the model sees) and calibrated
scores. Each evaluation compares the window with the baselines training wrote into the
manifest (``mlpair.training.pipeline.baselines``):

- **numeric features**: two-sample Kolmogorov–Smirnov test against the training quantiles
  (standardised space);
- **categorical features**: chi-square test of homogeneity against the training frequencies,
  effect size the total variation distance;
- **score**: the same KS test on the calibrated probability against the score quantiles
  training took on its calibration split (manifest key ``"__score__"``), when present.

The statistics and their sources are in :mod:`mlpair.prediction.monitoring.drift_statistics`; the report
each evaluation yields (and ``mlpair drift-report`` reads back from the gauges) is in
:mod:`mlpair.prediction.monitoring.drift_report`.

A test reports drift only when both hold: its effect size exceeds the threshold (KS 0.15 by
default, docs/design.md's alarm) *and* its p-value is below ``alpha / k`` — Bonferroni over the
k tests evaluated together (Dunn 1961, "Multiple comparisons among means", JASA 56), so a window of ordinary noise across 14 tests stays quiet at a
family-wise error rate ≤ ``alpha``. Fewer than ``min_rows`` rows in the window: no verdict.

Observing costs one row copy into a ring buffer (the hot path); evaluating runs off the
event loop every ``interval_s`` and sets the ``prediction_drift_*`` gauges.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlpair.background import stop_task
from mlpair.contracts.manifest import SCORE_BASELINE, ModelEntry
from mlpair.prediction import metrics
from mlpair.prediction.monitoring.drift_report import DriftReport, TestResult
from mlpair.prediction.monitoring.drift_statistics import chi2_against_frequencies, ks_against_quantiles

if TYPE_CHECKING:
    from mlpair.prediction.families import ModelFamily
    from mlpair.prediction.monitoring.signals import FamilySignals
    from mlpair.prediction.settings import PredictionSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriftConfig:
    """Window and thresholds (see the module docstring for where each comes from)."""

    window_rows: int = 1000
    min_rows: int = 200
    ks_threshold: float = 0.15
    categorical_threshold: float = 0.15
    alpha: float = 0.01


def _train_rows(data_source: Mapping[str, object]) -> int:
    """Training rows the manifest's data source records (``{"split": {"train": n}}``); 0 if absent."""
    split = data_source.get("split")
    train = split.get("train", 0) if isinstance(split, Mapping) else 0
    return int(train) if isinstance(train, (int, float, str)) else 0


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
        self.train_rows = _train_rows(manifest.data_source) or 1000
        names = preprocessing.feature_names
        baselines = manifest.baselines
        # (feature, column, quantiles) and (feature, columns, frequencies)
        self._numeric: list[tuple[str, int, np.ndarray]] = []
        self._categorical: list[tuple[str, list[int], np.ndarray]] = []
        for i, numeric in enumerate(preprocessing.feature_schema.numeric):
            base = baselines.get(numeric.name)
            if base and base.get("kind") == "numeric":
                self._numeric.append((numeric.name, i, np.asarray(base["quantiles"], dtype=np.float64)))
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
    distribution signals every replica contributes to (:mod:`mlpair.prediction.monitoring.signals`)."""

    def __init__(
        self, monitors: Mapping[str, DriftMonitor], signals: Mapping[str, FamilySignals] | None = None
    ) -> None:
        self.monitors = dict(monitors)
        self.signals = dict(signals or {})
        self._task: asyncio.Task | None = None

    @classmethod
    def for_families(cls, families: Mapping[str, ModelFamily], config: DriftConfig) -> DriftMonitors:
        """Monitors and signals of the served families; the score's reference is the deciding
        (first) member's, the features' the family's pinned version's. Sets the static gauges
        (thresholds, Bonferroni level, baselines) at once, so the rules can use them before the
        first evaluation."""
        from mlpair.prediction.monitoring.signals import FamilySignals

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

    def _sinks(self, model_name: str) -> list[DriftMonitor | FamilySignals]:
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
        """Cancels the periodic evaluation started by :meth:`start` and waits for it to end; no-op when none runs."""
        await stop_task(self._task)
        self._task = None


def drift_config(settings: PredictionSettings) -> DriftConfig:
    """The drift window and thresholds from ``PredictionSettings`` (``drift_*`` fields)."""
    return DriftConfig(
        window_rows=settings.drift_window_rows,
        min_rows=settings.drift_min_rows,
        ks_threshold=settings.drift_ks_threshold,
        categorical_threshold=settings.drift_categorical_threshold,
        alpha=settings.drift_alpha,
    )
