"""The distributed engine of ``mlpair score``, measured: Ray Data (chosen) beside Dask distributed.

Not a test: one run per engine prints one JSON line (docs/batch-scoring.md, "Why Ray Data", quotes them).
Each engine runs in its own virtualenv, installed with only what it needs beside pyarrow and pandas
(``pip install 'ray[data]' pyarrow pandas``; ``pip install 'dask[distributed,dataframe]' pyarrow
pandas``), and is run with that virtualenv's Python::

    /tmp/rayenv/bin/python bench/score_engines.py ray --rows 1000000
    /tmp/daskenv/bin/python bench/score_engines.py dask --rows 1000000

Per engine, on this machine and a local cluster of two one-CPU workers:

* ``install_mb``: the size of the engine's own distributions (site-packages less pyarrow, pandas,
  numpy and pip, which the scoring job has either way);
* ``import_s``: importing the engine in a fresh process;
* ``start_s``: starting the cluster until both workers accept work (Ray: a head node and a second
  node, ``ray start`` processes with their own temporary folder and ports; Dask: ``LocalCluster``);
* ``small_s`` and ``large_s``: the same trivial job (each partition of a Parquet file read, a column
  added to each batch of ``--batch-rows`` rows by a stateful per-worker UDF, written back as Parquet)
  on ``--rows // 10`` and ``--rows`` rows, warm; ``per_row_us``: their difference per extra row, the
  engine's cost per row beyond its fixed cost per job.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SHARED = ("pyarrow", "pandas", "numpy", "pip", "setuptools")


def install_mb() -> float:
    """MB of site-packages other than the distributions every engine's job has anyway."""
    site = Path(sysconfig.get_paths()["purelib"])
    total = 0
    for path in site.rglob("*"):
        top = path.relative_to(site).parts[0].lower()
        if path.is_file() and not any(top.startswith(name) for name in SHARED):
            total += path.stat().st_size
    return round(total / 1e6, 1)


def parquet(folder: Path, rows: int, files: int = 8) -> Path:
    """``rows`` rows of a key and two attributes in ``files`` Parquet files under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = rows // files
    for n in range(files):
        keys = np.arange(n * per, (n + 1) * per)
        pq.write_table(pa.table({"key": keys, "Income": rng.integers(0, 500, per), "Amount": rng.integers(100, 5000, per)}),
                       folder / f"part-{n}.parquet")
    return folder


class Scorer:
    """Per-worker state (as the scoring job's client is) and a trivial decision per row."""

    def __init__(self) -> None:
        self.threshold = 0.5

    def __call__(self, batch: pa.Table) -> pa.Table:
        ratio = pc.divide(pc.cast(batch["Amount"], pa.float64()), pc.add(pc.cast(batch["Income"], pa.float64()), 1.0))
        return pa.table({"key": batch["key"], "decision": pc.greater(ratio, self.threshold)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def stop_nodes(nodes: list[subprocess.Popen]) -> None:
    """SIGTERM to each ``ray start --block`` (it stops its node), then SIGKILL to whatever of its
    process group is left after a short grace (a node that drains its actors takes 30 s)."""
    for node in nodes:
        node.terminate()
    deadline = time.monotonic() + 10
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def run_ray(args: argparse.Namespace, work: Path) -> dict:
    started = time.perf_counter()
    import ray

    imported = time.perf_counter() - started
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    head = ["--head", f"--port={port}", f"--temp-dir={temp}", "--num-cpus=1", "--include-dashboard=false",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}"]
    log = (work / "ray-start.log").open("w")
    t0 = time.perf_counter()
    # --block: each `ray start` stays in the foreground and ends its node's processes when it is
    # ended; each runs in a session of its own, so its process group is exactly that node.
    nodes = [subprocess.Popen([ray_bin, "start", "--block", *head], env=env, start_new_session=True,
                              stdout=log, stderr=log)]
    address = f"127.0.0.1:{port}"
    while not reachable(port):
        if nodes[0].poll() is not None:
            raise RuntimeError(f"ray start --head failed: {(work / 'ray-start.log').read_text()[-2000:]}")
        time.sleep(0.1)
    nodes.append(subprocess.Popen([ray_bin, "start", "--block", f"--address={address}", "--num-cpus=1", f"--temp-dir={temp}",
                                   f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}"],
                                  env=env, start_new_session=True, stdout=log, stderr=log))
    try:
        ray.init(address=address, logging_level="ERROR")
        while ray.cluster_resources().get("CPU", 0) < 2:
            time.sleep(0.1)
        ray.get([ray.remote(num_cpus=1)(lambda: 1).remote() for _ in range(2)])
        start_s = time.perf_counter() - t0

        def job(source: Path, rows: int) -> float:
            out = work / f"out-{next(RUNS)}"
            t = time.perf_counter()
            ds = ray.data.read_parquet(str(source))
            ds = ds.map_batches(Scorer, batch_size=args.batch_rows, batch_format="pyarrow",
                                concurrency=2, num_cpus=0)
            ds.write_parquet(str(out))
            took = time.perf_counter() - t
            assert sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet")) == rows
            return took

        return {"import_s": imported, "start_s": start_s, **timed(job, work)}
    finally:
        ray.shutdown()
        stop_nodes(nodes)
        shutil.rmtree(temp, ignore_errors=True)


def run_dask(args: argparse.Namespace, work: Path) -> dict:
    started = time.perf_counter()
    import dask.dataframe as dd
    from dask.distributed import Client, LocalCluster

    imported = time.perf_counter() - started
    t0 = time.perf_counter()
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = Client(cluster)
    client.wait_for_workers(2)
    start_s = time.perf_counter() - t0
    try:
        def job(source: Path, rows: int) -> float:
            out = work / f"out-{next(RUNS)}"
            t = time.perf_counter()

            def score(frame):  # a pandas partition, cut in batches as map_batches does
                scorer = Scorer()
                table = pa.Table.from_pandas(frame, preserve_index=False)
                parts = [scorer(table.slice(i, args.batch_rows)) for i in range(0, table.num_rows, args.batch_rows)]
                return pa.concat_tables(parts).to_pandas() if parts else frame.assign(decision=False)[["key", "decision"]]

            frame = dd.read_parquet(str(source))
            frame.map_partitions(score, meta={"key": "i8", "decision": "bool"}).to_parquet(str(out))
            took = time.perf_counter() - t
            assert sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet")) == rows
            return took

        return {"import_s": imported, "start_s": start_s, **timed(job, work)}
    finally:
        client.close()
        cluster.close()


def timed(job, work: Path) -> dict:
    rows = ARGS.rows
    small, large = parquet(work / "small", rows // 10), parquet(work / "large", rows)
    first_s = job(small, rows // 10)  # cold: workers started, code shipped
    small_s = min(job(small, rows // 10) for _ in range(2))
    large_s = min(job(large, rows) for _ in range(2))
    return {"first_job_s": first_s, "small_s": small_s, "large_s": large_s, "per_row_us": (large_s - small_s) / (rows - rows // 10) * 1e6}


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=["ray", "dask"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-rows", type=int, default=10_000)
    ARGS = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    with tempfile.TemporaryDirectory() as folder:
        result = (run_ray if ARGS.engine == "ray" else run_dask)(ARGS, Path(folder))
    result = {"engine": ARGS.engine, "rows": ARGS.rows, "batch_rows": ARGS.batch_rows, "install_mb": install_mb(),
              **{k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}}
    print(json.dumps(result))


ARGS: argparse.Namespace
RUNS = itertools.count()

if __name__ == "__main__":
    main()
