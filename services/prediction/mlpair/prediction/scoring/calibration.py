"""Serving-side calibration: one model version's logits → probabilities PredictionService decides on.

The method and its parameters come from the model's manifest (fitted on the calibration
split by training; formulas and sources in :mod:`mlpair.contracts.calibration`): temperature
scaling by default, Platt or isotonic (isotonic only when fitted on at least 1,000 samples,
which the manifest enforces), and the inverse of label smoothing for a model trained with it.
The same code computed the manifest's holdout metrics, so served probabilities match them.

Guarantee: every probability returned is finite, in [0, 1] and non-decreasing in the
positive-class logit; anything else is refused, so no decision is ever made on it.
"""

from __future__ import annotations

import numpy as np

from mlpair.contracts import calibration
from mlpair.contracts.manifest import Manifest
from mlpair.prediction.errors import InferenceFailed


class Calibrator:
    """Applies one model version's calibration; shared by all concurrent requests (stateless)."""

    def __init__(self, manifest: Manifest) -> None:
        self._calibration = manifest.calibration
        self.positive_index = manifest.positive_index
        self.method = manifest.calibration.method
        self.label_smoothing = manifest.calibration.label_smoothing

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Calibrated positive-class probabilities.

        Args:
            logits: ``[batch, n_classes] float32`` raw logits from InferenceService.

        Returns:
            ``[batch] float64``, finite and in [0, 1].

        Raises:
            InferenceFailed: the logits are malformed or not finite (a model failure, INTERNAL);
                no decision is made on them.
        """
        try:
            p = self._calibration.probabilities(logits, self.positive_index)
        except ValueError as exc:
            raise InferenceFailed("the model returned logits that cannot be calibrated (not finite)") from exc
        if not ((p >= 0) & (p <= 1)).all():  # defence in depth (NaN fails both comparisons)
            raise InferenceFailed("calibration produced an invalid probability")
        return p

    def probabilities_per_row(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated probabilities of every row that has usable logits, and which rows do.

        A row with a non-finite logit, or whose probability would fall outside [0, 1], is
        judged alone: its probability is 0 and meaningless, and the mask says so; the other
        rows are calibrated exactly as if sent alone (calibration is row-wise).

        Args:
            logits: ``[batch, n_classes] float32``; rows may be NaN (no usable model output).

        Returns:
            Probabilities ``[batch] float64`` and the mask of usable rows ``[batch] bool``.

        Raises:
            InferenceFailed: the tensor itself is malformed (wrong number of classes).
        """
        usable = np.isfinite(logits).all(axis=1)
        z = logits if usable.all() else np.where(usable[:, None], logits, np.float32(0.0))
        try:
            p = self._calibration.probabilities(z, self.positive_index)
        except (ValueError, IndexError) as exc:
            raise InferenceFailed("the model returned logits that cannot be calibrated") from exc
        usable &= (p >= 0) & (p <= 1)  # NaN fails both comparisons
        return np.where(usable, p, 0.0), usable

    def margins(self, logits: np.ndarray) -> np.ndarray:
        """Positive-class margins ``z_pos - max(other z)``, ``[batch]`` float64 (logit units).

        Raises:
            InferenceFailed: the logits are malformed or not finite.
        """
        try:
            return calibration.margin(logits, self.positive_index)
        except ValueError as exc:
            raise InferenceFailed("the model returned logits that are not finite") from exc
