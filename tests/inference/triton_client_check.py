"""Drives an OIP server with NVIDIA's ``tritonclient.grpc`` and prints what it saw as JSON.

Run as a subprocess by ``test_oip.py``: tritonclient registers the same ``inference.*``
protobuf names as ``mlpair.api.oip``, so the two cannot share one process.

    python triton_client_check.py URL MODEL FEATURE_VERSION ROWS.npy
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

WIRE_MESSAGES = ["ServerLiveRequest", "ServerLiveResponse", "ServerReadyResponse", "ModelReadyRequest",
                 "ModelReadyResponse", "ServerMetadataResponse", "ModelMetadataRequest", "ModelMetadataResponse",
                 "ModelInferRequest", "ModelInferResponse", "InferParameter", "InferTensorContents",
                 "RepositoryIndexRequest", "RepositoryIndexResponse", "RepositoryModelLoadRequest",
                 "RepositoryModelUnloadRequest", "ModelRepositoryParameter"]


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
    report["wire"] = {}
    for name in WIRE_MESSAGES:
        report["wire"].update(wire_fields(service_pb2.DESCRIPTOR.message_types_by_name[name]))
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    report["methods"] = {m.name: [m.input_type.full_name, m.output_type.full_name] for m in service.methods}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:5])
