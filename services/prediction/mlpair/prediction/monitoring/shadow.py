"""Shadow comparison: a candidate model version scores the same rows, never served.

For every decided row the shadow version's logits are compared with the served (primary)
version's: ``|margin_shadow - margin_primary|`` in logits, and whether the shadow's own
calibrated probability falls in the same decision band as the served decision. Both land in
``prediction_shadow_*`` metrics, the evidence a canary promotion needs. Calls run in the
background after the response, many decisions' rows per call, with a bounded queue; a failing
or busy shadow is counted per row and never affects a served decision.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.families import ModelFamily, ModelVersion

logger = logging.getLogger(__name__)

MAX_PENDING_ROWS = 10_000  # rows waiting for a shadow call; beyond this a row is skipped and counted

Infer = Callable[[ModelFamily, ModelVersion, np.ndarray], Awaitable[tuple[np.ndarray, str]]]


@dataclass(frozen=True, slots=True)
class ServedRow:
    """What was served for one row: its features, the primary's margin, and the band the policy puts
    the primary's probability in. The band, not the decision served: a review for missing data,
    too few attributes or an uncertain ensemble is the row's doing, not the model's, and the shadow
    comparison is of the two models under one policy."""

    vector: np.ndarray  # [n_features] float32
    primary_margin: float
    decision: str


class ShadowComparison:
    """Runs and records shadow comparisons in the background.

    Served rows queue per family (at most ``MAX_PENDING_ROWS`` in all) and one background task
    per family sends them to the shadow version in calls of up to ``max_rows`` rows: under load
    the comparisons of many concurrent decisions share one Infer call instead of one each, and a
    burst is never dropped for want of a free task — only past the row bound.
    """

    def __init__(self, infer: Infer, max_rows: int) -> None:
        """Args:
        infer: the pipeline's inference call site (``[rows, n_features]`` → logits, version).
        max_rows: most rows per inference call.
        """
        self._infer = infer
        self._max_rows = max_rows
        self._pending: dict[str, list[ServedRow]] = {}
        self._pending_rows = 0
        self._workers: dict[str, asyncio.Task] = {}

    def start(self, family: ModelFamily, rows: list[ServedRow]) -> None:
        """Queues ``rows`` for comparison against ``family.shadow`` (no-op without a shadow)."""
        shadow = family.shadow
        if shadow is None or not rows:
            return
        room = max(0, MAX_PENDING_ROWS - self._pending_rows)
        if len(rows) > room:
            metrics.SHADOW_FAILURES.labels(family.name, shadow.version, "skipped_busy").inc(len(rows) - room)
            rows = rows[:room]
            if not rows:
                return
        self._pending.setdefault(family.name, []).extend(rows)
        self._pending_rows += len(rows)
        if family.name not in self._workers:
            # a context of its own: its calls carry many callers' rows, and must run as none of them
            task = asyncio.create_task(self._work(family, shadow), context=contextvars.Context())
            self._workers[family.name] = task

    async def drain(self) -> None:
        """Waits until every queued comparison has been made (or has failed and been counted)."""
        while self._workers:
            await asyncio.gather(*self._workers.values(), return_exceptions=True)

    async def _work(self, family: ModelFamily, shadow: ModelVersion) -> None:
        try:
            while queue := self._pending.get(family.name):
                chunk, self._pending[family.name] = queue[: self._max_rows], queue[self._max_rows :]
                self._pending_rows -= len(chunk)
                await self._compare(family, shadow, chunk)
        finally:
            del self._workers[family.name]

    async def _compare(self, family: ModelFamily, shadow: ModelVersion, chunk: list[ServedRow]) -> None:
        primary_version = family.members[0].version
        try:
            logits, served = await self._infer(family, shadow, np.stack([r.vector for r in chunk]))
            margins = shadow.calibrator.margins(logits)
            probabilities = shadow.calibrator.probabilities(logits)
        except Exception as exc:  # noqa: BLE001  (the shadow never affects serving)
            cause = exc.reason if isinstance(exc, ServiceError) else "unexpected"
            logger.warning("shadow version %s of %s failed: %s", shadow.version, family.name, cause)
            metrics.SHADOW_FAILURES.labels(family.name, shadow.version, cause).inc(len(chunk))
            return
        for row, margin, p in zip(chunk, margins, probabilities):
            metrics.SHADOW_LOGIT_DIFFERENCE.labels(family.name, primary_version, served).observe(
                abs(float(margin) - row.primary_margin)
            )
            agreement = "agree" if family.policy.band(float(p)).decision == row.decision else "disagree"
            metrics.SHADOW_DECISIONS.labels(family.name, primary_version, served, agreement).inc()
