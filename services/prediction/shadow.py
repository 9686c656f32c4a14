"""Shadow comparison: a candidate model version scores the same rows, never served.

For every decided row the shadow version's logits are compared with the served (primary)
version's: ``|margin_shadow - margin_primary|`` in logits, and whether the shadow's own
calibrated probability falls in the same decision band as the served decision. Both land in
``prediction_shadow_*`` metrics, the evidence a canary promotion needs. Calls run in the
background after the response, bounded in number; a failing or busy shadow is counted and
never affects a served decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.families import ModelFamily, ModelVersion

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # background comparisons; beyond this a comparison is skipped and counted

Infer = Callable[[ModelFamily, ModelVersion, np.ndarray], Awaitable[tuple[np.ndarray, str]]]


@dataclass(frozen=True, slots=True)
class ServedRow:
    """What was served for one row: its features, the primary's margin and the decision."""

    vector: np.ndarray  # [n_features] float32
    primary_margin: float
    decision: str


class ShadowComparison:
    """Runs and records shadow comparisons in the background."""

    def __init__(self, infer: Infer, max_rows: int) -> None:
        """Args:
            infer: the pipeline's inference call site (``[rows, n_features]`` → logits, version).
            max_rows: most rows per inference call.
        """
        self._infer = infer
        self._max_rows = max_rows
        self._tasks: set[asyncio.Task] = set()

    def start(self, family: ModelFamily, rows: list[ServedRow]) -> None:
        """Compares ``rows`` against ``family.shadow`` in the background (no-op without a shadow)."""
        if family.shadow is None or not rows:
            return
        if len(self._tasks) >= MAX_IN_FLIGHT:
            metrics.SHADOW_FAILURES.labels(family.name, family.shadow.version, "skipped_busy").inc()
            return
        task = asyncio.create_task(self._compare(family, rows))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Waits for the comparisons still running."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _compare(self, family: ModelFamily, rows: list[ServedRow]) -> None:
        shadow = family.shadow
        primary_version = family.members[0].version
        for start in range(0, len(rows), self._max_rows):
            chunk = rows[start:start + self._max_rows]
            try:
                logits, served = await self._infer(family, shadow, np.stack([r.vector for r in chunk]))
                margins = shadow.calibrator.margins(logits)
                probabilities = shadow.calibrator.probabilities(logits)
            except Exception as exc:  # noqa: BLE001  (the shadow never affects serving)
                cause = exc.reason if isinstance(exc, ServiceError) else "unexpected"
                logger.warning("shadow version %s of %s failed: %s", shadow.version, family.name, cause)
                metrics.SHADOW_FAILURES.labels(family.name, shadow.version, cause).inc()
                continue
            for row, margin, p in zip(chunk, margins, probabilities):
                metrics.SHADOW_LOGIT_DIFFERENCE.labels(family.name, primary_version, served).observe(
                    abs(float(margin) - row.primary_margin))
                agreement = "agree" if family.policy.band(float(p)).decision == row.decision else "disagree"
                metrics.SHADOW_DECISIONS.labels(family.name, primary_version, served, agreement).inc()
