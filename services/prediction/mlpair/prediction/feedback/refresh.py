"""Realised figures per family, model version and window, and PredictionService's periodic refresh
of their gauges (:mod:`.metrics`).

A window is the decisions made in the last ``h`` hours (``0``: every decision on record), labelled
``"<h>h"`` or ``"all"``; outcomes arrive weeks after their decisions, so the windows an operator
sets are about as long as that delay and more. A group with fewer than ``min_joined`` joined
decisions exports nothing (its figures would be noise), and nothing is exported for a version
whose outcomes hold one class only (ROC AUC undefined).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from mlpair.background import stop_task
from mlpair.prediction.feedback import metrics
from mlpair.prediction.feedback.performance import Realised, Threshold, realised
from mlpair.prediction.feedback.store import OutcomeStore

logger = logging.getLogger(__name__)


def window_label(hours: float) -> str:
    """``"168h"`` for 168 hours; ``"all"`` for 0."""
    return "all" if hours <= 0 else f"{hours:g}h"


@dataclass(frozen=True)
class FamilyPolicy:
    """What the figures of one family need from its policy: its thresholds and decision labels."""

    thresholds: tuple[Threshold, ...]
    decisions: tuple[str, ...]


async def measure(
    store: OutcomeStore,
    windows_h: Sequence[float],
    policies: Mapping[str, FamilyPolicy],
    *,
    min_joined: int = 1,
    now: datetime | None = None,
) -> list[Realised]:
    """The realised figures of every family (of ``policies``), version and window with at least
    ``min_joined`` joined decisions, ordered by family, version and window.

    Raises:
        sqlalchemy.exc.SQLAlchemyError, OSError: the ledger database failed.
    """
    now = now or datetime.now(UTC)
    out: list[Realised] = []
    for hours in windows_h:
        joined = await store.joined(None if hours <= 0 else now - timedelta(hours=hours))
        for family, version, rows in joined.groups():
            if family not in policies or rows.size < max(min_joined, 1):
                continue
            policy = policies[family]
            out.append(
                realised(
                    family,
                    version,
                    window_label(hours),
                    joined.positive[rows],
                    joined.probability[rows],
                    joined.decision[rows],
                    policy.thresholds,
                    policy.decisions,
                )
            )
    return sorted(out, key=lambda r: (r.family, r.model_version, r.window))


def export(figures: Sequence[Realised]) -> None:
    """Replaces the ``prediction_realised_*`` gauges with ``figures``."""
    gauges = (
        metrics.REALISED_OUTCOMES,
        metrics.REALISED_POSITIVE_RATE,
        metrics.REALISED_ROC_AUC,
        metrics.REALISED_ECE,
        metrics.REALISED_BRIER,
        metrics.REALISED_PRECISION,
        metrics.REALISED_RECALL,
        metrics.REALISED_DECISION_RATE,
    )
    for gauge in gauges:
        gauge.clear()
    for r in figures:
        key = (r.family, r.model_version, r.window)
        metrics.REALISED_OUTCOMES.labels(*key).set(r.n)
        metrics.REALISED_POSITIVE_RATE.labels(*key).set(r.positive_rate)
        if r.roc_auc is not None:
            metrics.REALISED_ROC_AUC.labels(*key).set(r.roc_auc)
            metrics.REALISED_ECE.labels(*key).set(r.ece)
            metrics.REALISED_BRIER.labels(*key).set(r.brier)
        for band, value in r.precision.items():
            if value is not None:
                metrics.REALISED_PRECISION.labels(*key, band).set(value)
        for band, value in r.recall.items():
            if value is not None:
                metrics.REALISED_RECALL.labels(*key, band).set(value)
        for decision, rate in r.decision_rates.items():
            metrics.REALISED_DECISION_RATE.labels(*key, decision).set(rate)


class RealisedMonitor:
    """Refreshes the realised gauges every ``interval_s`` seconds from the outcome store.

    Args:
        holdout: ``(family, model version) → (holdout ROC AUC, holdout ECE)`` of the served versions,
            exported once as ``prediction_holdout_*`` for the alert to compare with.
    """

    def __init__(
        self,
        store: OutcomeStore,
        policies: Mapping[str, FamilyPolicy],
        windows_h: Sequence[float],
        *,
        min_joined: int,
        holdout: Mapping[tuple[str, str], tuple[float, float]] = {},  # noqa: B006  (read only)
    ) -> None:
        self.store = store
        self.policies = dict(policies)
        self.windows_h = tuple(windows_h)
        self.min_joined = min_joined
        self._task: asyncio.Task | None = None
        for (family, version), (auc, ece) in holdout.items():
            metrics.HOLDOUT_ROC_AUC.labels(family, version).set(auc)
            metrics.HOLDOUT_ECE.labels(family, version).set(ece)

    async def refresh(self) -> list[Realised]:
        """Measures once and exports the figures (and the count of unjoined outcomes); returns them.

        Raises:
            sqlalchemy.exc.SQLAlchemyError, OSError: the ledger database failed (the gauges keep
                their last values).
        """
        figures = await measure(self.store, self.windows_h, self.policies, min_joined=self.min_joined)
        _, unjoined = await self.store.count()
        export(figures)
        metrics.OUTCOMES_UNJOINED.set(unjoined)
        return figures

    def start(self, interval_s: float) -> None:
        """Refreshes now and then every ``interval_s`` seconds in the background (0: never)."""
        if interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval_s))

    async def _run(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001  (a failed refresh must not stop the next)
                logger.warning("realised performance refresh failed (%s)", type(exc).__name__)
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        """Stops the refresh and closes the store."""
        await stop_task(self._task)
        self._task = None
        await self.store.close()


def monitor_for(families: Mapping, settings) -> RealisedMonitor:
    """The outcome store on the settings' ledger and its realised-figures monitor, for the served
    ``families`` (:class:`~mlpair.prediction.families.ModelFamily` by name): each family's class
    names, policy thresholds and the holdout figures of its deciding versions' manifests."""
    from mlpair.prediction.feedback.items import FamilyLabels
    from mlpair.prediction.feedback.performance import thresholds_of

    labels = {name: FamilyLabels.of_manifest(f.entry.manifest) for name, f in families.items()}
    policies = {name: FamilyPolicy(thresholds_of(f.policy), f.policy.decisions) for name, f in families.items()}
    holdout = {}
    for name, family in families.items():
        for member in family.members:
            figures = member.entry.manifest.metrics.get("holdout_calibrated", {})
            if "roc_auc" in figures and "ece_15" in figures:
                holdout[(name, member.version)] = (figures["roc_auc"], figures["ece_15"])
    store = OutcomeStore(settings.ledger_url, labels, settings.model_name, timeout_s=settings.crm_timeout_ms / 1000)
    return RealisedMonitor(
        store, policies, settings.outcome_windows_h, min_joined=settings.outcome_min_joined, holdout=holdout
    )
