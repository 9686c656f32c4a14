"""What one durable decision costs, per row: the ledger's bulk commit and the CRM's delivery,
each priced in the Python process's CPU and in PostgreSQL's CPU.

A benchmark, not a test: it reports numbers and asserts no speed.

Each pass records ``--rows`` decisions through the PostgreSQL ledger (``DecisionLedger.record_many``
with :class:`~mlpair.prediction.records.DecisionColumns` of ``--chunk`` rows each, one chunk after
another: the bulk path a BatchPredict or a PredictColumns chunk takes), then delivers all of them
to the CRM through the relay (:class:`~mlpair.prediction.recording.relay.LedgerRelay`: claims of its
``batch_size`` until none is left). For each of the two steps it reports, per row:

* ``service_cpu_us``: ``time.process_time()`` of this process (every thread: the event loop and
  asyncpg's) across the step;
* ``postgres_cpu_us``: user + system CPU of every process of the local PostgreSQL server across the
  step (``bench/batch_cpu.py``'s :class:`~bench.batch_cpu.PostgresCpu`: /proc/<pid>/stat through
  psutil). Anything else using that server meanwhile counts too: compare interleaved passes only.

Decisions look like the service's: random request ids (a client's UUIDs), SHA-256 fingerprints,
two model families, their labels and reason codes, a probability or none, one timestamp per chunk.
Nothing is decided: the figures are the ledger's and the CRM's alone. After each pass the counts
are checked exactly (every row recorded once, none replayed, the CRM holding each once).

``--baseline COMMIT`` (or a folder holding a checkout) measures two releases in lockstep, as
``bench/ab_lockstep.py`` does: A imports the project from the baseline (``bench/ab_tree``), B from
this checkout, each in a worker process with its own throw-away database; each round runs one pass
of each side per chunk size, which side goes first alternating, and the result per figure is the
median of the rounds' B ÷ A ratios beside each side's median.

    .venv/bin/python -m bench.ledger_rows --rows 40000 --rounds 6
    .venv/bin/python -m bench.ledger_rows --baseline 0773360 --rows 40000 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(ROOT))

STEPS = ("ledger", "crm")
FIGURES = ("service_cpu_us", "postgres_cpu_us")
FAMILIES = {
    "credit-risk": (
        ("APPROVE", "REVIEW", "DECLINE"),
        (("LOW_DEFAULT_RISK",), ("ELEVATED_DEFAULT_RISK", "HIGH_LOAN_TO_VALUE"), ("HIGH_DEFAULT_RISK",)),
    ),
    "churn": (("NO_ACTION", "RETAIN_OFFER"), (("LOW_CHURN_RISK",), ("HIGH_CHURN_RISK", "MONTH_TO_MONTH_CONTRACT"))),
}


def decisions(n: int, chunk: int, rng: random.Random):
    """``n`` new decisions as :class:`DecisionColumns` of ``chunk`` rows each (the last may be shorter)."""
    from mlpair.prediction.records import DecisionColumns, decision_id_for

    out = []
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        family = "credit-risk" if (start // chunk) % 2 == 0 else "churn"
        labels, reasons = FAMILIES[family]
        ids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(rows)]
        probabilities = [None if rng.random() < 0.02 else rng.random() for _ in range(rows)]
        kinds = [rng.randrange(len(labels)) for _ in range(rows)]
        now = datetime.now(UTC)
        out.append(
            DecisionColumns(
                ids,
                [decision_id_for(r) for r in ids],
                [f"applicant-{rng.randrange(10**9)}" for _ in range(rows)],
                [family] * rows,
                ["3"] * rows,
                [f"{family}/v2"] * rows,
                [f"{family}-policy/v4"] * rows,
                probabilities,
                [labels[k] for k in kinds],
                [reasons[min(k, len(reasons) - 1)] for k in kinds],
                ["inference" if p is not None else "fallback" for p in probabilities],
                [0] * rows,
                ["" if p is not None else "INFERENCE_UNAVAILABLE" for p in probabilities],
                [now] * rows,
                ["spiffe://cluster.local/ns/bank/sa/online"] * rows,
                [hashlib.sha256(r.encode()).hexdigest() for r in ids],
            )
        )
    return out


class Side:
    """One database, ledger, CRM and relay, set up once; :meth:`one_pass` measures a pass."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rng = random.Random(os.getpid())
        self.recorded = 0

    async def open(self) -> None:
        from bench.batch_cpu import PostgresCpu
        from mlpair.prediction.recording.admin import migrate
        from mlpair.prediction.recording.ledger import open_ledger
        from mlpair.prediction.recording.relay import LedgerRelay
        from mlpair.prediction.recording.store import CrmStore

        await migrate(self.url, self.url)
        self.ledger = open_ledger(self.url, timeout_s=60.0, pool_size=4)
        await self.ledger.open()
        self.crm = CrmStore(self.url, timeout_s=60.0)
        self.relay = LedgerRelay(self.ledger, self.crm)  # not started: each pass drives its claims
        self.postgres = PostgresCpu()

    async def close(self) -> None:
        await self.ledger.close()
        await self.crm.close()

    async def one_pass(self, rows: int, chunk: int) -> dict:
        batches = decisions(rows, chunk, self.rng)
        clocks = [(time.process_time(), self.postgres.read())]
        outcomes = [await self.ledger.record_many(batch, batch.fingerprints) for batch in batches]
        clocks.append((time.process_time(), self.postgres.read()))
        for batch, outcome in zip(batches, outcomes):  # checked off the clock: reading them builds objects
            if len(outcome) != len(batch) or any(not hasattr(o, "replayed") or o.replayed for o in outcome):
                raise RuntimeError("a decision was not recorded as new")
        while await self.relay._deliver_batches(1):  # claims until the ledger has none waiting
            pass
        clocks.append((time.process_time(), self.postgres.read()))
        self.recorded += rows
        backlog, _ = await self.ledger.backlog()
        in_crm = await self.crm.count()
        if backlog or in_crm != self.recorded:
            raise RuntimeError(f"after the pass: backlog {backlog}, CRM {in_crm} rows, {self.recorded} recorded")
        result: dict = {"rows": rows, "chunk": chunk}
        for step, (before, after) in zip(STEPS, zip(clocks, clocks[1:])):
            result[step] = {
                "service_cpu_us": round(1e6 * (after[0] - before[0]) / rows, 2),
                "postgres_cpu_us": round(1e6 * self.postgres.between(before[1], after[1]) / rows, 2),
            }
        return result


