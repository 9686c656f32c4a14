"""How a chunk of applicants travels as columns: Arrow IPC in a bytes field against typed protobuf
columns (the Open Inference Protocol's ``InferTensorContents``: ``fp64_contents`` for numbers,
``bytes_contents`` for strings), the two encodings PredictColumns could have used.

A benchmark, not a test: it reports numbers and asserts no speed.

For one chunk of real holdout applicants (resampled to ``--rows`` rows, a fresh id each) it times,
in CPU µs per row, the client's side (a ``pyarrow.Table`` → the request's bytes: what a data team
holding Parquet, pandas or Polars starts from) and the service's side (the bytes → the message →
one Python list per column, what the assembler reads: :func:`mlpair.prediction.intake.tables.read_chunk`
for Arrow). The encodings alternate within each round; medians of ``--rounds`` rounds.

    .venv/bin/python -m bench.column_encodings --rows 10000 --rounds 7
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import pyarrow as pa

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client.tables import to_ipc
from mlpair.prediction.intake.tables import read_chunk
from tests.support import pair as harness


def arrow_request(table: pa.Table) -> bytes:
    return pb.PredictColumnsRequest(model_name=harness.MODEL, arrow_ipc=to_ipc(table)).SerializeToString()


def arrow_read(data: bytes, rows: int) -> list[list]:
    chunk = read_chunk(pb.PredictColumnsRequest.FromString(data).arrow_ipc, rows)
    return [chunk.request_ids, chunk.entity_ids, *chunk.values]


def protobuf_request(table: pa.Table) -> bytes:
    """Each column as an OIP tensor: numbers in ``fp64_contents`` (nulls as NaN), strings as UTF-8
    ``bytes_contents`` (nulls as empty)."""
    request = oip.ModelInferRequest(model_name=harness.MODEL)
    for name, column in zip(table.column_names, table.columns):
        tensor = request.inputs.add(name=name, shape=[len(column)])
        if pa.types.is_floating(column.type) or pa.types.is_integer(column.type):
            tensor.datatype = "FP64"
            tensor.contents.fp64_contents.extend(column.cast(pa.float64()).fill_null(float("nan")).to_numpy())
        else:
            tensor.datatype = "BYTES"
            tensor.contents.bytes_contents.extend(v.encode() for v in column.fill_null("").to_pylist())
    return request.SerializeToString()


def protobuf_read(data: bytes, rows: int) -> list[list]:
    request = oip.ModelInferRequest.FromString(data)
    out = []
    for tensor in request.inputs:
        if tensor.datatype == "FP64":
            out.append([None if v != v else v for v in tensor.contents.fp64_contents])
        else:
            out.append([v.decode() or None for v in tensor.contents.bytes_contents])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    entry = harness.trained_model(Path(args.model_repository).resolve())
    chunk = list(itertools.islice(harness.credit_workload(entry, "encodings"), args.rows))
    table = pa.Table.from_pylist([{"request_id": r, "entity_id": e, **a} for r, e, a in chunk])
    encodings = {"arrow_ipc": (arrow_request, arrow_read), "protobuf_columns": (protobuf_request, protobuf_read)}
    assert arrow_read(arrow_request(table), args.rows) == protobuf_read(protobuf_request(table), args.rows)
    timings: dict[str, dict[str, list[float]]] = {name: {"client": [], "service": []} for name in encodings}
    sizes = {}
    for r in range(args.rounds):
        for name in encodings if r % 2 == 0 else reversed(list(encodings)):
            write, read = encodings[name]
            t0 = time.process_time()
            data = write(table)
            t1 = time.process_time()
            read(data, args.rows)
            t2 = time.process_time()
            timings[name]["client"].append(t1 - t0)
            timings[name]["service"].append(t2 - t1)
            sizes[name] = len(data)
    report = {
        name: {
            "client_cpu_us_per_row": round(1e6 * statistics.median(t["client"]) / args.rows, 3),
            "service_cpu_us_per_row": round(1e6 * statistics.median(t["service"]) / args.rows, 3),
            "bytes_per_row": round(sizes[name] / args.rows, 1),
        }
        for name, t in timings.items()
    }
    print(json.dumps({"bench": "column_encodings", "rows": args.rows, "rounds": args.rounds, **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
