"""The ``mlpair.inference.v1.InferenceService`` servicer: converts and delegates, nothing more."""

from __future__ import annotations

import grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.inference import converters
from mlpair.inference.engine import InferenceEngine


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """Thin gRPC adapter over :class:`InferenceEngine`; errors are mapped by the interceptor."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    async def Infer(self, request: pb.InferRequest, context: grpc.aio.ServicerContext) -> pb.InferResponse:
        result = await self.engine.infer(
            request.model_name, request.model_version,
            converters.feature_version(context.invocation_metadata()),
            converters.tensor_in(request.inputs),
        )
        return converters.infer_response(result)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        model = self.engine.model(request.model_name, request.model_version)
        return converters.metadata_response(model, self.engine.models()[request.model_name])
