"""``prediction_*`` Prometheus metrics (the business-layer SLA), labelled by model.

With several workers (``workers`` > 1, :mod:`mlpair.workers`) the supervisor serves every worker's
metrics (prometheus-client multiprocess mode): counters and histograms add up; each gauge says how
workers combine, the worst worker winning (``livemax`` of breaker state, degraded, drift statistics
and flags; ``livemin`` of dependency health and p-values); the ledger backlog is the same figure in
every worker (``livemax``). Each worker judges drift over its own window. ``live*`` modes drop a
worker that exited.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Histogram
from prometheus_client.utils import floatToGoString

from mlpair.observability.metrics import gauge


@functools.cache
def labelled(metric, *values: str):
    """``metric.labels(*values)``, memoised for the request path.

    ``labels`` takes a lock and builds its key on every call; the label values passed here
    come from configuration (model families, schema features, status codes), never from
    clients, so the memo stays small.
    """
    return metric.labels(*values)


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 1.0, 2.5, 5.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

REQUESTS = Counter("prediction_requests_total", "Predict calls by outcome.", ["model", "code"])
CALLER_DECISIONS = Counter(
    "prediction_caller_decisions_total",
    "Decisions asked for, by caller (callers the settings name, anonymous, or other) and by whether the "
    "caller's rate limit admitted them (admitted) or refused the call (limited: nothing decided or recorded).",
    ["caller", "outcome"],
)
CALLER_LIMIT_ERRORS = Counter(
    "prediction_caller_limit_errors_total",
    "Calls the shared caller-limit store (Redis) did not answer for, by what was done (open: admitted; closed: refused).",
    ["failure"],
)
DECISIONS = Counter("prediction_decisions_total", "Decisions returned, by band.", ["model", "decision"])
REQUEST_DURATION = Histogram(
    "prediction_request_duration_seconds",
    "Predict latency inside the server, CRM write included.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
INFERENCE_DURATION = Histogram(
    "prediction_inference_call_duration_seconds",
    "Successful Infer calls as the client saw them, retries included (cache hits excluded).",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
CRM_WRITE_DURATION = Histogram(
    "prediction_crm_write_duration_seconds",
    "One relay transaction delivering a batch of decisions to the CRM database.",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
FEATURE_GUARDS = Counter(
    "prediction_feature_guard_total", "Feature guards fired, per feature and action.", ["model", "feature", "action"]
)
MODEL_SOURCE_ERRORS = Counter(
    "prediction_model_source_errors_total",
    "Reads of the model source (bucket, registry) that failed at start (retried with backoff).",
)
UNKNOWN_ATTRIBUTES = Counter(
    "prediction_unknown_attributes_total", "Request attributes the schema does not know (ignored).", ["model"]
)
IDEMPOTENT_REPLAYS = Counter(
    "prediction_idempotent_replays_total",
    "Request ids answered with the decision already on record in the ledger (any replica's).",
    ["model"],
)
IDEMPOTENCY_KEY_REUSED = Counter(
    "prediction_idempotency_key_reused_total",
    "Request ids on record refused because they came with another payload.",
    ["model"],
)
INFERENCE_ROWS = Histogram(
    "prediction_inference_call_rows",
    "Rows per Infer call (packed rows of one or many requests).",
    ["model"],
    buckets=ROW_BUCKETS,
)
COALESCED_CALL_ROWS = Histogram(
    "prediction_coalesced_call_rows",
    "Rows per Infer call sent to InferenceService, after the cache and coalescing (scoring/coalescer.py).",
    ["model"],
    buckets=ROW_BUCKETS,
)
COALESCED_CALL_FLIGHTS = Histogram(
    "prediction_coalesced_call_flights",
    "Concurrent requests' calls merged into one Infer call (scoring/coalescer.py).",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
BATCH_ITEMS = Histogram(
    "prediction_batch_items", "Items per BatchPredict call.", buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000)
)
CHUNK_ROWS = Histogram(
    "prediction_chunk_rows",
    "Rows per PredictColumns chunk.",
    buckets=(1, 10, 100, 500, 1000, 2500, 5000, 10000, 25000, 50000),
)
CHUNKS = Counter(
    "prediction_chunks_total",
    "PredictColumns chunks by model family and outcome: OK (each row then counted in prediction_requests_total), or the code that refused the chunk as a whole.",
    ["model", "code"],
)
MERGED_CALLS = Histogram(
    "prediction_merged_calls",
    "Predict calls decided together in one batch (1: the call was decided alone).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
EXPLANATIONS = Counter("prediction_explanations_total", "Decisions returned with an explanation.", ["model"])
ENSEMBLE_SPREAD = Histogram(
    "prediction_ensemble_spread",
    "Max minus min of the ensemble members' calibrated probabilities.",
    ["model"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
)
UNCERTAIN_DECISIONS = Counter(
    "prediction_uncertain_decisions_total",
    "Decisions routed to the policy's uncertainty decision because the ensemble spread exceeded its bound.",
    ["model"],
)
SHADOW_LOGIT_DIFFERENCE = Histogram(
    "prediction_shadow_logit_difference",
    "|shadow margin - primary margin| per row, in logits (canary evidence).",
    ["model", "primary_version", "shadow_version"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
)
SHADOW_DECISIONS = Counter(
    "prediction_shadow_decisions_total",
    "Shadow decisions compared with the primary's, by policy band (agree or disagree).",
    ["model", "primary_version", "shadow_version", "agreement"],
)
SHADOW_FAILURES = Counter(
    "prediction_shadow_failures_total",
    "Rows whose shadow comparison failed or was skipped (never affects the served decision).",
    ["model", "shadow_version", "cause"],
)

OBSERVABILITY_ERRORS = Counter(
    "prediction_observability_errors_total",
    "Log lines, spans or metrics that failed to be made (caught: never a failed request).",
    ["stage"],
)

# Cache, single-flight and degraded service (cache.py, resilience.py).
CACHE_REQUESTS = Counter(
    "prediction_cache_requests_total",
    "Feature rows looked up in the cache: hit (fresh), miss (this request calls inference) or "
    "coalesced (joined another request's in-flight call).",
    ["model", "result"],
)
CACHE_ERRORS = Counter(
    "prediction_cache_errors_total",
    "Cache backend lookups and writes that failed, each treated as a miss, by reason: no_connection "
    "(none free in the pool in time), timeout (no reply in time) or error.",
    ["backend", "operation", "reason"],
)
CACHE_INVALID = Counter(
    "prediction_cache_invalid_total",
    "Cache entries read that this process would not have stored (layout, key, version, shape, "
    "non-finite logits, size, store time, age): each a miss, never served.",
    ["backend", "cause"],
)
STALE_SERVED = Counter(
    "prediction_cache_stale_served_total",
    "Results served from a stale cache entry because inference could not be used, by reason.",
    ["model", "reason"],
)
FALLBACKS = Counter(
    "prediction_fallbacks_total", "Fallback REVIEW decisions made without model output, by reason.", ["model", "reason"]
)
MODEL_OUTPUT_INVALID = Counter(
    "prediction_model_output_invalid_total",
    "Rows whose model output was unusable (non-finite logits or probability), each "
    "decided alone by the policy's fallback with reason MODEL_OUTPUT_INVALID.",
    ["model"],
)
INFERENCE_ERRORS = Counter(
    "prediction_inference_errors_total",
    "Failed Infer attempts by cause: unavailable, model_unhealthy, model_failure, internal, unknown, "
    "cancelled and timeout are inference-side faults (retried once where retryable, else a stale result "
    "or the fallback; they count for the circuit breaker); queue_full and rate_limited (load shed) reach "
    "the caller as RESOURCE_EXHAUSTED; the rest are failures.",
    ["model", "cause"],
)
INFERENCE_RETRIES = Counter(
    "prediction_inference_retries_total", "Infer attempts retried after an inference-side fault.", ["model"]
)
CIRCUIT_STATE = gauge(
    "prediction_circuit_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.", ["dependency"]
)
CIRCUIT_TRANSITIONS = Counter(
    "prediction_circuit_transitions_total", "Circuit breaker state changes, by new state.", ["dependency", "state"]
)

# The decision ledger and its relay (recording/). The ledger's undelivered rows are the CRM's outbox:
# the prediction_outbox_* series keep their names and now count the shared ledger's backlog (every
# replica reports the same figure: aggregate them with max, not sum).
LEDGER_COMMIT_DURATION = Histogram(
    "prediction_ledger_commit_duration_seconds",
    "One decision ledger commit (group commit of concurrent decisions).",
    buckets=LATENCY_BUCKETS,
)
LEDGER_COMMIT_ROWS = Histogram(
    "prediction_ledger_commit_rows",
    "Decisions written by one decision ledger commit.",
    buckets=ROW_BUCKETS,
)
OUTBOX_DEPTH = gauge(
    "prediction_outbox_depth", "Decisions on record in the shared ledger and not yet delivered to the CRM."
)
OUTBOX_OLDEST_AGE = gauge(
    "prediction_outbox_oldest_age_seconds",
    "Age of the oldest decision the ledger has not delivered to the CRM (0 when none).",
)
OUTBOX_DELIVERED = Counter("prediction_outbox_delivered_total", "Decisions the relay inserted into the CRM database.")
OUTBOX_ALREADY_IN_CRM = Counter(
    "prediction_outbox_already_in_crm_total",
    "Decisions the relay found already in the CRM (a retried transaction); not doubled.",
)
CRM_REFUSED = Counter(
    "prediction_crm_refused_total",
    "Decisions the CRM database refused for their data (a constraint, a value it cannot store); each "
    "waits in the ledger and is retried behind the queue, while the rest are delivered.",
)
RELAY_FAILURES = Counter(
    "prediction_relay_failures_total", "Failed relay attempts (CRM database unreachable or refusing)."
)

# Health of what PredictionService depends on (health.py).
DEPENDENCY_UP = gauge(
    "prediction_dependency_up", "1 when a dependency is healthy, else 0.", ["dependency"], workers="livemin"
)
DEGRADED = gauge("prediction_degraded", "1 when serving with a fallback (inference, CRM or cache unhealthy), else 0.")

# -- Observability (issue 6): CRM write health, fallbacks, drift. -------------------------------
CRM_WRITES = Counter("prediction_crm_writes_total", "CRM write attempts by outcome (ok, error).", ["model", "outcome"])
DRIFT_STATISTIC = gauge(
    "prediction_drift_statistic",
    "Drift effect size per feature over the window: KS statistic (test=ks) or total variation distance (test=chi2).",
    ["model", "feature", "test"],
)
DRIFT_P_VALUE = gauge(
    "prediction_drift_p_value",
    "Drift test p-value per feature, before the Bonferroni correction.",
    ["model", "feature", "test"],
    workers="livemin",
)
DRIFT_DETECTED = gauge(
    "prediction_drift_detected",
    "1 when a feature drifted: effect size above its threshold and p-value below alpha / tests.",
    ["model", "feature"],
)
DRIFT_WINDOW_ROWS = gauge("prediction_drift_window_rows", "Decisions in the drift window.", ["model"])
DRIFT_MIN_ROWS = gauge(
    "prediction_drift_min_rows", "Fewest decisions in the window before drift is judged at all.", ["model"]
)
SCORE_DRIFT_STATISTIC = gauge(
    "prediction_score_drift_statistic",
    "KS statistic of the calibrated score over the window against training's.",
    ["model"],
)
SCORE_DRIFT_P_VALUE = gauge(
    "prediction_score_drift_p_value", "KS p-value of the calibrated score drift test.", ["model"], workers="livemin"
)
SCORE_DRIFT_DETECTED = gauge(
    "prediction_score_drift_detected", "1 when the calibrated score distribution drifted.", ["model"]
)
DRIFT_THRESHOLD = gauge(
    "prediction_drift_threshold", "Effect-size threshold of each drift test (ks, chi2).", ["model", "test"]
)
DRIFT_CORRECTED_ALPHA = gauge(
    "prediction_drift_corrected_alpha", "Per-test significance level: alpha / number of tests (Bonferroni).", ["model"]
)

# -- Distribution signals every replica contributes to (signals.py): drift across replicas and
# threshold probing. Counters and histograms sum across replicas and workers; the baseline gauges
# are the same everywhere (set from the manifest at start-up: aggregate them with max).
RANK_BUCKETS = tuple(round(i / 20, 2) for i in range(1, 20))  # rank levels 0.05 … 0.95
RANK_BUCKET_LABELS = tuple(floatToGoString(b) for b in RANK_BUCKETS)  # as the exposition writes `le`
RANK_OBSERVED = (*RANK_BUCKETS, 1.0)  # the value observed for bucket i (1.0: above every edge)
DRIFT_RANK = Histogram(
    "prediction_drift_rank",
    "Rank of each decision's feature value (or calibrated score, feature=score) in its training "
    "distribution; bucket le=l counts values at or below the training value of rank l.",
    ["model", "feature"],
    buckets=RANK_BUCKETS,
)
DRIFT_RANK_BASELINE = gauge(
    "prediction_drift_rank_baseline",
    "Share of the training rows in each prediction_drift_rank bucket (cumulative, by le).",
    ["model", "feature", "le"],
    workers="max",
)
DRIFT_CATEGORY = Counter(
    "prediction_drift_category_total",
    "Decisions by category of each categorical feature.",
    ["model", "feature", "category"],
)
DRIFT_CATEGORY_BASELINE = gauge(
    "prediction_drift_category_baseline",
    "Training frequency of each category of each categorical feature.",
    ["model", "feature", "category"],
    workers="max",
)
DRIFT_BASELINE_ROWS = gauge(
    "prediction_drift_baseline_rows",
    "Rows behind each training baseline (training split; calibration split for the score).",
    ["model", "feature"],
    workers="max",
)
NEAR_THRESHOLD = Counter(
    "prediction_near_threshold_total",
    "Decisions whose calibrated probability lies just below a decision threshold (within 0.02).",
    ["model", "threshold"],
)
NEAR_THRESHOLD_BASELINE = gauge(
    "prediction_near_threshold_baseline_ratio",
    "Share of calibration-split scores in the same band below each threshold.",
    ["model", "threshold"],
    workers="max",
)

# Why inference was not used for a row (the reasons of errors.InferenceUnavailable and its subclasses).
DEGRADED_REASONS = ("INFERENCE_UNAVAILABLE", "INFERENCE_TIMEOUT", "CIRCUIT_OPEN")


def declare(model: str, decisions: tuple[str, ...]) -> None:
    """Creates one model family's request, decision and degraded-mode series at zero at start-up.

    A labelled series appears only when first incremented: until the first fallback, a ratio
    such as fallbacks / requests has no numerator, so its panel reads "no data" rather than 0 and
    a resolved burn-rate alert has nothing to compare. Label values here come from the policy
    and this module, never from clients.
    """
    labelled(REQUESTS, model, "OK")
    labelled(REQUEST_DURATION, model)
    for decision in decisions:
        labelled(DECISIONS, model, decision)
    for reason in DEGRADED_REASONS:
        labelled(FALLBACKS, model, reason)
        labelled(STALE_SERVED, model, reason)
    for outcome in ("ok", "error"):
        labelled(CRM_WRITES, model, outcome)
    for counter in (UNKNOWN_ATTRIBUTES, IDEMPOTENT_REPLAYS, IDEMPOTENCY_KEY_REUSED):
        labelled(counter, model)
