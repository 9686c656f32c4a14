"""Peer: NVIDIA PyTriton serving ONNX models with ONNX Runtime behind Triton's dynamic batcher.

Runs in its own virtualenv (``var/bench/venvs/pytriton``, see ``requirements-pytriton.txt``);
never imports mlpair. Each ``--model NAME=PATH`` is bound as a Python function that runs one
ONNX Runtime session (1 intra-op thread) on the batch Triton assembled. Path per request:
tritonserver (C++ gRPC front end, dynamic batcher) → Python-backend stub → PyTriton proxy →
this process. Loopback only. SIGTERM stops tritonserver and the proxies (context manager).

    python pytriton_server.py --model credit-risk=/path/model.onnx --grpc-port 8001 \\
        --http-port 8000 --metrics-port 8002 --max-batch 128 --max-queue-delay-us 1000
"""

from __future__ import annotations

import argparse
import signal
import sys

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def infer_function(path: str):
    sess = session(path)
    input_name, output_name = sess.get_inputs()[0].name, sess.get_outputs()[0].name

    @batch
    def infer(features: np.ndarray) -> dict[str, np.ndarray]:
        # features: [batch, n_features] float32, the batch Triton's dynamic batcher assembled.
        return {"logits": sess.run([output_name], {input_name: features})[0]}

    return infer, sess.get_inputs()[0].shape[1], sess.get_outputs()[0].shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=PATH of an ONNX model")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--max-queue-delay-us", type=int, default=1000)
    parser.add_argument("--workspace", required=True)
    args = parser.parse_args()

    config = TritonConfig(grpc_address="127.0.0.1", grpc_port=args.grpc_port, http_address="127.0.0.1",
                          http_port=args.http_port, metrics_address="127.0.0.1", metrics_port=args.metrics_port,
                          allow_gpu_metrics=False, log_verbose=0)
    batching = ModelConfig(max_batch_size=args.max_batch, batching=True,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the context manager tears Triton down
    with Triton(config=config, workspace=args.workspace) as triton:
        for item in args.model:
            name, _, path = item.partition("=")
            infer, n_features, n_outputs = infer_function(path)
            triton.bind(model_name=name, infer_func=infer,
                        inputs=[Tensor(name="features", dtype=np.float32, shape=(n_features,))],
                        outputs=[Tensor(name="logits", dtype=np.float32, shape=(n_outputs,))],
                        config=batching, strict=False)
        print(f"pytriton serving {[m.partition('=')[0] for m in args.model]} on 127.0.0.1:{args.grpc_port}",
              flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
