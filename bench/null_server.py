"""A do-nothing OIP v2 gRPC server (grpc.aio): the floor of a Python gRPC server here.

``ModelInfer`` answers zeros of the right shape without validation, batching, metrics or a
model, so the same load generator measures what the Python gRPC stack alone costs on this
machine, next to the real service. Not a product: a measuring stick (loopback only).

    python bench/null_server.py --port 8101 --model credit-risk
"""

from __future__ import annotations

import argparse

import grpc

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.commands.serve import run_loop
from mlpair.inference.settings import InferenceSettings


class NullServicer(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(self, model: str, n_outputs: int) -> None:
        self.model, self.n_outputs = model, n_outputs

    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=request.name == self.model)

    async def ModelInfer(self, request, context):
        rows = request.inputs[0].shape[0]
        return oip.ModelInferResponse(
            model_name=self.model, model_version="1", id=request.id,
            outputs=[oip.ModelInferResponse.InferOutputTensor(name="logits", datatype="FP32",
                                                              shape=[rows, self.n_outputs])],
            raw_output_contents=[bytes(4 * rows * self.n_outputs)])


async def main(args: argparse.Namespace) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(NullServicer(args.model, args.n_outputs), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="credit-risk")
    parser.add_argument("--n-outputs", type=int, default=2)
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"),
                        default=InferenceSettings.model_fields["event_loop"].default,
                        help="the event loop (default: InferenceService's, so the floor runs as the service does)")
    arguments = parser.parse_args()
    run_loop(main(arguments), arguments.event_loop)
