"""gRPC servicers: thin adapters from both protocols onto one :class:`InferenceEngine`.

They convert (``converters``) and delegate, nothing more; errors are mapped to statuses by
:func:`mlpair.rpc.guard_servicer`, so there is no try/except here.
"""

from __future__ import annotations

import grpc

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.inference import converters
from mlpair.inference.engine import InferenceEngine
from mlpair.inference.errors import ModelControlDisabled

SERVER_NAME = "mlpair-inference"


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """``mlpair.inference.v1.InferenceService``: the project's own API."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    async def Infer(self, request: pb.InferRequest, context: grpc.aio.ServicerContext) -> pb.InferResponse:
        result = await self.engine.infer(
            request.model_name, request.model_version,
            converters.feature_version(context.invocation_metadata()),
            converters.tensor_in(request.inputs), converters.deadline(context),
        )
        return converters.infer_response(result)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        model = self.engine.model(request.model_name, request.model_version)
        return converters.metadata_response(model, self.engine.repository.serving()[request.model_name])


class OpenInferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``: the Open Inference Protocol v2 on the same engine.

    The feature version arrives as the ``x-feature-version`` request parameter (string) or
    metadata key; ServerLive is true whenever the process answers; ServerReady and ModelReady
    follow the engine's readiness (false while loading, warming up or draining).
    """

    def __init__(self, engine: InferenceEngine) -> None:
        from importlib.metadata import PackageNotFoundError, version

        self.engine = engine
        try:
            self.server_version = version("mlpair")
        except PackageNotFoundError:
            self.server_version = "unknown"

    async def ServerLive(self, request, context) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.engine.ready())

    async def ModelReady(self, request: oip.ModelReadyRequest, context) -> oip.ModelReadyResponse:
        return oip.ModelReadyResponse(ready=self.engine.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context) -> oip.ServerMetadataResponse:
        extensions = ["model_repository"] if self.engine.settings.model_control == "explicit" else []
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=self.server_version, extensions=extensions)

    async def ModelMetadata(self, request: oip.ModelMetadataRequest, context) -> oip.ModelMetadataResponse:
        model = self.engine.model(request.name, request.version)
        return converters.oip_metadata_response(model, self.engine.repository.serving()[request.name])

    async def ModelInfer(self, request: oip.ModelInferRequest,
                         context: grpc.aio.ServicerContext) -> oip.ModelInferResponse:
        result = await self.engine.infer(
            request.model_name, request.model_version,
            converters.oip_feature_version(request, context.invocation_metadata()),
            converters.oip_tensor_in(request), converters.deadline(context),
            converters.oip_requested_outputs(request),
        )
        return converters.oip_infer_response(result, request.id)

    async def RepositoryIndex(self, request: oip.RepositoryIndexRequest, context) -> oip.RepositoryIndexResponse:
        return converters.oip_index_response(self.engine.repository.index(), request.ready)

    async def RepositoryModelLoad(self, request: oip.RepositoryModelLoadRequest,
                                  context) -> oip.RepositoryModelLoadResponse:
        self._require_explicit_control()
        await self.engine.repository.load_model(request.model_name)
        return oip.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: oip.RepositoryModelUnloadRequest,
                                    context) -> oip.RepositoryModelUnloadResponse:
        self._require_explicit_control()
        await self.engine.repository.unload_model(request.model_name)
        return oip.RepositoryModelUnloadResponse()

    def _require_explicit_control(self) -> None:
        if self.engine.settings.model_control != "explicit":
            raise ModelControlDisabled("model load/unload RPCs need model_control=explicit on this server")
