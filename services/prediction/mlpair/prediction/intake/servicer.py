"""The ``mlpair.prediction.v1.PredictionService`` servicer: converts and delegates, nothing more."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.prediction import metrics
from mlpair.prediction.feedback.items import OutcomesNotServed
from mlpair.prediction.feedback.store import OutcomeStore
from mlpair.prediction.intake import converters, outcome_wire, tables
from mlpair.prediction.intake.limits import CallerGate, MemoryLimiter
from mlpair.prediction.intake.priority import PriorityPolicy
from mlpair.prediction.pipeline import Predictor

DECIDING_METHODS = frozenset({"PredictionServicer.Predict", "PredictionServicer.BatchPredict"})


def count_refused_calls(predictor: Predictor):
    """The hook :func:`mlpair.rpc.guard_servicer` calls for a call refused before its method ran
    (malformed message, unknown fields, conflicting metadata, the drain): a Predict or BatchPredict
    among them is counted once in ``prediction_requests_total`` with its code, under the family it
    named when that family is served, else ``unknown`` (the pipeline counts the calls it decides)."""

    def refused(method: str, request: object, code: str) -> None:
        if method not in DECIDING_METHODS:
            return
        name = (request.model_name or predictor.default_model) if isinstance(request, pb.PredictRequest) else ""
        metrics.labelled(metrics.REQUESTS, name if name in predictor.families else "unknown", code).inc()

    return refused


class PredictionServicer(pb_grpc.PredictionServiceServicer):
    """Thin gRPC adapter over :class:`Predictor`; errors are mapped to statuses by
    :func:`mlpair.rpc.guard_servicer`."""

    def __init__(
        self,
        predictor: Predictor,
        max_chunk_rows: int = 10_000,
        outcomes: OutcomeStore | None = None,
        max_outcome_items: int = 10_000,
        priorities: PriorityPolicy | None = None,
        gate: CallerGate | None = None,
    ) -> None:
        """``gate``: who each call's caller is and how much it may ask (None: every caller
        anonymous, no limit)."""
        self.predictor = predictor
        self.max_chunk_rows = max_chunk_rows
        self.outcomes = outcomes
        self.max_outcome_items = max_outcome_items
        self.priorities = priorities or PriorityPolicy()
        self.gate = gate or CallerGate(MemoryLimiter({}, lambda caller: caller))

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        """Decides one request (or returns the decision on record for its ``request_id``), once
        its caller is established and within its limit (:mod:`mlpair.prediction.intake.limits`).

        Raises:
            InvalidCaller, CallerRateLimited, LimitUnavailable: as :meth:`CallerGate.admit` raises
                them; nothing is decided or recorded.
            PredictionError: as :meth:`Predictor.predict` raises it (invalid request, unknown model,
                reused idempotency key, InferenceService refused or failed, ledger unavailable); the
                guard turns it into the call's status with its ErrorInfo.
        """
        self.priorities.enter(
            context.invocation_metadata(), self.priorities.online
        )  # refused before any limit is taken
        caller = await self.gate.admit(context, 1)
        result = await self.predictor.predict(converters.predict_input(request, converters.deadline(context), caller))
        return converters.predict_response(result)

    async def BatchPredict(
        self, request: pb.BatchPredictRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchPredictResponse:
        """Decides each item of a batch; every item gets its own response or error status, in order.

        Raises:
            InvalidRequest: more items than ``max_batch_items`` (nothing is decided).
            InvalidCaller, CallerRateLimited, LimitUnavailable: as :meth:`CallerGate.admit` raises
                them, the batch's items taken from the caller's limit together; nothing is decided.
        """
        self.priorities.enter(context.invocation_metadata(), self.priorities.bulk)
        n = len(request.requests)
        if n > self.predictor.max_batch_items:  # refused whole below, before it costs the caller's limit
            caller = self.gate.identify(context)
        else:
            caller = await self.gate.admit(context, n)
        inputs = converters.batch_inputs(request, converters.deadline(context), caller)
        outcomes = await self.predictor.predict_batch(inputs)
        return converters.batch_response(outcomes)

    async def PredictColumns(
        self, requests: AsyncIterator[pb.PredictColumnsRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """One response per request chunk, in order; a chunk refused as a whole (one over the
        caller's limit included: each chunk takes its rows from it) is answered with its error and
        the stream goes on (:mod:`mlpair.prediction.intake.tables`)."""
        deadline = converters.deadline(context)
        self.priorities.enter(context.invocation_metadata(), self.priorities.bulk)

        async def admit(rows: int) -> str:
            return await self.gate.admit(context, rows)

        async for request in requests:
            await context.write(
                await tables.decide_chunk(self.predictor, request, self.max_chunk_rows, deadline, admit)
            )

    async def RecordOutcomes(
        self, request: pb.RecordOutcomesRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordOutcomesResponse:
        """Stores each realised outcome or says why not, item by item (:mod:`mlpair.prediction.feedback.store`).

        Raises:
            InvalidRequest: more items than ``max_outcome_items`` (nothing is stored).
            OutcomesUnavailable: the ledger database failed (UNAVAILABLE; sending again is safe).
            OutcomesNotServed: no outcome store was wired in.
        """
        if self.outcomes is None:
            raise OutcomesNotServed("this PredictionService does not record outcomes")
        items = outcome_wire.outcome_items(request, self.max_outcome_items)
        return outcome_wire.outcomes_response(await self.outcomes.record(items))
