"""The decision ledger's engine, measured: PostgreSQL (chosen) beside NATS JetStream and SQLite.

Not a test: one run prints JSON lines and a table (docs/design.md, "The decision ledger", quotes
them). Each engine does what the ledger needs per decision, on 127.0.0.1:

* **postgresql** — :class:`mlpair.prediction.recording.ledger_postgres.PostgresLedger` itself: the
  group commit ``INSERT … ON CONFLICT (request_id) DO NOTHING RETURNING`` (+ a read of what was on
  record), ``synchronous_commit`` as the server has it;
* **nats-jetstream** — the design the JetStream option implies: a key-value bucket as the
  request-id index (``kv.create``: fails if the id exists, then the recorded value is read), and
  the decision published to a stream with ``Nats-Msg-Id`` = request id (de-duplication) for the
  relay to consume; file storage, one replica (what runs here);
* **sqlite** — :class:`mlpair.prediction.recording.ledger_sqlite.SqliteLedger` (one machine), FULL.

Per engine: the latency of recording one decision with nothing else in flight (p50/p99), and
with 32 decisions in flight (p50/p99, decisions/s), plus the share of a retried id's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import percentile  # noqa: E402
from tests.support import pair as harness  # noqa: E402


def decision(request_id: str):
    from mlpair.prediction.records import StoredDecision

    return StoredDecision("", request_id, "e-1", "credit-risk", "1", "credit-risk/v1", "policy/v1", 0.2, "APPROVE",
                          ("LOW_DEFAULT_RISK", "INCOME_MISSING_DEFAULTED"))


async def measure(record, n: int, concurrency: int) -> dict:
    """Latency of ``record(request_id)`` for ``n`` new ids with ``concurrency`` in flight."""
    latencies: list[float] = []
    ids = iter(f"bench-{uuid.uuid4().hex}" for _ in range(n))

    async def worker() -> None:
        for rid in ids:
            started = time.perf_counter()
            await record(rid)
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"concurrency": concurrency, "decisions": n, "p50_ms": round(percentile(latencies, 50), 3),
            "p99_ms": round(percentile(latencies, 99), 3), "decisions_per_s": round(n / elapsed)}


async def ledger_engine(url: str) -> tuple:
    from mlpair.prediction.recording.ledger import open_ledger

    ledger = open_ledger(url)
    await ledger.open()

    async def record(rid: str) -> None:
        [outcome] = await ledger.record_many([decision(rid)], ["fp"])
        if isinstance(outcome, BaseException):
            raise outcome

    return record, ledger.close


async def jetstream_engine(servers: str) -> tuple:
    import nats
    from nats.js.errors import KeyWrongLastSequenceError

    nc = await nats.connect(servers)
    js = nc.jetstream()
    name = f"MLPAIR_BENCH_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=name, subjects=[f"{name}.decisions"], storage="file", duplicate_window=120.0)
    kv = await js.create_key_value(bucket=f"{name}_IDS", storage="file", history=1)

    from mlpair.prediction.recording.codecs import to_json

    async def record(rid: str) -> None:
        payload = to_json(decision(rid)).encode()
        key = rid.replace(":", "_")  # KV keys allow [-/_=.a-zA-Z0-9]
        try:
            await kv.create(key, payload)  # the request-id index: the first writer wins
        except KeyWrongLastSequenceError:
            await kv.get(key)  # on record already: read what was recorded
            return
        await js.publish(f"{name}.decisions", payload, headers={"Nats-Msg-Id": rid})  # the relay's queue

    async def close() -> None:
        await js.delete_key_value(f"{name}_IDS")
        await js.delete_stream(name)
        await nc.close()

    return record, close


async def run(args, pg: str | None) -> list[dict]:
    results = []
    engines = []
    from mlpair.prediction.recording.admin import migrate

    sqlite_dir = Path(args.workdir)
    sqlite_dir.mkdir(parents=True, exist_ok=True)
    sqlite = f"sqlite+aiosqlite:///{sqlite_dir / f'ledger-{uuid.uuid4().hex[:8]}.sqlite'}"
    crm = f"sqlite+aiosqlite:///{sqlite_dir / f'crm-{uuid.uuid4().hex[:8]}.sqlite'}"
    if pg is not None:
        await migrate(pg, pg)
        engines.append(("postgresql", lambda: ledger_engine(pg)))
    if harness.reachable("127.0.0.1", 4222):
        engines.append(("nats-jetstream", lambda: jetstream_engine("nats://127.0.0.1:4222")))
    await migrate(sqlite, crm)
    engines.append(("sqlite", lambda: ledger_engine(sqlite)))
    for round_ in range(args.rounds):  # interleaved: each round runs every engine once
        for name, build in engines:
            record, close = await build()
            try:
                await measure(record, 200, 8)  # warm-up: connections, prepared statements
                for concurrency in (1, 32):
                    n = args.decisions if concurrency > 1 else args.decisions // 4
                    line = {"engine": name, "round": round_ + 1, **await measure(record, n, concurrency)}
                    print(json.dumps(line), flush=True)
                    results.append(line)
            finally:
                await close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=4000, help="decisions per measurement at 32 in flight")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--workdir", default="var/bench-ledger")
    args = parser.parse_args(argv)
    print(json.dumps({"bench": "ledger-engines", **harness.machine()}), flush=True)
    with harness.scratch_postgres(prefix="mlpair_ledger_bench") as pg:
        results = asyncio.run(run(args, pg))
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Recording one decision (127.0.0.1)")
    for column in ("engine", "round", "in flight", "p50 ms", "p99 ms", "decisions/s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["engine"], str(r["round"]), str(r["concurrency"]), str(r["p50_ms"]), str(r["p99_ms"]),
                      f"{r['decisions_per_s']:,}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
