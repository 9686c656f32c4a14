"""Explanations by occlusion: how much each feature moved this decision's probability.

For one assembled row ``x`` the explanation rows are ``x`` itself followed by one copy per
schema feature with that feature set to its schema default (the training median or mode; a
categorical feature's whole one-hot block is replaced). All of them go to InferenceService in
the same batched call as the row itself, so an explanation costs one call of ``1 + K`` rows.
The contribution of feature k is ``p(x) - p(x with k at its default)`` in calibrated
probability units (occlusion / "leave-one-covariate-out": Zeiler & Fergus, ECCV 2014; Lei et
al., JASA 2018). Contributions need not add up to anything; a feature already at its default
contributes exactly 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlpair.contracts.schema import FeatureSchema, reason_prefix
from mlpair.prediction import metrics

if TYPE_CHECKING:
    from mlpair.prediction.families import ModelFamily

# Contributions below half a percentage point are not worth a reader's attention.
MIN_REASON_CONTRIBUTION = 0.005


@dataclass(frozen=True, slots=True)
class Contribution:
    """One feature's effect on the calibrated probability."""

    feature: str
    contribution: float  # probability units, in [-1, 1]; > 0 raised the probability
    reason_code: str
    text: str


@dataclass(frozen=True, slots=True)
class Explanation:
    """Every feature's contribution (largest magnitude first) and the top reasons as sentences."""

    contributions: tuple[Contribution, ...]
    top_reasons: tuple[str, ...]


def explain(schema: FeatureSchema, probability: float, occluded: np.ndarray, top_k: int) -> Explanation:
    """Builds the explanation from the calibrated probabilities of the explanation rows.

    Args:
        schema: the family's feature schema (labels and outcome phrase).
        probability: calibrated probability of the row itself.
        occluded: ``[n_schema_features]`` calibrated probabilities of the occluded rows, schema order.
        top_k: how many top reasons to phrase.

    Returns:
        Contributions for every feature, largest magnitude first (ties in schema order), and
        up to ``top_k`` reasons whose contribution is at least half a percentage point.
    """
    outcome = schema.target.outcome_phrase
    outcome_code = reason_prefix(outcome)
    items = []
    for feature, p_without in zip(schema.features, occluded):
        c = float(probability - p_without)
        verb = "raised" if c > 0 else "lowered" if c < 0 else "did not change"
        code = f"{reason_prefix(feature.name)}_{'RAISES' if c > 0 else 'LOWERS' if c < 0 else 'KEEPS'}_{outcome_code}"
        text = f"{feature.display} {verb} the {outcome}"
        if c != 0:
            text += f" by {abs(c) * 100:.1f} points"
        items.append(Contribution(feature.name, c, code, text))
    ordered = tuple(sorted(items, key=lambda it: -abs(it.contribution)))  # stable: ties keep schema order
    top = tuple(it.text for it in ordered if abs(it.contribution) >= MIN_REASON_CONTRIBUTION)[:top_k]
    return Explanation(ordered, top)


def explain_rows(
    family: ModelFamily,
    occluded: Mapping[int, np.ndarray],
    rows: Sequence[int],
    probability: Sequence[float | None],
    top_k: int,
) -> dict[int, Explanation]:
    """Decided row → its explanation, for the decided rows ``rows`` (group rows) explained with
    model output: ``occluded`` holds, per group row with every occlusion scored, the members'
    calibrated probabilities of its occluded rows ``[n_members, n_schema_features]`` (averaged
    over members); ``probability`` the decided rows' probabilities (None: no model output)."""
    explanations: dict[int, Explanation] = {}
    if not occluded:
        return explanations
    for j, k in enumerate(rows):
        p = probability[j]  # None: no model output (in without_model), nothing to explain
        if k in occluded and p is not None:
            explanations[j] = explain(family.schema, p, occluded[k].mean(axis=0), top_k)
    if explanations:
        metrics.EXPLANATIONS.labels(family.name).inc(len(explanations))
    return explanations
