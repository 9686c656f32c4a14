"""The ``mlpair.prediction.v1.PredictionService`` servicer: converts and delegates, nothing more."""

from __future__ import annotations

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.prediction import converters
from mlpair.prediction.pipeline import Predictor


class PredictionServicer(pb_grpc.PredictionServiceServicer):
    """Thin gRPC adapter over :class:`Predictor`; errors are mapped by the interceptor."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        result = await self.predictor.predict(converters.predict_input(request, converters.deadline(context)))
        return converters.predict_response(result)

    async def BatchPredict(
        self, request: pb.BatchPredictRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchPredictResponse:
        outcomes = await self.predictor.predict_batch(converters.batch_inputs(request, converters.deadline(context)))
        return converters.batch_response(outcomes)
