"""Drives an OIP server with NVIDIA's ``tritonclient.grpc`` and prints what it saw as JSON.

Run as a subprocess by ``test_oip.py`` and ``test_triton_client.py``: tritonclient registers the
same ``inference.*`` protobuf names as ``mlpair.api.oip``, so the two cannot share one process.

    python triton_client_check.py URL MODEL FEATURE_VERSION ROWS.npy            # inference, wire
    python triton_client_check.py --every-call URL MODEL FEATURE_VERSION ROWS.npy
    python triton_client_check.py --cancel URL MODEL FEATURE_VERSION ROWS.npy   # steered on stdin
"""

from __future__ import annotations

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

WIRE_MESSAGES = ["ServerLiveRequest", "ServerLiveResponse", "ServerReadyResponse", "ModelReadyRequest",
                 "ModelReadyResponse", "ServerMetadataResponse", "ModelMetadataRequest", "ModelMetadataResponse",
                 "ModelInferRequest", "ModelInferResponse", "InferParameter", "InferTensorContents",
                 "RepositoryIndexRequest", "RepositoryIndexResponse", "RepositoryModelLoadRequest",
                 "RepositoryModelUnloadRequest", "ModelRepositoryParameter", "ModelStreamInferResponse",
                 "ModelConfigRequest", "ModelConfigResponse", "ModelStatisticsRequest", "ModelStatisticsResponse",
                 "ModelStatistics", "StatisticDuration", "InferStatistics", "InferBatchStatistics", "MemoryUsage",
                 "InferResponseStatistics"]
# In Triton's model_config.proto (a second file); the test compares the fields both declare.
CONFIG_MESSAGES = ["ModelConfig", "ModelInput", "ModelOutput", "ModelTensorReshape", "ModelDynamicBatching",
                   "ModelQueuePolicy", "ModelInstanceGroup", "ModelVersionPolicy", "ModelParameter"]


def wire_fields(descriptor) -> dict:
    """Field name → (number, type, label) for a message and its nested messages."""
    out = {}
    for field in descriptor.fields:
        out[f"{descriptor.full_name}.{field.name}"] = [field.number, field.type, field.is_repeated]
    for nested in descriptor.nested_types:
        out.update(wire_fields(nested))
    return out


def main(url: str, model: str, feature_version: str, rows_path: str) -> None:
    x = np.load(rows_path).astype(np.float32)
    client = triton.InferenceServerClient(url=url, channel_args=[("grpc.max_receive_message_length", 16 << 20)])
    report: dict = {
        "live": client.is_server_live(), "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model), "server": client.get_server_metadata(as_json=True),
        "metadata": client.get_model_metadata(model, as_json=True),
    }

    def infer(**kwargs):
        inp = triton.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp], outputs=[triton.InferRequestedOutput("logits")], request_id="req-1", **kwargs)
        response = result.get_response()
        return {"logits": result.as_numpy("logits").tolist(), "version": response.model_version, "id": response.id}

    report["by_parameter"] = infer(parameters={"x-feature-version": feature_version})
    report["by_header"] = infer(headers={"x-feature-version": feature_version})
    try:
        infer(parameters={"x-feature-version": "credit-risk/v0"})
        report["stale_error"] = None
    except InferenceServerException as exc:
        report["stale_error"] = {"status": exc.status(), "message": exc.message()}
    from tritonclient.grpc import model_config_pb2

    report["wire"] = {}
    for name in WIRE_MESSAGES:
        report["wire"].update(wire_fields(service_pb2.DESCRIPTOR.message_types_by_name[name]))
    for name in CONFIG_MESSAGES:
        report["wire"].update(wire_fields(model_config_pb2.DESCRIPTOR.message_types_by_name[name]))
    report["data_types"] = {v.name: v.number for v in model_config_pb2.DataType.DESCRIPTOR.values}
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    report["methods"] = {m.name: [m.input_type.full_name, m.output_type.full_name] for m in service.methods}
    print(json.dumps(report))


def outcome(call) -> dict:
    """``{"ok": what it returned}`` or ``{"status": "StatusCode.X", "message": ...}``."""
    try:
        return {"ok": call()}
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}


