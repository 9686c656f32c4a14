"""InferenceService requests and replies (its own API and OIP), and models made slow or broken."""

from __future__ import annotations

import json
import time

import numpy as np

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.contracts.manifest import file_sha256
from mlpair.inference.runtimes import create_runtime
from tests.inference.helpers import MODEL

Tensor = oip.ModelInferRequest.InferInputTensor


def oip_request(x: np.ndarray | None = None, *, feature_version: str | None = None, datatype: str = "FP32",
                shape=None, raw: bytes | None = None, name: str = "features", **kw) -> oip.ModelInferRequest:
    params = {"x-feature-version": oip.InferParameter(string_param=feature_version)} if feature_version else {}
    shape = list(x.shape) if shape is None else shape
    raw = x.tobytes() if raw is None else raw
    return oip.ModelInferRequest(model_name=MODEL, inputs=[Tensor(name=name, datatype=datatype, shape=shape)],
                                 raw_input_contents=[raw], parameters=params, **kw)


def oip_logits(reply: oip.ModelInferResponse) -> np.ndarray:
    out = reply.outputs[0]
    assert (out.name, out.datatype) == ("logits", "FP32")
    return np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(tuple(out.shape))


def tensor(x: np.ndarray, data_type=pb.DATA_TYPE_FP32) -> pb.Tensor:
    return pb.Tensor(data_type=data_type, shape=x.shape, content=x.tobytes())


def request(x: np.ndarray, **kw) -> pb.InferRequest:
    return pb.InferRequest(model_name=MODEL, inputs=tensor(np.ascontiguousarray(x, dtype=np.float32)), **kw)


def logits_of(reply: pb.InferResponse) -> np.ndarray:
    return np.frombuffer(reply.logits.content, dtype="<f4").reshape(tuple(reply.logits.shape))


class SlowRuntime:
    """The real runtime, slowed down: a slow model to load and/or to run."""

    def __init__(self, inner, run_s: float) -> None:
        self.inner, self.run_s = inner, run_s
        self.description, self.platform = inner.description, inner.platform
        self.calls = 0

    def run(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        time.sleep(self.run_s)
        return self.inner.run(x)

    def device_memory_bytes(self):
        return None


def slow(load_s: float = 0.0, run_s: float = 0.0, made: list | None = None):
    def factory(entry, settings):
        time.sleep(load_s)
        runtime = SlowRuntime(create_runtime(entry, settings), run_s)
        if made is not None:
            made.append(runtime)
        return runtime
    return factory


def corrupt_model_file(entry_dir) -> None:
    """Makes the ONNX file unloadable while keeping the entry's hashes consistent (a real failed load)."""
    (entry_dir / "model.onnx").write_bytes(b"this is not an ONNX model")
    manifest = json.loads((entry_dir / "manifest.json").read_text())
    manifest["model_sha256"] = file_sha256(entry_dir / "model.onnx")
    (entry_dir / "manifest.json").write_text(json.dumps(manifest))


def with_parameter(request: oip.ModelInferRequest, key: str, **value) -> oip.ModelInferRequest:
    """``request`` with one more request parameter, e.g. ``with_parameter(r, "timeout", int64_param=50)``."""
    request.parameters[key].CopyFrom(oip.InferParameter(**value))
    return request
