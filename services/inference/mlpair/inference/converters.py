"""Proto ⇄ domain conversions for both protocols InferenceService speaks (the only place that
knows the messages): the project's own ``mlpair.inference.v1`` API and the Open Inference
Protocol v2 (``inference.GRPCInferenceService``).

Tensors stay raw bytes end to end: request bytes become a numpy view without a copy, and the
logits go back as one ``bytes`` field.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.contracts import FEATURE_VERSION_KEY
from mlpair.contracts.manifest import TensorSpec
from mlpair.inference.engine import NON_FINITE_OUTPUT, InferResult
from mlpair.inference.errors import InvalidInput
from mlpair.inference.validation import TensorIn
from mlpair.inference.versions import ServedVersion, VersionStatus

"""gRPC metadata key (lower-case, as HTTP/2 requires) and OIP request parameter name."""


def feature_version(metadata) -> str | None:
    """The ``x-feature-version`` value from invocation metadata, matching the key in any case
    (HTTP/2 requires lower-case keys, but some gateways forward the caller's case).

    Raises:
        InvalidInput: the key was sent twice with different values (which one would be the caller's?).
    """
    found = None
    for key, value in metadata or ():
        if key.lower() == FEATURE_VERSION_KEY:
            value = value if isinstance(value, str) else value.decode()
            if found is not None and value != found:
                raise InvalidInput(
                    f"{FEATURE_VERSION_KEY} was sent twice with different values ({found[:64]!r}, "
                    f"{value[:64]!r}); send one",
                    metadata={"key": FEATURE_VERSION_KEY},
                )
            found = value
    return found


def deadline(context) -> float | None:
    """The call's deadline as a ``time.monotonic()`` instant, or None if the caller set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


# -- mlpair.inference.v1 ------------------------------------------------------------------------


def data_type_name(value: int) -> str:
    """``DATA_TYPE_FP32`` → ``"FP32"``; unspecified → ``""``; unknown numbers → ``"UNKNOWN(n)"``."""
    try:
        return pb.DataType.Name(value).removeprefix("DATA_TYPE_").replace("UNSPECIFIED", "")
    except ValueError:
        return f"UNKNOWN({value})"


def tensor_in(tensor: pb.Tensor) -> TensorIn:
    """The request's input tensor, not yet validated: its data type name (``"FP32"``, ``""`` when
    unspecified), shape and raw content bytes, which stay a reference to the message's bytes.
    """
    return TensorIn(data_type_name(tensor.data_type), tuple(tensor.shape), tensor.content)


def infer_response(result: InferResult) -> pb.InferResponse:
    """``result``'s logits ``[batch, n_classes]`` as one FP32 tensor of little-endian bytes, plus one
    row error (``NON_FINITE_OUTPUT``) per row ``result.invalid_rows`` names.
    """
    logits = result.logits
    response = pb.InferResponse(
        model_name=result.model_name,
        model_version=result.model_version,
        logits=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=logits.shape, content=_le_bytes(logits)),
    )
    for row in result.invalid_rows:
        response.row_errors.add(row=row, reason=NON_FINITE_OUTPUT, message="the model produced a non-finite logit")
    return response


def _spec(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, data_type=pb.DataType.Value(f"DATA_TYPE_{spec.data_type}"), shape=spec.shape)


def metadata_response(model: ServedVersion, available: list[str]) -> pb.ModelMetadataResponse:
    """A ``ModelMetadataResponse`` for ``model``: its manifest's tensors and version triple, the
    runtime's description and ``available`` (the versions serving, ascending).
    """
    manifest = model.entry.manifest
    triple = manifest.versions
    return pb.ModelMetadataResponse(
        model_name=manifest.model_name,
        model_version=model.version,
        available_versions=available,
        inputs=[_spec(s) for s in manifest.inputs],
        outputs=[_spec(s) for s in manifest.outputs],
        versions=pb.VersionTriple(
            model_version=triple.model_version,
            feature_schema_version=triple.feature_schema_version,
            preprocessing_hash=triple.preprocessing_hash,
        ),
        runtime=model.runtime.description,
    )


def _le_bytes(logits: np.ndarray) -> bytes:
    """Little-endian FP32 bytes of ``logits`` (no conversion when it already is)."""
    if logits.dtype != np.dtype("<f4"):
        logits = logits.astype("<f4")
    return logits.tobytes()


# -- Open Inference Protocol v2 -----------------------------------------------------------------


def oip_tensor_in(request: oip.ModelInferRequest) -> TensorIn:
    """The request's single input tensor, raw or typed.

    Raises:
        InvalidInput: no input, several inputs (naming duplicates), raw contents that do not
            match the inputs one to one, or raw and typed contents together.
    """
    inputs = request.inputs
    if len(inputs) != 1:
        if not inputs:
            raise InvalidInput("the request has no input tensor")
        dupes = [name for name, n in Counter(t.name for t in inputs).items() if n > 1]
        if dupes:
            raise InvalidInput(f"input {dupes[0]!r} appears more than once")
        raise InvalidInput(
            f"this model takes one input tensor; got {len(inputs)} ({', '.join(repr(t.name) for t in inputs)})"
        )
    tensor = inputs[0]
    raw = request.raw_input_contents
    if raw:
        if len(raw) != 1:
            raise InvalidInput(f"raw_input_contents has {len(raw)} entries for 1 input")
        if tensor.HasField("contents"):
            raise InvalidInput(f"input {tensor.name!r} has both raw and typed contents; send one")
        return TensorIn(tensor.datatype, tuple(tensor.shape), raw[0], None, tensor.name)
    values = tensor.contents.fp32_contents if tensor.datatype == "FP32" else ()
    return TensorIn(tensor.datatype, tuple(tensor.shape), None, values, tensor.name)


def oip_feature_version(request: oip.ModelInferRequest, metadata) -> str | None:
    """``x-feature-version`` from the request parameters or, failing that, the metadata.

    Raises:
        InvalidInput: the parameter is not a string, or the two disagree.
    """
    from_metadata = feature_version(metadata)
    if FEATURE_VERSION_KEY not in request.parameters:
        return from_metadata
    param = request.parameters[FEATURE_VERSION_KEY]
    if param.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"parameter {FEATURE_VERSION_KEY!r} must be a string")
    value = param.string_param
    if from_metadata is not None and from_metadata != value:
        raise InvalidInput(
            f"{FEATURE_VERSION_KEY} is {value!r} as a request parameter but {from_metadata!r} as metadata; send one"
        )
    return value


