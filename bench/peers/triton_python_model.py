"""Peer: Triton's Python backend model running ONNX Runtime (the tritonserver 2.51 binary
that ships inside the nvidia-pytriton wheel, without PyTriton's proxy hop).

Copied by ``bench/side_by_side.py`` to ``<repo>/<model>/1/model.py``. Triton's dynamic
batcher hands ``execute()`` several requests at once; their rows are concatenated into one
``session.run`` and the logits split back per request.
"""

import json

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(params["model_path"]["string_value"], options,
                                            providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name

    def execute(self, requests):
        parts = [pb_utils.get_input_tensor_by_name(r, "features").as_numpy() for r in requests]
        x = parts[0] if len(parts) == 1 else np.concatenate(parts)
        logits = self.session.run([self.output_name], {self.input_name: x})[0]
        responses, offset = [], 0
        for part in parts:
            out = logits[offset:offset + part.shape[0]]
            offset += part.shape[0]
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("logits", out)]))
        return responses

    def finalize(self):
        self.session = None
