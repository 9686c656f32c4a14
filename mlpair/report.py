"""The demo's picture: one PNG, a row per model family; and the outcomes report's (:func:`write_outcomes_report`).

Columns: ROC curve of the served probabilities beside the logistic-regression baseline on the same
split; reliability diagram before (softmax of the raw
logits) and after calibration, with the 15 equal-width bins the ECE uses; decision
distribution; client-side Predict latency histogram. matplotlib is imported here only, never
by the services.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlpair.contracts.metrics import expected_calibration_error, reliability_curve, roc_auc, roc_curve


@dataclass(frozen=True)
class FamilyReport:
    """What one family's row shows."""

    name: str
    labels: np.ndarray  # [n] 0/1 holdout outcomes
    uncalibrated: np.ndarray  # [n] softmax of the raw logits
    calibrated: np.ndarray  # [n] probabilities PredictionService returned
    decisions: dict[str, int]  # decision label → count
    latencies_ms: np.ndarray  # client-side Predict latencies
    baseline: np.ndarray  # [n] P(positive) of logistic regression fitted on the same training split
    concurrency: int  # Predict calls in flight while latencies_ms was measured


def write_report(families: list[FamilyReport], path: Path) -> Path:
    """Draws the report and writes it as PNG to ``path``; returns ``path``."""
    fig, axes = _pyplot().subplots(len(families), 4, figsize=(18, 4.2 * len(families)), squeeze=False)
    for row, fam in zip(axes, families):
        _roc(row[0], fam)
        _reliability(row[1], fam)
        _decisions(row[2], fam)
        _latency(row[3], fam)
    return _save(fig, "mlpair demo: holdout scored through PredictionService", 14, 0.97, path)


def _pyplot():
    """matplotlib's pyplot, drawing to files only (the Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, title: str, fontsize: int, top: float, path: Path) -> Path:
    """Titles ``fig`` (the plots below ``top``, a fraction of its height), writes it as PNG to
    ``path`` and closes it; returns ``path``."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def _roc(ax, fam: FamilyReport) -> None:
    fpr, tpr = roc_curve(fam.labels, fam.calibrated)
    ax.plot(fpr, tpr, lw=2, label=f"served model: ROC AUC {roc_auc(fam.labels, fam.calibrated):.3f}")
    fpr, tpr = roc_curve(fam.labels, fam.baseline)
    ax.plot(
        fpr, tpr, lw=1.2, c="tab:orange", label=f"logistic regression: ROC AUC {roc_auc(fam.labels, fam.baseline):.3f}"
    )
    ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1)
    _unit_square(ax, f"{fam.name}: ROC curve (n = {len(fam.labels)})", "false positive rate", "true positive rate")
    ax.legend(loc="lower right")


def _unit_square(ax, title: str, xlabel: str, ylabel: str) -> None:
    """Titles a plot of one rate or probability against another, both axes over [0, 1]."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, xlim=(0, 1), ylim=(0, 1))


def _reliability(ax, fam: FamilyReport) -> None:
    ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="perfect calibration")
    for probs, name, marker in ((fam.uncalibrated, "before", "s"), (fam.calibrated, "after", "o")):
        curve = reliability_curve(fam.labels, probs)
        filled = curve["count"] > 0
        ece = expected_calibration_error(fam.labels, probs)
        ax.plot(
            curve["mean_probability"][filled],
            curve["frequency"][filled],
            marker=marker,
            lw=1.5,
            label=f"{name} calibration (ECE {ece:.3f})",
        )
    _unit_square(ax, f"{fam.name}: reliability (15 bins)", "mean predicted probability", "observed frequency")
    ax.legend(loc="upper left")


def _decisions(ax, fam: FamilyReport) -> None:
    names = list(fam.decisions)
    counts = [fam.decisions[n] for n in names]
    bars = ax.bar(names, counts, color="tab:blue")
    ax.bar_label(bars, labels=[f"{c} ({c / max(sum(counts), 1):.0%})" for c in counts])
    ax.set(title=f"{fam.name}: decisions", ylabel="holdout entities")
    ax.margins(y=0.15)


def _latency(ax, fam: FamilyReport) -> None:
    lat = fam.latencies_ms
    ax.hist(lat, bins=40, color="tab:green")
    for q, style in ((50, "-"), (99, "--")):
        value = float(np.percentile(lat, q))
        ax.axvline(value, c="black", ls=style, lw=1, label=f"p{q} {value:.1f} ms")
    ax.set(title=f"{fam.name}: Predict latency, {fam.concurrency} in flight", xlabel="ms (client side)", ylabel="calls")
    ax.legend(loc="upper right")


@dataclass(frozen=True)
class OutcomeRow:
    """One family and model version's decisions joined with their realised outcomes."""

    family: str
    model_version: str
    labels: np.ndarray  # [n] 0/1 realised outcomes (1: the positive class)
    probabilities: np.ndarray  # [n] calibrated probabilities of the decisions
    holdout_roc_auc: float | None  # the version's holdout figures (its manifest), when known
    holdout_ece: float | None
    thresholds: tuple[float, ...] = ()  # the policy's operating thresholds, drawn on the reliability plot


def write_outcomes_report(rows: list[OutcomeRow], path: Path) -> Path:
    """Draws realised ROC and reliability curves, one row per family and version, as PNG to ``path``."""
    fig, axes = _pyplot().subplots(len(rows), 2, figsize=(10, 4.2 * len(rows)), squeeze=False)
    for (roc_ax, rel_ax), row in zip(axes, rows):
        name = f"{row.family} v{row.model_version}"
        holdout = "" if row.holdout_roc_auc is None else f" (holdout {row.holdout_roc_auc:.3f})"
        fpr, tpr = roc_curve(row.labels, row.probabilities)
        roc_ax.plot(fpr, tpr, lw=2, label=f"realised ROC AUC {roc_auc(row.labels, row.probabilities):.3f}{holdout}")
        roc_ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1)
        _unit_square(
            roc_ax, f"{name}: ROC on outcomes (n = {len(row.labels)})", "false positive rate", "true positive rate"
        )
        roc_ax.legend(loc="lower right")
        curve = reliability_curve(row.labels, row.probabilities)
        filled = curve["count"] > 0
        ece = expected_calibration_error(row.labels, row.probabilities)
        held = "" if row.holdout_ece is None else f" (holdout {row.holdout_ece:.3f})"
        rel_ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="perfect calibration")
        rel_ax.plot(
            curve["mean_probability"][filled],
            curve["frequency"][filled],
            marker="o",
            label=f"realised ECE {ece:.3f}{held}",
        )
        for t in row.thresholds:
            rel_ax.axvline(t, c="tab:red", lw=0.8, ls=":")
        _unit_square(rel_ax, f"{name}: reliability on outcomes", "mean predicted probability", "observed frequency")
        rel_ax.legend(loc="upper left")
    return _save(fig, "mlpair: realised performance on fed-back outcomes", 13, 0.96, path)
