"""``mlpair score`` on a million rows, killed halfway and run again: rows per second and exact counts.

Not a test: one run prints one JSON line (docs/performance.md quotes it). On this machine, against a
local pair (one InferenceService, one PredictionService with its relay) over a throw-away PostgreSQL
database (ledger and CRM):

1. ``--rows`` rows (default 1,000,000): the real credit-risk holdout resampled with replacement, each
   row under a fresh key, written as one Parquet file;
2. ``mlpair score`` in a subprocess (``--chunk-rows``, ``--parallel``), killed with SIGKILL once its
   state file records half of the chunks done;
3. the same command again, to its end;
4. the relay given time to deliver; then the ledger's and the CRM's rows and distinct request ids,
   the job's counts by outcome and the output's rows are compared with ``--rows``.

Reported: each run's wall seconds and rows per second (rows it finished / its wall time, start-up
included), the whole job's rows per second, the rows the killed run had decided that came back
replayed, and whether every count is exact (``exact``: ledger, CRM, output and the job's decided
plus replayed all equal ``--rows``, one row per request id).

    .venv/bin/python bench/score_job.py --rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlpair.jobs.sources import asyncpg_dsn  # noqa: E402
from tests.support.pair import REPO, holdout, machine, pair, scratch_postgres, trained_model  # noqa: E402


def applications(records: list[dict], rows: int, seed: int = 2024) -> pa.Table:
    """``rows`` holdout applicants drawn with replacement, each under a fresh key ``loan_id``."""
    names = sorted({name for record in records for name in record})
    picks = np.random.default_rng(seed).integers(0, len(records), rows)
    columns = {name: pa.array([records[i].get(name) for i in range(len(records))]) for name in names}
    index = pa.array(picks)
    table = pa.table({name: column.take(index) for name, column in columns.items()})
    return table.add_column(0, "loan_id", pa.array([f"loan-{i:08d}" for i in range(rows)]))


async def _counts(url: str) -> dict[str, list[int]]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        out = {}
        for name, table in (("ledger", "prediction.decision_ledger"), ("crm", "decisions")):
            row = await conn.fetchrow(f"SELECT count(*) AS n, count(DISTINCT request_id) AS ids FROM {table}")
            out[name] = [row["n"], row["ids"]]
        return out
    finally:
        await conn.close()


def counts(url: str) -> dict[str, list[int]]:
    return asyncio.run(_counts(url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chunk-rows", type=int, default=10_000)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of the chunks done when it is killed")
    parser.add_argument("--model-repository", default=str(REPO / "var" / "models"))
    args = parser.parse_args()

    entry = trained_model(Path(args.model_repository))
    with tempfile.TemporaryDirectory(prefix="score-job-") as tmp, scratch_postgres() as url:
        if url is None:
            sys.exit("PostgreSQL is not reachable on 127.0.0.1:5432")
        work = Path(tmp)
        source, output = work / "applications.parquet", work / "decisions.parquet"
        pq.write_table(applications(holdout(entry).records, args.rows), source)
        p = pair(work / "pair", Path(args.model_repository), crm_url=url)
        p.start()
        try:
            argv = [sys.executable, "-m", "mlpair.cli", "score", "--input", str(source), "--key", "loan_id",
                    "--model", "credit-risk", "--target", p.prediction.address, "--output", str(output),
                    "--state-dir", str(work / "jobs"), "--chunk-rows", str(args.chunk_rows),
                    "--parallel", str(args.parallel)]
            chunks = -(-args.rows // args.chunk_rows)
            started = time.monotonic()
            first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            done = 0
            while first.poll() is None:
                states = list((work / "jobs").glob("*/state.json"))
                if states:
                    try:
                        done = len(json.loads(states[0].read_text())["chunks"])
                    except (ValueError, OSError):
                        done = 0
                    if done >= chunks * args.kill_at:
                        first.send_signal(signal.SIGKILL)
                        break
                time.sleep(0.01)
            first.wait()
            first_s = time.monotonic() - started
            (state_path,) = (work / "jobs").glob("*/state.json")
            killed = json.loads(state_path.read_text())
            killed_rows = sum(c["rows"] for c in killed["chunks"].values())
            ledger_at_kill = counts(url)["ledger"][0]

            started = time.monotonic()
            second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
            second_s = time.monotonic() - started
            if second.returncode != 0:
                sys.exit(f"the rerun failed: {second.stderr.strip()}")
            state = json.loads(state_path.read_text())
            outcome = {o: sum(c[o] for c in state["chunks"].values()) for o in ("decided", "replayed", "failed")}
            until = time.monotonic() + 600
            while counts(url)["crm"][0] < args.rows and time.monotonic() < until:
                time.sleep(1)
            final = counts(url)
            out_rows = pq.read_metadata(output).num_rows
        finally:
            p.stop()
    exact = (
        final["ledger"] == [args.rows, args.rows]
        and final["crm"] == [args.rows, args.rows]
        and out_rows == args.rows
        and outcome["decided"] + outcome["replayed"] + outcome["failed"] == args.rows
        and outcome["replayed"] == ledger_at_kill - killed_rows
    )
    print(json.dumps({
        "rows": args.rows, "chunk_rows": args.chunk_rows, "parallel": args.parallel,
        "killed_after_chunks": len(killed["chunks"]), "of_chunks": chunks,
        "first_run": {"seconds": round(first_s, 1), "rows_kept": killed_rows,
                      "rows_per_s": round(killed_rows / first_s), "ledger_rows_at_kill": ledger_at_kill},
        "rerun": {"seconds": round(second_s, 1), "rows_per_s": round((args.rows - killed_rows) / second_s)},
        "job_rows_per_s": round(args.rows / (first_s + second_s)),
        "outcomes": outcome, "ledger": final["ledger"], "crm": final["crm"], "output_rows": out_rows,
        "exact": exact, "machine": machine(),
    }))


if __name__ == "__main__":
    main()
