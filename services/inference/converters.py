"""Proto ⇄ domain conversions for InferenceService (the only place that knows both)."""

from __future__ import annotations

import numpy as np

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.contracts.manifest import TensorSpec
from mlpair.inference.engine import InferResult, LoadedModel, TensorIn

FEATURE_VERSION_KEY = "x-feature-version"


def data_type_name(value: int) -> str:
    """``DATA_TYPE_FP32`` → ``"FP32"``; unknown enum numbers → ``"UNKNOWN(n)"``."""
    try:
        return pb.DataType.Name(value).removeprefix("DATA_TYPE_").replace("UNSPECIFIED", "")
    except ValueError:
        return f"UNKNOWN({value})"


def tensor_in(tensor: pb.Tensor) -> TensorIn:
    return TensorIn(data_type_name(tensor.data_type), tuple(tensor.shape), tensor.content)


def feature_version(metadata) -> str | None:
    """The ``x-feature-version`` value from invocation metadata, matching the key in any case
    (HTTP/2 requires lower-case keys, but some gateways forward the caller's case)."""
    for key, value in metadata or ():
        if key.lower() == FEATURE_VERSION_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def infer_response(result: InferResult) -> pb.InferResponse:
    logits = np.ascontiguousarray(result.logits, dtype="<f4")
    return pb.InferResponse(
        model_name=result.model_name, model_version=result.model_version,
        logits=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=logits.shape, content=logits.tobytes()),
    )


def _spec(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, data_type=pb.DataType.Value(f"DATA_TYPE_{spec.data_type}"), shape=spec.shape)


def metadata_response(model: LoadedModel, available: list[str]) -> pb.ModelMetadataResponse:
    manifest = model.entry.manifest
    triple = manifest.versions
    return pb.ModelMetadataResponse(
        model_name=manifest.model_name, model_version=model.version, available_versions=available,
        inputs=[_spec(s) for s in manifest.inputs], outputs=[_spec(s) for s in manifest.outputs],
        versions=pb.VersionTriple(model_version=triple.model_version,
                                  feature_schema_version=triple.feature_schema_version,
                                  preprocessing_hash=triple.preprocessing_hash),
        runtime=model.runtime.description,
    )
