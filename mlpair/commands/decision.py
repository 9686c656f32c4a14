"""``mlpair decision REQUEST_ID``: one decision's full record, as the ledger keeps it.

The decision (ids, caller, the versions, probability, decision, reason codes, how it was served,
when) and, while its retention lasts, its audit record: the attributes as received (personal data
left out or as keyed hashes, ``PREDICTION_AUDIT_PERSONAL_DATA``), the feature vector the model saw,
the guards that fired, the logits and the explanation when one was asked for
(``mlpair.prediction.recording.audit``). It connects to the ledger database directly, as
``mlpair migrate`` does (``--ledger-url``, or ``PREDICTION_LEDGER_URL``), and reads only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``mlpair decision``."""
    show = sub.add_parser("decision", help="one decision's full record: the decision and what it was based on (JSON)")
    show.add_argument("request_id", help="the request id (idempotency key) the decision was made for")
    show.add_argument(
        "--ledger-url", default=None, help="decision ledger URL [env PREDICTION_LEDGER_URL; default as serving]"
    )
    show.set_defaults(func=show_decision)


async def decision_record(ledger_url: str, request_id: str) -> dict[str, Any] | None:
    """The decision on record for ``request_id`` with its audit record under ``"record"`` (None when
    none is kept, or past retention); None when no decision is on record.

    Raises:
        mlpair.prediction.recording.migrate.SchemaNotReady: the ledger is not migrated.
        OSError, TimeoutError: the ledger did not answer.
    """
    from mlpair.prediction.recording.audit import read_record
    from mlpair.prediction.recording.ledger import open_ledger

    ledger = open_ledger(ledger_url, timeout_s=10.0)
    await ledger.open()
    try:
        recorded = await ledger.find(request_id)
        if recorded is None:
            return None
        decision = dataclasses.asdict(recorded.decision)
        decision["reason_codes"] = list(decision["reason_codes"])
        decision["decided_at"] = recorded.decision.decided_at.isoformat() if recorded.decision.decided_at else None
        decision["record"] = read_record(await ledger.audit_record(request_id))
        return decision
    finally:
        await ledger.close()


def show_decision(args: argparse.Namespace) -> int:
    """Prints the decision's record as JSON; exit 1 when no decision is on record for the id."""
    from sqlalchemy import make_url

    from mlpair.prediction.settings import PredictionSettings

    url = args.ledger_url or PredictionSettings().ledger_url
    parsed = make_url(url)
    shown = parsed.render_as_string(hide_password=True)
    hint = "pass --ledger-url or set PREDICTION_LEDGER_URL to the ledger PredictionService records in"
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        print(f"mlpair decision: no decision ledger at {parsed.database} ({hint})", file=sys.stderr)
        return 1
    found = asyncio.run(decision_record(url, args.request_id))
    if found is None:
        print(
            f"mlpair decision: no decision on record for request id {args.request_id!r} in the ledger {shown} "
            f"(another ledger? {hint})",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(found, indent=2))
    return 0
