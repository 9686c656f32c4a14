"""A do-nothing PredictionService (grpc.aio): the floor of a Python gRPC prediction hop here.

``Predict`` and ``BatchPredict`` parse the request (gRPC does) and answer a fixed decision per
item — no features, no inference call, no calibration, no policy, no outbox, no metrics — so
the same load generator measures what the Python gRPC stack and the messages alone cost on
this machine, next to the real service (``make bench-predict --phases null ...``). Not a
product: a measuring stick (loopback only).

    python bench/null_prediction.py --port 9101
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.commands.serve import run_loop
from mlpair.prediction.settings import PredictionSettings


class NullPrediction(pb_grpc.PredictionServiceServicer):
    @staticmethod
    def _decide(request: pb.PredictRequest) -> pb.PredictResponse:
        return pb.PredictResponse(request_id=request.request_id, decision_id=request.request_id,
                                  decision_label="APPROVE", probability=0.5, model_version="1")

    async def Predict(self, request, context):
        return self._decide(request)

    async def BatchPredict(self, request, context):
        return pb.BatchPredictResponse(results=[pb.BatchPredictResult(prediction=self._decide(r))
                                                for r in request.requests])


async def main(args: argparse.Namespace) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 << 20)])
    pb_grpc.add_PredictionServiceServicer_to_server(NullPrediction(), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"),
                        default=PredictionSettings.model_fields["event_loop"].default,
                        help="the event loop (default: PredictionService's, so the floor runs as the service does)")
    arguments = parser.parse_args()
    run_loop(main(arguments), arguments.event_loop)
