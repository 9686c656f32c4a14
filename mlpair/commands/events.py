"""``mlpair events tail``: the decision events on the NATS JetStream stream, one line each.

Reads what the relay publishes (:mod:`mlpair.prediction.recording.events`), as an operator's
check that events flow or a pipe into other tools (``--json``: one CloudEvent per line). The
events modules, and so ``nats-py`` and ``cloudevents``, are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import Any

DEFAULT_URL = "nats://127.0.0.1:4222"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``mlpair events`` and its ``tail`` subcommand."""
    events = sub.add_parser("events", help="decision events on NATS JetStream (CloudEvents)")
    commands = events.add_subparsers(dest="events_command", required=True)
    tail = commands.add_parser("tail", help="print decision events from the stream, each event id once")
    tail.add_argument(
        "--url",
        default=os.environ.get("PREDICTION_EVENTS_URL", DEFAULT_URL),
        help=f"NATS server [env PREDICTION_EVENTS_URL; default {DEFAULT_URL}]",
    )
    tail.add_argument("--subject", default="mlpair.decisions", help="subject [default: mlpair.decisions]")
    tail.add_argument("--stream", default="MLPAIR_DECISIONS", help="JetStream stream [default: MLPAIR_DECISIONS]")
    tail.add_argument(
        "--from-start", action="store_true", help="from the stream's first event [default: new events only]"
    )
    tail.add_argument("--count", type=int, default=None, help="stop after N distinct events [default: no limit]")
    tail.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="stop after this many seconds without an event [default: follow until interrupted]",
    )
    tail.add_argument("--json", action="store_true", help="one CloudEvent JSON object per line")
    tail.set_defaults(func=events_tail)


HEADER = "time  request_id  decision_id  model  decision  probability  caller"


def _line(event: dict[str, Any]) -> str:
    """One short readable line, the columns of :data:`HEADER`."""
    data = event["data"] if isinstance(event.get("data"), dict) else {}
    probability = data.get("probability")
    shown = f"{probability:.4f}" if isinstance(probability, int | float) else "-"
    values = (event.get("time"), event.get("subject"), event.get("id"), data.get("model_name"), data.get("decision"))
    return "  ".join(str(v or "-") for v in values) + f"  {shown}  {data.get('caller') or '-'}"


def events_tail(args: argparse.Namespace) -> int:
    """``mlpair events tail``: prints events until ``--count`` or ``--idle-timeout-s`` (or Ctrl-C).

    Returns:
        0 (an unreachable broker or a missing stream raises, and ``mlpair`` prints one line, exit 1).
    """
    from mlpair.prediction.recording.events import tail

    printed = 0

    async def run() -> None:
        nonlocal printed
        if not args.json:
            print(HEADER, flush=True)
        async for event in tail(
            args.url,
            subject=args.subject,
            stream=args.stream,
            from_start=args.from_start,
            count=args.count,
            timeout_s=args.idle_timeout_s,
        ):
            sys.stdout.write((json.dumps(event, separators=(",", ":")) if args.json else _line(event)) + "\n")
            sys.stdout.flush()
            printed += 1

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a follow: not a failure
        asyncio.run(run())
    if not printed:
        print(f"mlpair events tail: no decision event on {args.stream} ({args.url})", file=sys.stderr)
    return 0
