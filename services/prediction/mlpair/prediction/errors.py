"""PredictionService errors, each with its gRPC code and AIP-193 reason."""

from __future__ import annotations

from mlpair.errors import ServiceError

DOMAIN = "prediction.mlpair"


class PredictionError(ServiceError):
    """Root of PredictionService errors."""


class InvalidRequest(PredictionError):
    """The request is malformed: ids, or attribute values no conversion rule accepts."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_REQUEST"


class UnknownAttribute(PredictionError):
    """The request names attributes the feature schema does not know, and this service is set to
    refuse them (``PREDICTION_UNKNOWN_ATTRIBUTES=refuse``; by default they are named in warnings)."""

    code = "INVALID_ARGUMENT"
    reason = "UNKNOWN_ATTRIBUTE"


class MissingRequiredAttribute(PredictionError):
    """The request lacks attributes its family's decision policy requires, and that policy refuses
    such a request rather than sending it to review (``[missing_data] action = "refuse"``)."""

    code = "INVALID_ARGUMENT"
    reason = "REQUIRED_ATTRIBUTE_MISSING"


class UnknownModel(PredictionError):
    """The request names a model family this service does not serve."""

    code = "NOT_FOUND"
    reason = "UNKNOWN_MODEL"


class InferenceUnavailable(PredictionError):
    """InferenceService could not answer in time (down, overloaded, deadline passed).

    Predict never returns it: the result is served stale from cache or decided by the
    documented fallback (REVIEW). ``retryable`` says whether another attempt may succeed.
    """

    code = "UNAVAILABLE"
    reason = "INFERENCE_UNAVAILABLE"
    retryable = False


class InferenceTimeout(InferenceUnavailable):
    """The Infer call ran out of its deadline budget (or the budget was spent before it started)."""

    reason = "INFERENCE_TIMEOUT"


class DeadlineTooShort(PredictionError):
    """The caller's deadline leaves less than ``inference_min_attempt_ms`` for the Infer call once
    the recording reserve (``crm_reserve_ms``) is kept back, and no Infer call has said the service
    is down (the circuit is not open): no call is made, and nothing is decided or recorded.

    Not :class:`InferenceUnavailable`, so no fallback: a fallback decision would say inference was
    unavailable, which nothing showed, and would stay the request id's decision for good. The
    caller retries with a longer deadline and the same request id.
    """

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_TOO_SHORT"


class CircuitOpen(InferenceUnavailable):
    """The circuit breaker is open after repeated inference failures; no call was made."""

    reason = "CIRCUIT_OPEN"


class InferenceOverloaded(PredictionError):
    """InferenceService is shedding load (its queue is full, or the mesh's rate limit refused the
    call). The model is up, so there is no fallback and the circuit breaker does not count it:
    nothing is decided or recorded, and the caller retries later with backoff (the same request
    id is safe). ``metadata["cause"]`` is ``queue_full`` or ``rate_limited``."""

    code = "RESOURCE_EXHAUSTED"
    reason = "INFERENCE_OVERLOADED"


class InferenceContractError(PredictionError):
    """InferenceService refused the version contract; no decision is made on this vector."""

    code = "FAILED_PRECONDITION"
    reason = "VERSION_CONTRACT_BROKEN"


class InferenceFailed(PredictionError):
    """InferenceService failed for another reason (a model failure, an invalid tensor)."""

    code = "INTERNAL"
    reason = "INFERENCE_FAILED"


class LedgerUnavailable(PredictionError):
    """The decision could not be recorded durably in the decision ledger, so it is not returned
    (the ledger is unreachable or refused the commit); a retry with the same request id is safe."""

    code = "UNAVAILABLE"
    reason = "DECISION_NOT_RECORDED"


class IdempotencyKeyReused(PredictionError):
    """The request id is already on record for another payload (another entity, family or other
    attribute values); nothing is decided or returned for this one."""

    code = "ALREADY_EXISTS"
    reason = "IDEMPOTENCY_KEY_REUSED"


class CallerLeft(PredictionError):
    """The caller cancelled, or its deadline passed, before its item of a merged batch was decided:
    the item is neither decided nor recorded (no client sees this error)."""

    code = "CANCELLED"
    reason = "CALLER_LEFT"


class CallerRateLimited(PredictionError):
    """The caller has used its decisions per second (``PREDICTION_CALLER_LIMITS``); nothing was
    decided or recorded. ``retry_after_s``: when the call would be admitted, sent as ``RetryInfo``."""

    code = "RESOURCE_EXHAUSTED"
    reason = "CALLER_RATE_LIMITED"

    def __init__(self, message: str, *, retry_after_s: float, metadata=None) -> None:
        super().__init__(message, metadata=metadata)
        self.retry_after_s = retry_after_s


class InvalidCaller(PredictionError):
    """The caller's identity, from the source this service trusts (``PREDICTION_CALLER_SOURCE``),
    is not a usable id (control characters, longer than 128 characters, or a malformed header)."""

    code = "INVALID_ARGUMENT"
    reason = "CALLER_INVALID"


class LimitUnavailable(PredictionError):
    """The shared caller-limit store (Redis) did not answer and the limit fails closed
    (``PREDICTION_CALLER_LIMIT_REDIS_FAILURE=closed``); nothing was decided."""

    code = "UNAVAILABLE"
    reason = "CALLER_LIMIT_UNAVAILABLE"
