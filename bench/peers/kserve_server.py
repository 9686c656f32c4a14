"""Peer: the KServe Python model server with a ``kserve.Model`` running ONNX Runtime.

Runs in its own virtualenv (``var/bench/venvs/kserve``). OIP v2 over gRPC on ``--grpc_port``
(KServe binds every interface; the benchmark only sends to 127.0.0.1). The Python
ModelServer has no server-side batcher (KServe batches in its Kubernetes agent sidecar), so
every request runs alone. Log level WARNING: the shipped INFO level writes one line per call.

    python kserve_server.py --onnx_model credit-risk=/path/model.onnx --http_port 8080 --grpc_port 8081
"""

import argparse
import logging

import kserve
import numpy as np
import onnxruntime as ort
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse


class OnnxModel(kserve.Model):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.load()

    def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.ready = True
        return self.ready

    async def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        x = np.ascontiguousarray(payload.inputs[0].as_numpy(), dtype=np.float32)
        logits = self.session.run([self.output_name], {self.input_name: x})[0]
        out = InferOutput(name="logits", shape=list(logits.shape), datatype="FP32")
        out.set_data_from_numpy(logits, binary_data=True)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=[out],
                             from_grpc=payload.from_grpc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser])
    parser.add_argument("--onnx_model", action="append", required=True, help="NAME=PATH of an ONNX model")
    args, _ = parser.parse_known_args()
    models = [OnnxModel(*item.split("=", 1)) for item in args.onnx_model]
    server = kserve.ModelServer()
    for name in ("kserve", "kserve.trace", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server.start(models)
