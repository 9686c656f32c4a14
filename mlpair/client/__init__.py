"""The public Python client of the pair: what a business system (or an internal caller, a script,
the demo) uses instead of the generated stubs.

- :class:`PredictionClient` (blocking) and :class:`AsyncPredictionClient` (``grpc.aio``):
  ``Predict`` and ``BatchPredict`` on PredictionService, decisions as ``PredictResponse``;
  ``record_outcomes`` feeds realised outcomes back (:class:`Outcome`).
- :func:`infer_logits`: raw logits from InferenceService (the project's own
  ``mlpair.inference.v1`` protocol), for callers that calibrate or compare themselves.
- :func:`check_health` and :func:`wait_until_serving`: ``grpc.health.v1`` of either service.
- :func:`to_attributes`: Python values → the request's attribute map.

One module per service (:mod:`~mlpair.client.prediction`, :mod:`~mlpair.client.inference`,
:mod:`~mlpair.client.health`) over :mod:`~mlpair.client.channels`; import the names from here. The
package imports nothing of the project but the generated :mod:`mlpair.api`: no service code.

Errors are gRPC's own: every call raises ``grpc.RpcError``, whose ``code()`` says what happened
(the status codes each call can return are listed on it) and whose ErrorInfo detail carries a
stable reason (:func:`mlpair.rpc.error_info` reads it). Nothing here retries: whether a refusal is
worth another try is the code's to say (UNAVAILABLE and RESOURCE_EXHAUSTED are, with backoff and
the same request id; a request id is the idempotency key, so a retry never decides twice).
"""

from mlpair.client.channels import DEFAULT_TIMEOUT_S
from mlpair.client.health import check_health, wait_until_serving
from mlpair.client.inference import infer_logits
from mlpair.client.outcomes import Outcome, OutcomeError
from mlpair.client.prediction import (
    AsyncPredictionClient,
    Attribute,
    BatchItem,
    ItemError,
    PredictionClient,
    predict_request,
    to_attributes,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncPredictionClient",
    "Attribute",
    "BatchItem",
    "ItemError",
    "Outcome",
    "OutcomeError",
    "PredictionClient",
    "check_health",
    "infer_logits",
    "predict_request",
    "to_attributes",
    "wait_until_serving",
]
