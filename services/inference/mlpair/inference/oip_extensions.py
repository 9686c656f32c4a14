"""Proto ⇄ domain conversions for the OIP extensions: request parameters, streaming responses,
model configuration and statistics (Triton's ``grpc_service.proto`` and ``model_config.proto``
messages, declared with the same names and numbers in ``protos/inference``).

Request parameters are either honoured or refused with INVALID_ARGUMENT
(:class:`UnsupportedParameter`), never silently ignored; services/inference/README.md has the
table of every RPC and parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.inference.converters import FEATURE_VERSION_KEY, oip_infer_response
from mlpair.inference.engine import InferResult
from mlpair.inference.errors import UnsupportedParameter
from mlpair.inference.settings import InferenceSettings
from mlpair.inference.statistics import Duration, VersionStatistics
from mlpair.inference.versions import ServedVersion, VersionPolicy

TIMEOUT = "timeout"
BINARY_DATA_OUTPUT = "binary_data_output"
BINARY_DATA = "binary_data"
FINAL_RESPONSE_FLAG = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
PRIORITY = "priority"
REQUEST_PARAMETERS = (FEATURE_VERSION_KEY, TIMEOUT, PRIORITY, BINARY_DATA_OUTPUT, FINAL_RESPONSE_FLAG)
"""Request parameters this server honours; any other is refused."""

# Why a known parameter is refused (the rest are refused as unknown).
_REFUSED = {
    "sequence_id": "sequence batching is not implemented: these models are stateless",
    "sequence_start": "sequence batching is not implemented: these models are stateless",
    "sequence_end": "sequence batching is not implemented: these models are stateless",
    "shared_memory_region": "shared memory is not implemented: send tensors in the request",
    "shared_memory_byte_size": "shared memory is not implemented: send tensors in the request",
    "shared_memory_offset": "shared memory is not implemented: send tensors in the request",
    "classification": "the classification extension is not implemented: this server returns raw logits only",
    "binary_data_size": "binary_data_size belongs to the HTTP/REST protocol; over gRPC send raw_input_contents",
}


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a request's parameters ask for beyond the tensor itself.

    Attributes:
        timeout_s: the ``timeout`` parameter (µs on the wire) in seconds: the request fails with
            DEADLINE_EXCEEDED, never computed, if still queued after it; None = no timeout.
        typed_output: send logits as typed ``fp32_contents`` (``binary_data_output`` or the
            output's ``binary_data`` false) instead of ``raw_output_contents``.
        final_flag: add ``triton_final_response`` = true to the response (every response of
            these non-decoupled models is final), as ``triton_enable_empty_final_response`` asks.
        priority: the ``priority`` parameter (Triton's): batch-queue level, 1 the highest; 0 (absent)
            = the server's default level. Whether the level is defined is the engine's check.
    """

    timeout_s: float | None = None
    typed_output: bool = False
    final_flag: bool = False
    priority: int = 0

    def deadline(self, call_deadline: float | None) -> float | None:
        """The earlier of the call's deadline and this request's timeout (``time.monotonic()``)."""
        if self.timeout_s is None:
            return call_deadline
        own = time.monotonic() + self.timeout_s
        return own if call_deadline is None else min(own, call_deadline)


NO_OPTIONS = RequestOptions()


def request_options(request: oip.ModelInferRequest) -> RequestOptions:
    """The request's parameters (request, input and output level), checked.

    Raises:
        UnsupportedParameter: a parameter this server does not implement, or one of the wrong type.
    """
    params = request.parameters
    options = NO_OPTIONS
    if len(params) > 1 or (params and FEATURE_VERSION_KEY not in params):
        options = _request_level(params)
    inputs = request.inputs  # iterating a repeated field costs µs per request: test the usual case first
    if len(inputs) != 1 or inputs[0].parameters:
        for tensor in inputs:
            for key in tensor.parameters:
                raise UnsupportedParameter(
                    f"input {tensor.name!r} parameter {key!r}: "
                    + _REFUSED.get(key, "unknown input parameter; this server reads none")
                )
    outputs = request.outputs
    for output in outputs if outputs else ():
        for key, value in output.parameters.items():
            if key != BINARY_DATA:
                raise UnsupportedParameter(
                    f"output {output.name!r} parameter {key!r}: "
                    + _REFUSED.get(key, f"unknown output parameter; this server reads only {BINARY_DATA!r}")
                )
            options = RequestOptions(
                options.timeout_s, not _bool(value, f"output {BINARY_DATA}"), options.final_flag, options.priority
            )
    return options


