"""Peer: a Seldon MLServer custom runtime that runs an ONNX model with ONNX Runtime.

Loaded by MLServer from ``model-settings.json`` (``"implementation":
"mlserver_runtime.OnnxModel"``, ``parameters.uri`` = the model file). With
``max_batch_size``/``max_batch_time`` set, MLServer's adaptive batcher concatenates queued
requests along dim 0 before ``predict()`` and splits the response afterwards.
"""

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(self.settings.parameters.uri, options,
                                             providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self._output = self._session.get_outputs()[0].name
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = np.ascontiguousarray(NumpyCodec.decode_input(payload.inputs[0]), dtype=np.float32)
        logits = self._session.run([self._output], {self._input: x})[0]
        return InferenceResponse(model_name=self.name, model_version=self.version, id=payload.id,
                                 outputs=[NumpyCodec.encode_output("logits", logits)])
