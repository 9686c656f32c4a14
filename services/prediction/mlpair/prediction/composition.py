"""PredictionService's composition root: the one place a process's components are built, wired
and closed.

A call goes, in order: the servicer (:mod:`~mlpair.prediction.intake.servicer`: Predict, BatchPredict,
PredictColumns) → the :class:`~mlpair.prediction.pipeline.Predictor`, which prepares the rows
(:mod:`~mlpair.prediction.preparing.batch`, :mod:`~mlpair.contracts.columns`,
:mod:`~mlpair.prediction.preparing.idempotency`), scores them (:mod:`~mlpair.prediction.scoring`: cache →
coalescer → resilience → the InferenceService client, then calibration), decides
(:mod:`~mlpair.prediction.deciding.decisions`: policy, reason codes, explanations) and records
(:mod:`~mlpair.prediction.recording`: the decision ledger, its relay, the CRM), then monitors
(:mod:`~mlpair.prediction.monitoring.drift`, :mod:`~mlpair.prediction.monitoring.shadow`). :func:`build_components`
builds each of them here and hands each one what it calls; none builds or reaches into another.
:class:`PredictionComponents` owns their start and close.

Where to change what: a threshold or reason code in ``config/<family>/policy.toml``; a guard or a
conversion rule in ``config/<family>/feature-schema.toml``; a batch, cache, retry or breaker setting
in :class:`~mlpair.prediction.settings.PredictionSettings` (environment ``PREDICTION_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlpair.logs import add_personal_fields, set_process_model_version
from mlpair.prediction import metrics
from mlpair.prediction.families import ConfigurationError, ModelFamily
from mlpair.prediction.feedback.refresh import RealisedMonitor, monitor_for
from mlpair.prediction.intake.limits import CallerGate, build_gate
from mlpair.prediction.monitoring.drift import DriftMonitors, drift_config
from mlpair.prediction.pipeline import Predictor
from mlpair.prediction.recording.audit import AuditRecords
from mlpair.prediction.recording.recorder import DecisionRecorder, recorder_for
from mlpair.prediction.scoring.cache import CachedInference
from mlpair.prediction.scoring.coalescer import Infers
from mlpair.prediction.scoring.factory import build_inference_client, build_scorer
from mlpair.prediction.sourcing import repository_root

if TYPE_CHECKING:
    from mlpair.prediction.recording.store import CrmStore
    from mlpair.prediction.settings import PredictionSettings


@dataclass(frozen=True)
class PredictionComponents:
    """Every component of one PredictionService process, as :func:`build_components` wired them.

    Attributes:
        families: the served model families by name.
        inference: the client of InferenceService (scoring's last layer; shadow calls use it directly).
        scorer: cache → coalescer → resilience → ``inference``.
        recorder: the decision ledger, its relay (unless another process delivers) and the CRM store.
        drift: the drift monitors of every family.
        predictor: the pipeline the servicer calls.
        feedback: the outcome store (RecordOutcomes) and the realised-performance gauges' refresh.
        gate: each call's caller and its rate limit (:mod:`mlpair.prediction.intake.limits`).
    """

    families: Mapping[str, ModelFamily]
    inference: Infers
    scorer: CachedInference
    recorder: DecisionRecorder
    drift: DriftMonitors
    predictor: Predictor
    feedback: RealisedMonitor | None = None
    gate: CallerGate | None = None

    @property
    def crm(self) -> CrmStore:
        """The CRM store the relay delivers to (the recorder's)."""
        return self.recorder.crm

    async def start(self) -> None:
        """Opens the decision ledger and the CRM store and starts the relay.

        Raises:
            SchemaNotReady: the ledger or the CRM database has not been migrated (``mlpair migrate``).
        """
        await self.recorder.start()

    async def close(self, delivery_s: float = 0.0) -> None:
        """Stops drift monitoring, waits for merged Predicts and shadow comparisons still running,
        closes the scoring chain and the InferenceService client, then the recorder, delivering what
        it can of this process's backlog for up to ``delivery_s`` seconds."""
        await self.drift.stop()
        await self.predictor.drain_background()
        await self.scorer.close()
        await self.inference.close()
        await self.recorder.close(drain_timeout_s=delivery_s)
        if self.feedback is not None:
            await self.feedback.stop()
        if self.gate is not None:
            await self.gate.close()


def load_families(settings: PredictionSettings) -> dict[str, ModelFamily]:
    """Every served model family, checked against the settings (files only, but for fetching the
    versions from ``model_source`` when set: :mod:`mlpair.prediction.sourcing`).

    A supervisor calls it before starting its workers, so a configuration error is one line from
    one process rather than the same line from each worker.

    Raises:
        ConfigurationError: schema, policy and model repository disagree, or the default,
            ensemble or shadow families are not among the served ones.
    """
    names = settings.models or [settings.model_name]
    if settings.model_name not in names:
        raise ConfigurationError(
            f"default model family {settings.model_name!r} is not among the served {names}: set "
            f"--model-name / PREDICTION_MODEL_NAME to one of them"
        )
    if unserved := sorted((set(settings.ensembles) | set(settings.shadows)) - set(names)):
        raise ConfigurationError(f"ensemble or shadow configured for {unserved}, which are not served")
    root = repository_root(settings, names)
    return {
        name: ModelFamily.load(
            name,
            settings.config_dir,
            root,
            ensemble=settings.ensembles.get(name, ()),
            shadow=settings.shadows.get(name),
        )
        for name in names
    }


def scoring_bound_s(settings: PredictionSettings) -> float:
    """The longest an item's scoring takes when its deadline does not cut it short, in seconds: a
    wait in the coalescer's lane, then every Infer attempt and every backoff at its longest
    (``inference_timeout_ms`` each), twice (a cache follower whose leader failed leads a flight
    of its own)."""
    attempt_s = 2 * settings.inference_timeout_ms / 1000  # the attempt, then its backoff
    return 2 * (settings.coalesce_max_delay_ms / 1000 + settings.inference_max_attempts * attempt_s)


def build_components(
    settings: PredictionSettings,
    *,
    tracer_provider=None,
    inference: Infers | None = None,
    recorder: DecisionRecorder | None = None,
) -> PredictionComponents:
    """Loads every served model family and builds the components that serve them (no network I/O yet).

    Args:
        tracer_provider: where spans go (None = the global one, set in ``main()``).
        inference: the InferenceService client under the scoring chain; None = the real one for
            ``settings`` (a benchmark or a test passes a fake here).
        recorder: the ledger, relay and CRM; None = :func:`recorder_for` ``settings``.

    Raises:
        ConfigurationError: see :func:`load_families`; or an explanation of some family would not
            fit in one inference call.
    """
    families = load_families(settings)
    recorder = recorder or recorder_for(settings)
    if settings.tracing:  # CRM and ledger spans
        recorder.instrument(tracer_provider)
    for family in families.values():  # personal fields kept out of logs
        add_personal_fields(family.entry.preprocessing.feature_schema.personal_data)
    set_process_model_version(",".join(f"{name}:{f.entry.manifest.model_version}" for name, f in families.items()))
    for name, family in families.items():
        metrics.declare(name, family.policy.decisions)
    drift = DriftMonitors.for_families(families, drift_config(settings))
    inference = inference or build_inference_client(settings, tracer_provider=tracer_provider)
    scorer = build_scorer(settings, inference)
    predictor = Predictor(
        families,
        settings.model_name,
        scorer,
        recorder.ledger,
        inference,
        max_inference_rows=settings.inference_max_batch_rows,
        max_batch_items=settings.max_batch_items,
        merge_max_calls=settings.merge_max_calls,
        merge_max_delay_s=settings.merge_max_delay_ms / 1000,
        merge_deadline_window_s=settings.crm_reserve_ms / 2000,  # half the time kept back to record
        merge_scoring_bound_s=scoring_bound_s(settings),
        merge_wait_from_calls=settings.merge_wait_from_calls,
        explain_top_k=settings.explain_top_reasons,
        drift=drift,
        unknown_attributes=settings.unknown_attributes,
        audit=audit_records_for(settings),
    )
    return PredictionComponents(
        families, inference, scorer, recorder, drift, predictor, monitor_for(families, settings), build_gate(settings)
    )


def audit_records_for(settings: PredictionSettings) -> AuditRecords | None:
    """The audit record builder ``settings`` ask for (None: ``audit_records`` off)."""
    if not settings.audit_records:
        return None
    key = settings.audit_hash_key.get_secret_value().encode()
    return AuditRecords(settings.audit_personal_data, key)