def _request_level(params) -> RequestOptions:
    timeout_s, typed, final, priority = None, False, False, 0
    for key, value in params.items():
        if key == FEATURE_VERSION_KEY:
            continue  # read with the metadata by converters.oip_feature_version
        if key == TIMEOUT:
            micros = _natural(value, TIMEOUT, "microseconds")
            timeout_s = micros / 1e6 if micros else None  # 0 = no timeout, as in Triton
        elif key == PRIORITY:
            priority = _natural(value, PRIORITY, "1 = the highest level, 0 = the default")
        elif key == BINARY_DATA_OUTPUT:
            typed = not _bool(value, key)
        elif key == FINAL_RESPONSE_FLAG:
            final = _bool(value, key)
        else:
            raise UnsupportedParameter(
                f"parameter {key!r}: "
                + _REFUSED.get(key, f"unknown request parameter; this server reads {', '.join(REQUEST_PARAMETERS)}")
            )
    return RequestOptions(timeout_s, typed, final, priority)


def _natural(value: oip.InferParameter, key: str, what: str) -> int:
    """An integer parameter that may not be negative (``timeout``, ``priority``).

    Raises:
        UnsupportedParameter: not an int64/uint64 parameter, or negative.
    """
    kind = value.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise UnsupportedParameter(f"parameter {key!r} must be an integer ({what}), got {kind}")
    number = getattr(value, kind)
    if number < 0:
        raise UnsupportedParameter(f"parameter {key!r} must not be negative, got {number}")
    return number


def _bool(value: oip.InferParameter, what: str) -> bool:
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise UnsupportedParameter(f"parameter {what!r} must be a boolean")
    return value.bool_param


def infer_response(result: InferResult, request_id: str, options: RequestOptions) -> oip.ModelInferResponse:
    """The ModelInfer response, in the form the request's options ask for."""
    if options is NO_OPTIONS:
        return oip_infer_response(result, request_id)
    response = oip_infer_response(result, request_id, raw=not options.typed_output)
    if options.final_flag:
        response.parameters[FINAL_RESPONSE].bool_param = True
    return response


def stream_error(request: object, code: str, reason: str, message: str) -> oip.ModelStreamInferResponse:
    """A failed request's response on a stream: Triton's form (error_message, and the request's id
    in infer_response) plus the status code name and AIP-193 reason as response parameters."""
    response = oip.ModelStreamInferResponse(error_message=message)
    inner = response.infer_response
    inner.id = getattr(request, "id", "")
    inner.parameters["error_code"].string_param = code
    inner.parameters["error_reason"].string_param = reason
    return response


# -- model configuration ------------------------------------------------------------------------