def oip_requested_outputs(request: oip.ModelInferRequest) -> tuple[str, ...]:
    """The output names the request asks for, in order; empty means every output."""
    return tuple(o.name for o in request.outputs)


def oip_infer_response(result: InferResult, request_id: str, raw: bool = True) -> oip.ModelInferResponse:
    """The logits as one FP32 output: raw little-endian bytes, or typed ``fp32_contents`` when not ``raw``."""
    logits = result.logits
    contents = None if raw else oip.InferTensorContents(fp32_contents=logits.ravel().tolist())
    return oip.ModelInferResponse(
        model_name=result.model_name,
        model_version=result.model_version,
        id=request_id,
        outputs=[
            oip.ModelInferResponse.InferOutputTensor(
                name=result.output_name, datatype="FP32", shape=logits.shape, contents=contents
            )
        ],
        raw_output_contents=[_le_bytes(logits)] if raw else [],
    )


def oip_metadata_response(model: ServedVersion, available: list[str]) -> oip.ModelMetadataResponse:
    """An OIP ``ModelMetadataResponse`` for ``model``: its tensors (data types as OIP names them,
    shapes as the manifest gives them, ``-1`` for a dynamic dimension), the runtime's platform and
    ``available`` versions.
    """
    manifest = model.entry.manifest

    def spec(s: TensorSpec) -> oip.ModelMetadataResponse.TensorMetadata:
        return oip.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.data_type, shape=s.shape)

    return oip.ModelMetadataResponse(
        name=manifest.model_name,
        versions=available,
        platform=model.runtime.platform,
        inputs=[spec(s) for s in manifest.inputs],
        outputs=[spec(s) for s in manifest.outputs],
    )


def oip_index_response(statuses: list[VersionStatus], ready_only: bool) -> oip.RepositoryIndexResponse:
    """A ``RepositoryIndexResponse`` with one entry per version in ``statuses`` (name, version,
    state, reason); only those in state ``READY`` when ``ready_only``.
    """
    return oip.RepositoryIndexResponse(
        models=[
            oip.RepositoryIndexResponse.ModelIndex(name=s.name, version=s.version, state=s.state, reason=s.reason)
            for s in statuses
            if not ready_only or s.state == "READY"
        ]
    )
