"""Render the tables of docs/performance.md from the committed results in bench/results/.

``bench/results/targets.jsonl`` lists the targets, one JSON object a line: ``target`` (an id),
``issues`` and ``text``. Every other ``bench/results/*.jsonl`` holds measurements, one JSON object
a line, each with ``date`` (ISO 8601, UTC), ``commit`` (the commit measured, ``null`` where the
run did not record it), ``recorded_in`` (the commit that first wrote the figure down), ``machine``,
``bench`` (the script or make target), ``command`` and ``figures`` (numbers, named). A measurement
that judges a target also has ``target``, ``figure`` (the table's cell) and ``met``; one that is a
row of a reference table has ``table`` (``oip`` or ``prediction``) instead.

``python -m bench.render_results`` prints every block as docs/performance.md holds it, between its
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` lines; ``--write`` replaces those blocks
in docs/performance.md. ``tests/test_performance_doc.py`` checks the document against the output.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"

Record = dict[str, Any]


def load(path: Path) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path.name}:{number}: not JSON ({exc})") from exc
    return records


def measurements() -> list[Record]:
    found = []
    for path in sorted(RESULTS.glob("*.jsonl")):
        if path.name != "targets.jsonl":
            for record in load(path):
                for key in ("date", "commit", "recorded_in", "machine", "bench", "command", "figures"):
                    if key not in record:
                        raise SystemExit(f"{path.name}: a measurement lacks {key!r}: {record}")
                found.append(record)
    return found


def met(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "**no**"
    return str(value)


def provenance(record: Record) -> str:
    commit = f"at `{record['commit']}`" if record["commit"] else f"recorded in `{record['recorded_in']}`"
    return f"{record['date']}, {commit}"


def targets_table(results: list[Record]) -> list[str]:
    lines = [
        "| target | issues | latest figure | met? | measured | bench |",
        "|---|---|---|---|---|---|",
    ]
    for target in load(RESULTS / "targets.jsonl"):
        judged = [r for r in results if r.get("target") == target["target"]]
        issues = ", ".join(str(i) for i in target["issues"])
        if not judged:
            lines.append(f"| {target['text']} | {issues} | not measured yet | – | – | – |")
            continue
        latest = max(judged, key=lambda r: r["date"])
        lines.append(
            f"| {target['text']} | {issues} | {latest['figure']} | {met(latest['met'])} "
            f"| {provenance(latest)} | `{latest['bench']}` |"
        )
    return lines


def number(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def oip_table(results: list[Record]) -> list[str]:
    lines = [
        "| date | model | conc | server | req/s | p99 ms | server µs CPU/req |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in sorted((r for r in results if r.get("table") == "oip"), key=lambda r: r["order"]):
        f = r["figures"]
        lines.append(
            f"| {r['date'][:10]} | {f['model']} | {f['conc']} | {f['server']} | {number(f['req_per_s'])} "
            f"| {number(f['p99_ms'], 1)} | {number(f['server_cpu_us'])} |"
        )
    return lines


def prediction_table(results: list[Record]) -> list[str]:
    lines = [
        "| phase | in flight | rows/call | calls/s | rows/s | p99 ms | ms CPU per call: client / prediction / inference |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted((r for r in results if r.get("table") == "prediction"), key=lambda r: r["order"]):
        f = r["figures"]
        cpu = " / ".join("–" if v is None else f"{v:.3f}" for v in f["cpu_ms_per_call"])
        lines.append(
            f"| {f['phase']} | {f['in_flight']} | {f['rows_per_call']} | {number(f['calls_per_s'])} "
            f"| {number(f['rows_per_s'])} | {number(f['p99_ms'], 1)} | {cpu} |"
        )
    return lines


def blocks() -> dict[str, list[str]]:
    results = measurements()
    return {
        "targets": targets_table(results),
        "oip": oip_table(results),
        "prediction": prediction_table(results),
    }


def render() -> str:
    out = []
    for name, lines in blocks().items():
        out += [f"<!-- results:{name} -->", *lines, f"<!-- /results:{name} -->", ""]
    return "\n".join(out)


def write(doc: Path = DOC) -> None:
    text = doc.read_text(encoding="utf-8")
    for name, lines in blocks().items():
        pattern = re.compile(rf"<!-- results:{name} -->\n.*?<!-- /results:{name} -->", re.S)
        replacement = "\n".join([f"<!-- results:{name} -->", *lines, f"<!-- /results:{name} -->"])
        text, count = pattern.subn(lambda _, block=replacement: block, text)
        if count != 1:
            raise SystemExit(f"{doc}: expected one results:{name} block, found {count}")
    doc.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the blocks in docs/performance.md")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