def config_response(model: ServedVersion, settings: InferenceSettings, inline: bool) -> oip.ModelConfigResponse:
    """The configuration this server really runs ``model`` with.

    Tensor dims leave out the batch dimension (``max_batch_size`` > 0 says there is one), as in
    Triton; ``max_batch_size`` is the most rows per execution, while one request may carry up to
    ``max_request_rows`` (split server-side; in ``parameters`` with the other settings Triton's
    configuration has no field for).
    """
    manifest = model.entry.manifest
    runtime = model.runtime
    torch = runtime.platform.startswith("pytorch")
    config = oip.ModelConfig(
        name=model.name,
        platform=runtime.platform,
        backend="pytorch" if torch else "onnxruntime",
        version_policy=_version_policy(VersionPolicy.parse(settings.version_policy)),
        max_batch_size=settings.max_batch_size,
        input=[
            oip.ModelInput(name=s.name, data_type=_data_type(s.data_type), dims=s.shape[1:]) for s in manifest.inputs
        ],
        output=[
            oip.ModelOutput(name=s.name, data_type=_data_type(s.data_type), dims=s.shape[1:]) for s in manifest.outputs
        ],
        instance_group=[
            oip.ModelInstanceGroup(
                name=f"{model.name}_{model.version}",
                count=settings.execution_instances,
                kind=oip.ModelInstanceGroup.KIND_GPU
                if "cuda" in runtime.description.lower()
                else oip.ModelInstanceGroup.KIND_CPU,
            )
        ],
        default_model_filename=(manifest.torch_program or "") if torch else model.entry.model_path.name,
    )
    if settings.batching:
        config.dynamic_batching.CopyFrom(
            oip.ModelDynamicBatching(
                preferred_batch_size=sorted(settings.preferred_batch_sizes),
                max_queue_delay_microseconds=round(settings.max_queue_delay_ms * 1000),
                priority_levels=settings.priority_levels,
                default_priority_level=settings.default_level,
                default_queue_policy=oip.ModelQueuePolicy(
                    timeout_action=oip.ModelQueuePolicy.REJECT, allow_timeout_override=True
                ),
            )
        )
    triple = manifest.versions
    for key, value in {
        "runtime": runtime.description,
        "max_request_rows": settings.max_request_rows,
        "max_queue_rows": settings.max_queue_rows,
        "priority_queue_rows": ",".join(
            str(settings.priority_queue_rows[i] if i < len(settings.priority_queue_rows) else settings.max_queue_rows)
            for i in range(settings.priority_levels)
        ),
        "stream_max_in_flight": settings.stream_max_in_flight,
        "execution": "event loop" if inline else "executor",
        "deterministic": settings.deterministic,
        "feature_schema_version": triple.feature_schema_version,
        "preprocessing_hash": triple.preprocessing_hash,
    }.items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return oip.ModelConfigResponse(config=config)


def _data_type(name: str) -> str:
    """The OIP ``DataType`` name of a manifest data type (``FP32`` → ``TYPE_FP32``; BYTES is TYPE_STRING)."""
    return "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"


def _version_policy(policy: VersionPolicy) -> oip.ModelVersionPolicy:
    if policy.kind == "all":
        return oip.ModelVersionPolicy(all=oip.ModelVersionPolicy.All())
    if policy.kind == "latest":
        return oip.ModelVersionPolicy(latest=oip.ModelVersionPolicy.Latest(num_versions=policy.count))
    return oip.ModelVersionPolicy(specific=oip.ModelVersionPolicy.Specific(versions=policy.versions))


# -- statistics ---------------------------------------------------------------------------------


def statistics_response(versions: list[ServedVersion]) -> oip.ModelStatisticsResponse:
    """Each version's :class:`~mlpair.inference.statistics.VersionStatistics`, batch sizes ascending."""
    return oip.ModelStatisticsResponse(model_stats=[_model_statistics(v) for v in versions])


def _duration(d: Duration) -> oip.StatisticDuration:
    return oip.StatisticDuration(count=d.count, ns=d.ns)


def _model_statistics(model: ServedVersion) -> oip.ModelStatistics:
    stats: VersionStatistics = model.batcher.statistics
    memory = model.runtime.device_memory_bytes()
    return oip.ModelStatistics(
        name=model.name,
        version=model.version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=oip.InferStatistics(
            success=_duration(stats.success),
            fail=_duration(stats.fail),
            queue=_duration(stats.queue),
            compute_input=_duration(stats.compute_input),
            compute_infer=_duration(stats.compute_infer),
            compute_output=_duration(stats.compute_output),
        ),
        batch_stats=[
            oip.InferBatchStatistics(
                batch_size=size,
                compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for size, b in sorted(stats.batches.items())
        ],
        memory_usage=[] if memory is None else [oip.MemoryUsage(type="GPU", id=0, byte_size=memory)],
    )
