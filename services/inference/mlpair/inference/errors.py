"""InferenceService errors, each with its gRPC code and AIP-193 reason."""

from __future__ import annotations

from mlpair.errors import ServiceError

DOMAIN = "inference.mlpair"


class InferenceError(ServiceError):
    """Root of InferenceService errors."""


class InvalidInput(InferenceError):
    """The input tensor is malformed: dtype, shape, byte size or values."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_INPUT"


class UnsupportedParameter(InferenceError):
    """A request, input or output parameter this server does not implement (sequence batching,
    shared memory, classification ...), or one of the wrong type (a ``timeout`` or ``priority`` that
    is not a non-negative integer): refused rather than silently ignored."""

    code = "INVALID_ARGUMENT"
    reason = "UNSUPPORTED_PARAMETER"


class FeatureVersionMismatch(InferenceError):
    """``x-feature-version`` is missing or differs from the model's feature schema version."""

    code = "FAILED_PRECONDITION"
    reason = "FEATURE_VERSION_MISMATCH"


class ModelNotFound(InferenceError):
    """No such model, or no such version of it."""

    code = "NOT_FOUND"
    reason = "MODEL_NOT_FOUND"


class ModelNotReady(InferenceError):
    """The model is still loading or warming up, or the server is draining."""

    code = "UNAVAILABLE"
    reason = "MODEL_NOT_READY"


class ModelUnhealthy(InferenceError):
    """The model version failed batch after batch, or its known-answer self-test, after start
    (:mod:`mlpair.inference.model_health`): not run on its runtime; retry on another replica."""

    code = "UNAVAILABLE"
    reason = "MODEL_UNHEALTHY"


class ModelFailure(InferenceError):
    """The model itself failed or produced unusable output (never the caller's fault)."""

    code = "INTERNAL"
    reason = "MODEL_FAILURE"


class QueueFull(InferenceError):
    """The model's batch queue holds max_queue_rows already: back off and retry."""

    code = "RESOURCE_EXHAUSTED"
    reason = "QUEUE_FULL"


class Draining(InferenceError):
    """The server is shutting down and takes no new work; retry on another replica."""

    code = "UNAVAILABLE"
    reason = "DRAINING"


class DeadlineExpired(InferenceError):
    """The request's deadline passed while it waited in the queue; it was never computed."""

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXPIRED_IN_QUEUE"


class ModelLoadFailed(InferenceError):
    """A model version could not be loaded or warmed (the message says why, without internals)."""

    code = "INTERNAL"
    reason = "MODEL_LOAD_FAILED"


class ModelControlDisabled(InferenceError):
    """Load/unload RPCs are refused unless the server runs with model_control=explicit."""

    code = "FAILED_PRECONDITION"
    reason = "MODEL_CONTROL_DISABLED"


class ModelSourceUnavailable(InferenceError):
    """The model source (bucket, registry) cannot be read now; the versions already serving stay."""

    code = "UNAVAILABLE"
    reason = "MODEL_SOURCE_UNAVAILABLE"