def every_call(url: str, model: str, feature_version: str, rows_path: str) -> None:
    """Every call of the gRPC client: what it returned or the status it was refused with."""
    x = np.load(rows_path).astype(np.float32)
    client = triton.InferenceServerClient(url=url)
    fv = {"x-feature-version": feature_version}

    def rows(n: int, start: int = 0) -> list:
        inp = triton.InferInput("features", [n, x.shape[1]], "FP32")
        inp.set_data_from_numpy(x[start:start + n])
        return [inp]

    def infer(inputs=None, outputs=None, **kwargs):
        result = client.infer(model, inputs or rows(2), outputs=outputs, parameters=kwargs.pop("parameters", fv),
                              **kwargs)
        return result.as_numpy("logits").tolist()

    report: dict = {"extensions": client.get_server_metadata(as_json=True).get("extensions", []),
                    "config": outcome(lambda: client.get_model_config(model, as_json=True)["config"]),
                    "index": outcome(lambda: client.get_model_repository_index(as_json=True))}

    done: queue.Queue = queue.Queue()
    client.async_infer(model, rows(3), lambda result, error: done.put((result, error)), request_id="async-1",
                       parameters=fv)
    result, error = done.get(timeout=30)
    report["async_infer"] = {"id": result.get_response().id, "shape": list(result.as_numpy("logits").shape)} \
        if error is None else {"status": error.status(), "message": error.message()}

    # One stream: a good request, a bad one (NaN features), a good one; then one more after the
    # error arrived, to show the stream is still alive.
    answers: queue.Queue = queue.Queue()

    def on_response(result, error) -> None:
        answers.put({"id": result.get_response().id, "shape": list(result.as_numpy("logits").shape)}
                    if error is None else {"error": error.message()})

    bad = rows(1)
    nan = x[:1].copy()
    nan[0, 0] = np.nan
    bad[0].set_data_from_numpy(nan)
    client.start_stream(on_response, headers=fv)
    client.async_stream_infer(model, rows(1), request_id="s1")
    client.async_stream_infer(model, bad, request_id="s2")
    client.async_stream_infer(model, rows(2, 5), request_id="s3")
    stream = [answers.get(timeout=30) for _ in range(3)]
    client.async_stream_infer(model, rows(1, 9), request_id="s4")
    stream.append(answers.get(timeout=30))
    client.stop_stream()
    report["stream"] = stream

    report["statistics"] = outcome(lambda: client.get_inference_statistics(model, as_json=True)["model_stats"])
    report["statistics_all"] = outcome(lambda: [(s["name"], s.get("version", "")) for s in
                                                client.get_inference_statistics(as_json=True)["model_stats"]])
    shm = rows(2)
    shm[0].set_shared_memory("region", 2 * x.shape[1] * 4)
    report["refused"] = {name: outcome(call) for name, call in {
        "load_model": lambda: client.load_model(model),
        "unload_model": lambda: client.unload_model(model),
        "get_trace_settings": lambda: client.get_trace_settings(as_json=True),
        "update_trace_settings": lambda: client.update_trace_settings(settings={"trace_rate": "1"}, as_json=True),
        "get_log_settings": lambda: client.get_log_settings(as_json=True),
        "update_log_settings": lambda: client.update_log_settings(settings={"log_info": True}, as_json=True),
        "get_system_shared_memory_status": lambda: client.get_system_shared_memory_status(as_json=True),
        "register_system_shared_memory": lambda: client.register_system_shared_memory("r", "/key", 64),
        "unregister_system_shared_memory": lambda: client.unregister_system_shared_memory(),
        "get_cuda_shared_memory_status": lambda: client.get_cuda_shared_memory_status(as_json=True),
        "register_cuda_shared_memory": lambda: client.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64),
        "unregister_cuda_shared_memory": lambda: client.unregister_cuda_shared_memory(),
        "infer sequence_id": lambda: infer(sequence_id=7, sequence_start=True),
        "infer undefined priority": lambda: infer(priority=9),
        "infer custom parameter": lambda: infer(parameters={**fv, "my_flag": True}),
        "infer classification": lambda: infer(outputs=[triton.InferRequestedOutput("logits", class_count=1)]),
        "infer shared-memory input": lambda: infer(shm),
    }.items()}
    report["honoured"] = {"infer timeout": outcome(lambda: infer(timeout=10_000_000)),
                          "infer priority": outcome(lambda: infer(priority=1)),
                          "infer plain": outcome(infer)}
    client.close()
    print(json.dumps(report))


def cancel(url: str, model: str, feature_version: str, rows_path: str) -> None:
    """Sends one row on a stream; on "more" three more; on "cancel" cancels the stream (stdin lines).

    Prints "sent" after each step and finally the JSON list of what the stream's callback got.
    """
    x = np.load(rows_path).astype(np.float32)
    client = triton.InferenceServerClient(url=url)
    got: list = []

    def send(i: int) -> None:
        inp = triton.InferInput("features", [1, x.shape[1]], "FP32")
        inp.set_data_from_numpy(x[i:i + 1])
        client.async_stream_infer(model, [inp], request_id=f"c{i}")

    client.start_stream(lambda result, error: got.append(
        result.get_response().id if error is None else {"error": error.status()}), headers={
        "x-feature-version": feature_version})
    send(0)
    print("sent", flush=True)
    assert sys.stdin.readline().strip() == "more"
    for i in (1, 2, 3):
        send(i)
    print("sent", flush=True)
    assert sys.stdin.readline().strip() == "cancel"
    client.stop_stream(cancel_requests=True)
    print(json.dumps(got), flush=True)
    client.close()


if __name__ == "__main__":
    modes = {"--every-call": every_call, "--cancel": cancel}
    if sys.argv[1] in modes:
        modes[sys.argv[1]](*sys.argv[2:6])
    else:
        main(*sys.argv[1:5])