async def serve_passes(url: str, lines) -> None:
    """A worker: one side set up, then a pass per ``pass ROWS CHUNK`` line, one JSON line each."""
    import mlpair.contracts

    side = Side(url)
    await side.open()
    try:
        print(json.dumps({"ready": str(Path(mlpair.contracts.__file__).resolve().parents[2])}), flush=True)
        loop = asyncio.get_running_loop()
        while (line := await loop.run_in_executor(None, lines.readline)).startswith("pass"):
            _, rows, chunk = line.split()
            print(json.dumps(await side.one_pass(int(rows), int(chunk))), flush=True)
    finally:
        await side.close()


def run_worker() -> int:
    from tests.support.pair import scratch_postgres

    with scratch_postgres(prefix="mlpair_ledger_rows") as url:  # dropped on the way out
        if url is None:
            raise SystemExit("PostgreSQL is not reachable on 127.0.0.1:5432")
        asyncio.run(serve_passes(url, sys.stdin))
    return 0


class Worker:
    """A worker process of this module (``--worker``), importing the project from ``tree`` when given."""

    def __init__(self, name: str, tree: Path | None) -> None:
        from bench.ab_lockstep import tree_env

        env = tree_env(tree)
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.ledger_rows", "--worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.project = self._answer()["ready"]

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.name}: the worker exited (code {self.process.wait()})")
        return json.loads(line)

    def one_pass(self, rows: int, chunk: int) -> dict:
        self.process.stdin.write(f"pass {rows} {chunk}\n")
        self.process.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("stop\n")
            self.process.stdin.close()
            self.process.wait(120)


def summary(passes: dict[str, list[dict]]) -> dict:
    """Per side and figure the median of its passes; with two sides, the median of B ÷ A per round."""
    out: dict = {}
    for step in STEPS:
        for figure in FIGURES:
            key = f"{step}.{figure}"
            entry = {side: statistics.median(p[step][figure] for p in runs) for side, runs in passes.items()}
            if len(passes) == 2:
                ratios = [
                    b[step][figure] / a[step][figure] for a, b in zip(passes["A"], passes["B"]) if a[step][figure]
                ]
                entry["B/A median"] = round(statistics.median(ratios), 3) if ratios else None
                entry["B/A range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
            out[key] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rows", type=int, default=40_000, help="decisions per pass")
    parser.add_argument("--chunk", type=int, action="append", help="rows per record_many (default: 10000 and 1000)")
    parser.add_argument("--rounds", type=int, default=6, help="passes per side and chunk size")
    parser.add_argument("--baseline", help="A: a commit, or a folder holding a checkout (B is this one)")
    args = parser.parse_args(argv)
    chunks = args.chunk or [10_000, 1_000]
    sides: dict[str, Worker] = {}
    try:
        if args.baseline:
            from bench.ab_lockstep import checkout

            sides["A"] = Worker("A", checkout(args.baseline))
        sides["B"] = Worker("B", None)
        print(json.dumps({name: w.project for name, w in sides.items()}), file=sys.stderr, flush=True)
        passes: dict[int, dict[str, list[dict]]] = {c: {name: [] for name in sides} for c in chunks}
        for r in range(args.rounds):
            for chunk in chunks:
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    passes[chunk][name].append(result := sides[name].one_pass(args.rows, chunk))
                    print(json.dumps({"round": r, "side": name, **result}), file=sys.stderr, flush=True)
        report = {
            "rows_per_pass": args.rows,
            "rounds": args.rounds,
            **({"baseline": args.baseline} if args.baseline else {}),
        }
        report["per_row"] = {f"chunk {c}": summary(passes[c]) for c in chunks}
        print(json.dumps(report, indent=2))
    finally:
        for worker in sides.values():
            worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
