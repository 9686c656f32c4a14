"""Closed-loop load generator for any Open Inference Protocol v2 gRPC server.

``--concurrency N`` keeps N ``ModelInfer`` calls in flight (N asyncio workers spread over
``--channels`` connections, one by default; each send → wait → send). With ``--streams K`` the same N requests are kept in flight over K
``ModelStreamInfer`` streams instead (N / K per stream, pipelined: a new request is written as
soon as a response frees a place; responses are matched to requests by id). Each call carries
``--rows`` real rows as raw FP32 bytes, built once per worker, so the client spends as little
CPU per call as the protocol allows. Latency is the client-side wall time of one request;
only requests that start after the warm-up and end inside the window count. Throughput is
counted in rows/s (and requests/s).

Bounded: stops after ``--warmup-s + --duration-s`` (at most 600 s) or ``--max-requests``
calls, whichever comes first; every call has a ``--timeout-s`` deadline; only loopback
targets are accepted. Prints one JSON line.

    python bench/oip_load.py --url 127.0.0.1:8001 --model credit-risk --rows-file rows.npy \\
        --parameter x-feature-version=credit-risk/v1 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

import grpc
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.load import LOOPBACK, percentile  # noqa: E402

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process and its children (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return None


def output_values(reply) -> int:
    """FP32 values in the first output, whether sent as raw bytes or typed contents."""
    if reply.raw_output_contents:
        return len(reply.raw_output_contents[0]) // 4
    return len(reply.outputs[0].contents.fp32_contents) if reply.outputs else 0


def output_array(reply) -> np.ndarray:
    """The first output as ``[rows, n] float32``, raw bytes or typed contents (MLServer sends typed)."""
    shape = tuple(reply.outputs[0].shape)
    if reply.raw_output_contents:
        return np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(shape)
    return np.asarray(reply.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(shape)


def build_request(oip, args, rows: np.ndarray):
    params = {}
    for item in args.parameter:
        key, _, value = item.partition("=")
        params[key] = oip.InferParameter(string_param=value)
    tensor = oip.ModelInferRequest.InferInputTensor(name=args.input_name, datatype="FP32", shape=list(rows.shape))
    return oip.ModelInferRequest(model_name=args.model, model_version=args.model_version, parameters=params,
                                 inputs=[tensor], raw_input_contents=[np.ascontiguousarray(rows, "<f4").tobytes()])


async def run(args) -> dict:
    from mlpair.api.oip import grpc_predict_v2_pb2 as oip
    from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    data = np.load(args.rows_file).astype(np.float32)
    metadata = tuple((k.lower(), v) for k, _, v in (h.partition("=") for h in args.header))
    async with contextlib.AsyncExitStack() as opened:
        # one connection each (a local subchannel pool): a server's workers share a port and the
        # kernel spreads connections, not calls, over them
        stubs = [oip_grpc.GRPCInferenceServiceStub(await opened.enter_async_context(grpc.aio.insecure_channel(
            args.url, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]))) for _ in range(args.channels)]
        stub = stubs[0]
        await wait_ready(stub, oip, args)
        loop_start = time.perf_counter()
        t_measure = loop_start + args.warmup_s
        t_end = t_measure + args.duration_s
        latencies: list[float] = []
        errors: dict[str, int] = {}
        sent = 0

        def record(t0: float, t1: float, code: str | None) -> None:
            if t0 >= t_measure and t1 <= t_end:
                if code is None:
                    latencies.append(t1 - t0)
                else:
                    errors[code] = errors.get(code, 0) + 1

        async def worker(index: int) -> None:
            nonlocal sent
            start = (index * args.rows) % max(1, len(data) - args.rows)
            request = build_request(oip, args, data[start:start + args.rows])
            stub = stubs[index % len(stubs)]
            while sent < args.max_requests:
                sent += 1
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                try:
                    reply = await stub.ModelInfer(request, timeout=args.timeout_s, metadata=metadata)
                    ok = output_values(reply) == args.rows * args.n_outputs
                    code = None if ok else "BAD_OUTPUT"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                record(t0, time.perf_counter(), code)
                if code is not None:
                    await asyncio.sleep(0.001)

        async def stream_worker(index: int) -> None:
            """One stream with concurrency / streams requests in flight, pipelined."""
            nonlocal sent
            start = (index * args.rows) % max(1, len(data) - args.rows)
            request = build_request(oip, args, data[start:start + args.rows])
            places = asyncio.Semaphore(args.concurrency // args.streams)
            started: dict[str, float] = {}
            call = stubs[index % len(stubs)].ModelStreamInfer(metadata=metadata,
                                         timeout=args.warmup_s + args.duration_s + args.timeout_s)

            async def write() -> None:
                nonlocal sent
                k = 0
                while sent < args.max_requests:
                    await places.acquire()
                    t0 = time.perf_counter()
                    if t0 >= t_end:
                        break
                    sent += 1
                    request.id = f"{index}-{k}"  # serialised by write() at once: reusing the message is safe
                    k += 1
                    started[request.id] = t0
                    await call.write(request)
                await call.done_writing()

            async def read() -> None:
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        return
                    t1 = time.perf_counter()
                    response = reply.infer_response
                    t0 = started.pop(response.id, None)
                    if t0 is None:
                        code = "UNKNOWN_ID"
                    elif reply.error_message:
                        code = "STREAM_ERROR"
                    else:
                        code = None if output_values(response) == args.rows * args.n_outputs else "BAD_OUTPUT"
                    if t0 is not None:
                        record(t0, t1, code)
                    places.release()

            try:
                async with asyncio.TaskGroup() as group:  # one failing cancels the other
                    group.create_task(write())
                    group.create_task(read())
            except* grpc.aio.AioRpcError as failed:  # the stream itself failed: count its unanswered requests
                now, code = time.perf_counter(), failed.exceptions[0].code().name
                for t0 in started.values():
                    record(t0, now, code)

        cpu0 = cpu1 = server0 = server1 = None

        async def sample() -> None:
            nonlocal cpu0, cpu1, server0, server1
            await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
            cpu0, server0 = cpu_seconds(os.getpid()), cpu_seconds(args.server_pid) if args.server_pid else None
            await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
            cpu1, server1 = cpu_seconds(os.getpid()), cpu_seconds(args.server_pid) if args.server_pid else None

        sampler = asyncio.create_task(sample())
        workers = [stream_worker(i) for i in range(args.streams)] if args.streams \
            else [worker(i) for i in range(args.concurrency)]
        await asyncio.wait_for(asyncio.gather(*workers), timeout=args.warmup_s + args.duration_s + args.timeout_s + 5)
        await sampler
    lat = sorted(v * 1000 for v in latencies)
    out = {
        "url": args.url, "model": args.model, "concurrency": args.concurrency, "rows_per_request": args.rows,
        "rpc": f"ModelStreamInfer x{args.streams}" if args.streams else "ModelInfer", "channels": args.channels,
        "duration_s": args.duration_s, "requests": len(lat),
        "requests_per_s": round(len(lat) / args.duration_s, 1),
        "rows_per_s": round(len(lat) * args.rows / args.duration_s, 1),
        "p50_ms": _round(percentile(lat, 50)), "p99_ms": _round(percentile(lat, 99)),
        "errors": sum(errors.values()), "hit_max_requests": sent >= args.max_requests,
    }
    if errors:
        out["error_codes"] = errors
    if cpu0 is not None and cpu1 is not None:
        out["client_cpu_pct"] = round(100 * (cpu1 - cpu0) / args.duration_s, 1)
    if server0 is not None and server1 is not None:
        out["server_cpu_pct"] = round(100 * (server1 - server0) / args.duration_s, 1)
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def wait_ready(stub, oip, args) -> None:
    deadline = time.monotonic() + args.ready_timeout_s
    while True:
        try:
            ready = await stub.ModelReady(oip.ModelReadyRequest(name=args.model, version=args.model_version), timeout=2)
            if ready.ready:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"model {args.model!r} not ready at {args.url} after {args.ready_timeout_s} s")
        await asyncio.sleep(0.2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of the OIP gRPC endpoint (loopback only)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-version", default="")
    parser.add_argument("--rows-file", required=True, help=".npy file of [n, n_features] rows to send")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--n-outputs", type=int, default=2, help="FP32 values per output row (to check replies)")
    parser.add_argument("--input-name", default="features")
    parser.add_argument("--parameter", action="append", default=[], help="request parameter KEY=VALUE (string)")
    parser.add_argument("--header", action="append", default=[], help="metadata KEY=VALUE (sent lower-case)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--channels", type=int, default=1,
                        help="connections the concurrency is spread over (a server's workers each take some)")
    parser.add_argument("--streams", type=int, default=0,
                        help="0: unary ModelInfer calls; K: the concurrency over K ModelStreamInfer streams")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--max-requests", type=int, default=2_000_000)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--ready-timeout-s", type=float, default=60.0)
    parser.add_argument("--server-pid", type=int, default=0, help="process whose CPU is measured over the window")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if not args.url.startswith(LOOPBACK):
        parser.error(f"refusing non-loopback target {args.url!r}")
    if args.duration_s <= 0 or args.warmup_s < 0 or args.warmup_s + args.duration_s > 600 or args.concurrency < 1 \
            or args.channels < 1:
        parser.error("need concurrency >= 1, channels >= 1, duration-s > 0, warmup-s >= 0, warmup-s + duration-s <= 600")
    if args.streams < 0 or (args.streams and args.concurrency % args.streams):
        parser.error("--streams must divide --concurrency")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = asyncio.run(run(args))
    if args.label:
        out = {"label": args.label, **out}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
