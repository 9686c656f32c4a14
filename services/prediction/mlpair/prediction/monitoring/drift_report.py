"""Drift reports: the verdicts of one model family's window (:class:`DriftReport`), rebuilt from a
PredictionService's Prometheus exposition (what ``mlpair drift-report`` reads) and rendered as text
or strict JSON.

The monitor that computes them is :mod:`mlpair.prediction.monitoring.drift`; the statistics are in
:mod:`mlpair.prediction.monitoring.drift_statistics`. This module imports neither (nor SciPy), so the command
line reads a report without loading the serving side.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.samples import Sample


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
    model_version: str  # empty when unknown: the gauges reports_from_metrics reads carry no version
    window_rows: int
    min_rows: int
    alpha: float  # family-wise significance level
    corrected_alpha: float  # alpha / number of tests (Bonferroni)
    features: tuple[TestResult, ...]
    score: TestResult | None

    @property
    def drifted_features(self) -> list[str]:
        """The features whose test reported drift, in test order."""
        return [t.feature for t in self.features if t.drifted]

    @property
    def judged(self) -> bool:
        """Whether the window held enough decisions (``min_rows``) for a verdict."""
        return self.window_rows >= self.min_rows

    @property
    def drifted(self) -> bool:
        """True when any feature or the score drifted."""
        return bool(self.drifted_features) or bool(self.score and self.score.drifted)

    @property
    def idle(self) -> bool:
        """Whether the family has had no traffic: no decision in its window."""
        return self.window_rows == 0

    @property
    def verdict(self) -> str:
        """``"drift"``, ``"no drift"``, ``"no traffic"`` (no decision in the window) or ``"too few
        decisions"`` (fewer than ``min_rows``): the last two are no verdict."""
        if self.idle:
            return "no traffic"
        if not self.judged:
            return "too few decisions"
        return "drift" if self.drifted else "no drift"

    def to_dict(self) -> dict[str, Any]:
        """Every field, plus the ``verdict``, ``judged``, ``drifted`` and ``drifted_features``, ready for
        strict JSON: a non-finite number (a value the metrics lacked) is None, and ``model_version``
        is left out when unknown (empty)."""
        fields = {k: v for k, v in asdict(self).items() if k != "model_version" or v}
        verdicts = {
            "verdict": self.verdict,
            "judged": self.judged,
            "drifted": self.drifted,
            "drifted_features": self.drifted_features,
        }
        return _finite_or_none({**fields, **verdicts})


def to_json(reports: list[DriftReport]) -> str:
    """The reports as strict JSON (RFC 8259, which has no NaN or Infinity: ``JSON.parse`` and strict
    parsers refuse them), a list of :meth:`DriftReport.to_dict`; what ``mlpair drift-report --json``
    prints."""
    return json.dumps([r.to_dict() for r in reports], indent=2, allow_nan=False)


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float, however deeply nested, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def reports_from_metrics(text: str) -> list[DriftReport]:
    """Rebuilds drift reports from a PredictionService's Prometheus exposition text (what
    ``mlpair drift-report`` reads from its metrics port).

    A value whose gauge is absent reads as NaN. ``alpha`` is not exported: it is derived as
    ``prediction_drift_corrected_alpha`` × the number of tests reported (the Bonferroni divisor the
    monitor used: every feature test, plus the score's), rounded to 12 significant digits to undo
    the division's float rounding. ``model_version`` is empty: no drift gauge carries a version.
    """
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[Sample]] = {}
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
        corrected = one("prediction_drift_corrected_alpha")
        alpha = float(f"{corrected * max(1, len(tests) + (score is not None)):.12g}")
        reports.append(
            DriftReport(
                model,
                "",
                int(one("prediction_drift_window_rows")),
                int(min_rows) if min_rows == min_rows else 0,
                alpha,
                corrected,
                tuple(tests),
                score,
            )
        )
    return reports


def _sample_value(values: dict[str, list[Sample]], name: str, model: str, **labels: str) -> float:
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
        if r.idle:
            lines.append(f"{r.model_name}{version}: no verdict: no traffic (no decision in the window)")
            continue
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
    if not lines:
        return "no drift monitors reported (no prediction_drift_* metrics yet)"
    return "\n".join([*lines, summary(reports)])


def summary(reports: list[DriftReport]) -> str:
    """One line: the families with a verdict (which set the exit status of ``mlpair drift-report``),
    those with no traffic and those with too few decisions."""
    parts = []
    for verdict in ("drift", "no drift", "no traffic", "too few decisions"):
        names = [r.model_name for r in reports if r.verdict == verdict]
        if names:
            parts.append(f"{verdict}: {', '.join(names)}")
    judged = sum(r.judged for r in reports)
    return f"{judged} of {len(reports)} families with a verdict; " + "; ".join(parts)
