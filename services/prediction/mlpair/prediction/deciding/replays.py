"""A request id already on record: what the ledger held for it becomes the row's outcome.

:func:`recorded_maps` reads the ledger's answer for a call's decisions; :func:`replayed` turns one
recorded decision into the row's result (the decision recorded first, ``replayed``), or the refusal
of a request id recorded for another payload (``IDEMPOTENCY_KEY_REUSED``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from mlpair.prediction import metrics
from mlpair.prediction.deciding.decisions import Decided, replay_explanation
from mlpair.prediction.errors import LedgerUnavailable, PredictionError
from mlpair.prediction.intake.checks import explanation_not_recorded, key_reused
from mlpair.prediction.outcomes import PredictionResult
from mlpair.prediction.preparing.idempotency import request_fingerprint
from mlpair.prediction.records import Recorded, RecordedBatch
from mlpair.prediction.scoring.rows import Source


def replayed(
    record: Recorded, d: Decided, j: int, fingerprint: str, decisions: Counter
) -> PredictionResult | PredictionError:
    """The outcome of a request id that was on record already (decided row ``j`` of ``d``): that
    decision, or the refusal of an id recorded for another payload. A ledger row may hold the
    fingerprint of the values as sent rather than as the schema reads them (written by a
    release that fingerprinted spellings, e.g. during a rolling upgrade): the same values as
    sent are a retry too. Asked to explain, it carries the explanation computed now when that
    explains the recorded decision (:func:`replay_explanation`), else the warning
    ``EXPLANATION_NOT_RECORDED``."""
    group, k = d.group, d.rows[j]
    name = group.family.name
    request = group.requests[k]
    if (
        record.fingerprint
        and record.fingerprint != fingerprint
        and record.fingerprint != request_fingerprint(name, request.entity_id, request.attributes)
    ):
        metrics.labelled(metrics.IDEMPOTENCY_KEY_REUSED, name).inc()
        return key_reused(request.request_id)
    metrics.labelled(metrics.IDEMPOTENT_REPLAYS, name).inc()
    stored = record.decision
    decisions[name, stored.decision] += 1
    from_cache = stored.served_from in (Source.CACHE.value, Source.STALE_CACHE.value)
    warnings, explanation = group.warnings.get(k, ()), None
    if request.explain and (explanation := replay_explanation(stored, d, j)) is None:
        warnings = (*warnings, explanation_not_recorded(stored.decided_at))
    return PredictionResult(stored, from_cache=from_cache, replayed=True, warnings=warnings, explanation=explanation)


def recorded_maps(
    recorded: Sequence[Recorded | LedgerUnavailable],
) -> tuple[Mapping[int, Recorded], Mapping[int, BaseException]]:
    """(row → what was on record before, row → why it is not on record) from the ledger's answer."""
    if isinstance(recorded, RecordedBatch):
        return recorded.replays, recorded.errors
    replays: dict[int, Recorded] = {}
    failed: dict[int, BaseException] = {}
    for i, outcome in enumerate(recorded):
        if isinstance(outcome, BaseException):
            failed[i] = outcome
        elif outcome.replayed:
            replays[i] = outcome
    return replays, failed
