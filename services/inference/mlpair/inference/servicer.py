"""gRPC servicers: thin adapters from both protocols onto one :class:`InferenceEngine`.

They convert (``converters``, ``oip_extensions``) and delegate, nothing more; errors are mapped
to statuses by :func:`mlpair.rpc.guard_servicer`. The one try/except here counts a call its
conversion refused (the engine counts every call it sees; :func:`count_refused_calls`, those the
guard refuses), then re-raises. The one
streaming RPC, ModelStreamInfer, answers each request through the same path as ModelInfer
(:mod:`mlpair.inference.streaming` turns a failed request into an error response on the stream).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator

import grpc
from google.protobuf.message import Message

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.errors import ServiceError
from mlpair.inference import converters, oip_extensions
from mlpair.inference.engine import InferenceEngine
from mlpair.inference.errors import DOMAIN, ModelControlDisabled
from mlpair.inference.streaming import AnswerStream
from mlpair.rpc import MalformedRequest, to_status
from mlpair.wire import Refused

SERVER_NAME = "mlpair-inference"
EXTENSIONS = ["model_configuration", "statistics", "parameters"]
"""OIP/Triton extensions implemented in full ("model_repository" too when model_control=explicit)."""


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    """Ends a streaming call with ``exc``'s rich status (the stream's counterpart of
    :func:`mlpair.rpc.guard_servicer`, which wraps unary methods only)."""
    status = to_status(exc.code, exc.message, exc.reason, DOMAIN, exc.metadata)
    await context.abort(status.code, status.details, status.trailing_metadata)


INFER_METHODS = frozenset({"InferenceServicer.Infer", "OpenInferenceServicer.ModelInfer"})


def count_refused_calls(engine: InferenceEngine):
    """The hook :func:`mlpair.rpc.guard_servicer` calls for a call refused before its method ran:
    an inference call among them is counted in ``inference_requests_total`` with its code."""

    def refused(method: str, request: object, code: str) -> None:
        if method in INFER_METHODS:
            engine.count_refusal(request.model_name if isinstance(request, Message) else "", code)

    return refused


@contextlib.contextmanager
def refusals_counted(engine: InferenceEngine, model_name: str) -> Iterator[None]:
    """Reading a request inside: a :class:`ServiceError` raised there (the call refused before it
    reaches the engine) is counted as the engine counts the calls it refuses, then raised."""
    try:
        yield
    except ServiceError as exc:
        engine.count_refusal(model_name, exc.code)
        raise


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """``mlpair.inference.v1.InferenceService``: the project's own API."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    async def Infer(self, request: pb.InferRequest, context: grpc.aio.ServicerContext) -> pb.InferResponse:
        """Raw logits ``[batch, n_classes]`` FP32 for ``request.inputs`` ``[batch, n_features]`` FP32.

        The feature version is read from the ``x-feature-version`` metadata and the deadline from the
        call; ``request.priority`` picks the batch-queue level (0 = the default); the engine validates the tensor and the version contract before any compute.

        Raises:
            InvalidInput: the metadata key was sent twice with different values (counted here as a
                refused call), or the tensor's dtype, shape, byte size or values (NaN, Inf) are invalid.
            Draining, ModelNotFound, ModelNotReady, ModelUnhealthy, FeatureVersionMismatch, QueueFull,
                DeadlineExpired, ModelFailure: as :meth:`InferenceEngine.infer` raises them.
        """
        with refusals_counted(self.engine, request.model_name):
            feature_version = converters.feature_version(context.invocation_metadata())
            tensor = converters.tensor_in(request.inputs)
        result = await self.engine.infer(
            request.model_name,
            request.model_version,
            feature_version,
            tensor,
            converters.deadline(context),
            per_row_errors=request.per_row_errors,
            priority=request.priority,
        )
        return converters.infer_response(result)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        """The serving version's manifest (inputs, outputs, version triple), runtime and available versions.

        Raises:
            ModelNotFound, ModelNotReady: ``request.model_name`` (at ``model_version``, empty = the
                highest) is not serving.
        """
        model = self.engine.model(request.model_name, request.model_version)
        return converters.metadata_response(model, self.engine.repository.serving()[request.model_name])


class OpenInferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``: the Open Inference Protocol v2 on the same engine.

    The feature version arrives as the ``x-feature-version`` request parameter (string) or
    metadata key; ServerLive is true whenever the process answers, until a sticky CUDA error lost
    the device; ServerReady and ModelReady follow the engine's readiness (false while loading,
    warming up or draining, and while a model version is unhealthy after start).
    """

    def __init__(self, engine: InferenceEngine) -> None:
        from importlib.metadata import PackageNotFoundError, version

        self.engine = engine
        try:
            self.server_version = version("mlpair")
        except PackageNotFoundError:
            self.server_version = "unknown"

    async def ServerLive(self, request, context) -> oip.ServerLiveResponse:
        """Live while the process answers, until a sticky CUDA error has lost the device."""
        return oip.ServerLiveResponse(live=self.engine.live())

    async def ServerReady(self, request, context) -> oip.ServerReadyResponse:
        """Ready while every expected model is serving (loaded and warmed up) and no server-level problem
        (such as a lost device) is recorded; false while loading, and from the start of a drain."""
        return oip.ServerReadyResponse(ready=self.engine.ready())

    async def ModelReady(self, request: oip.ModelReadyRequest, context) -> oip.ModelReadyResponse:
        """Whether ``request.name`` (``request.version``, empty = any) is serving and healthy, and the
        server is not draining."""
        return oip.ModelReadyResponse(ready=self.engine.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context) -> oip.ServerMetadataResponse:
        """The server's name, package version and OIP extensions (``model_repository`` only with
        ``model_control=explicit``).
        """
        extensions = (
            [*EXTENSIONS, "model_repository"] if self.engine.settings.model_control == "explicit" else EXTENSIONS
        )
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=self.server_version, extensions=extensions)

    async def ModelMetadata(self, request: oip.ModelMetadataRequest, context) -> oip.ModelMetadataResponse:
        """The serving version's platform, input and output tensor metadata, and the versions serving.

        Raises:
            ModelNotFound, ModelNotReady: ``request.name`` (at ``request.version``, empty = the
                highest) is not serving.
        """
        model = self.engine.model(request.name, request.version)
        return converters.oip_metadata_response(model, self.engine.repository.serving()[request.name])

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        """Raw logits ``[batch, n_classes]`` FP32 as one output for the request's one FP32 input.

        ``x-feature-version`` comes from the request parameters or the metadata; the call's deadline,
        or a ``timeout`` parameter, bounds it; a ``priority`` parameter picks the batch-queue level. The logits are raw little-endian bytes unless the request
        asks for typed contents (``binary_data_output``, or the output's ``binary_data``, false).

        Raises:
            UnsupportedParameter: a parameter this server does not implement, or one of the wrong type.
            InvalidInput: a ``priority`` that is not a defined level, not exactly one input, raw and typed contents together, an unknown output, or
                a feature version that is not a string or disagrees between parameter and metadata.
            Draining, ModelNotFound, ModelNotReady, ModelUnhealthy, FeatureVersionMismatch, QueueFull,
                DeadlineExpired, ModelFailure: as :meth:`InferenceEngine.infer` raises them.
        """
        return await self._infer(request, context.invocation_metadata(), converters.deadline(context))

    async def ModelStreamInfer(
        self, request_iterator, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[oip.ModelStreamInferResponse]:
        """Bidirectional streaming: one response per request, in order (see :mod:`mlpair.inference.streaming`).

        ``x-feature-version`` comes from each request's parameters or the stream's metadata; the
        stream's deadline, if any, bounds every request on it.
        """
        metadata = context.invocation_metadata()
        deadline = converters.deadline(context)

        async def answer(request) -> oip.ModelStreamInferResponse:
            if isinstance(request, Refused):  # fields the contract does not define
                raise request.error
            if not isinstance(request, oip.ModelInferRequest):  # bytes that did not parse
                raise MalformedRequest("a stream message is not a valid ModelInferRequest message")
            return oip.ModelStreamInferResponse(infer_response=await self._infer(request, metadata, deadline))

        stream = AnswerStream(
            request_iterator,
            answer,
            oip_extensions.stream_error,
            max_in_flight=self.engine.settings.stream_max_in_flight,
            drain=self.engine.drain_started,
            abort=functools.partial(_abort, context),
        )
        async for response in stream.responses():
            yield response

    async def _infer(self, request: oip.ModelInferRequest, metadata, deadline: float | None) -> oip.ModelInferResponse:
        with refusals_counted(self.engine, request.model_name):
            options = oip_extensions.request_options(request)
            feature_version = converters.oip_feature_version(request, metadata)
            tensor = converters.oip_tensor_in(request)
            outputs = converters.oip_requested_outputs(request)
        result = await self.engine.infer(
            request.model_name,
            request.model_version,
            feature_version,
            tensor,
            options.deadline(deadline),
            outputs,
            priority=options.priority,
        )
        return oip_extensions.infer_response(result, request.id, options)

    async def ModelConfig(self, request: oip.ModelConfigRequest, context) -> oip.ModelConfigResponse:
        """The serving version's configuration: tensors, platform and batching settings.

        Raises:
            ModelNotFound, ModelNotReady: the model (version) is not serving.
        """
        model = self.engine.model(request.name, request.version)
        return oip_extensions.config_response(model, self.engine.settings, model.batcher.executes_inline)

    async def ModelStatistics(self, request: oip.ModelStatisticsRequest, context) -> oip.ModelStatisticsResponse:
        """Per-version inference counts and durations for every model (empty name), every version of
        ``request.name`` (empty version), or that one version.

        Raises:
            ModelNotFound, ModelNotReady: the named model, or that version of it, is not serving.
        """
        return oip_extensions.statistics_response(self.engine.versions(request.name, request.version))

    async def RepositoryIndex(self, request: oip.RepositoryIndexRequest, context) -> oip.RepositoryIndexResponse:
        """Every version the server has tried to load, with its state and reason; only those READY
        when ``request.ready``."""
        return converters.oip_index_response(self.engine.repository.index(), request.ready)

    async def RepositoryModelLoad(
        self, request: oip.RepositoryModelLoadRequest, context
    ) -> oip.RepositoryModelLoadResponse:
        """(Re)loads ``request.model_name`` from the repository per the version policy.

        Raises:
            ModelControlDisabled: the server runs without ``model_control=explicit``.
            ModelNotFound: the policy selects no version on disk.
            ModelLoadFailed: a wanted version failed to load (the previous versions keep serving).
        """
        self._require_explicit_control()
        await self.engine.repository.load_model(request.model_name)
        return oip.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: oip.RepositoryModelUnloadRequest, context
    ) -> oip.RepositoryModelUnloadResponse:
        """Retires every version of ``request.model_name``; requests already queued finish first.

        Raises:
            ModelControlDisabled: the server runs without ``model_control=explicit``.
            ModelNotFound: the model is not loaded.
        """
        self._require_explicit_control()
        await self.engine.repository.unload_model(request.model_name)
        return oip.RepositoryModelUnloadResponse()

    def _require_explicit_control(self) -> None:
        if self.engine.settings.model_control != "explicit":
            raise ModelControlDisabled("model load/unload RPCs need model_control=explicit on this server")
