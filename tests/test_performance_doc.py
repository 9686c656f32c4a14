"""docs/performance.md stays short, its tables stay what bench/results/ renders, its links resolve,
and product code quotes no measured timings (they live in the docs and the decision records)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
DECISIONS = ROOT / "docs" / "decisions"
BLOCK = re.compile(r"<!-- results:(\w+) -->\n.*?<!-- /results:\1 -->", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
# A number followed by a unit of machine speed: what product comments must not quote.
TIMING = re.compile(r"\d[\d.,]*\s*(?:µs|us|ns)\b|\d[\d.,]*\s*-\s*\d[\d.,]*\s*(?:µs|us|ns)\b")


def rendered() -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.render_results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return {m[1]: m[0] for m in BLOCK.finditer(out)}


def test_the_tables_are_the_committed_results_rendered() -> None:
    blocks = rendered()
    assert blocks, "bench.render_results printed no block"
    in_doc = {m[1]: m[0] for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
    assert in_doc.keys() == blocks.keys()
    for name, block in blocks.items():
        assert in_doc[name] == block, f"results:{name} differs: run python -m bench.render_results --write"


def test_the_page_is_at_most_300_lines() -> None:
    assert len(DOC.read_text(encoding="utf-8").splitlines()) <= 300


def test_every_relative_link_of_the_performance_and_decision_pages_resolves() -> None:
    pages = [DOC, *sorted(DECISIONS.glob("*.md"))]
    for page in pages:
        for target, _anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"


def test_every_decision_record_is_in_the_index() -> None:
    index = (DECISIONS / "README.md").read_text(encoding="utf-8")
    for record in DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"):
        assert f"({record.name})" in index, record.name
        text = record.read_text(encoding="utf-8")
        for part in ("## Context", "## Decision", "## Measurement", "## Revisit when"):
            assert part in text, f"{record.name} lacks {part}"


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    previous = tokenize.NEWLINE
    for token in tokens:
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL):
            found.append((token.start[0], token.string))  # a string statement: a docstring
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return found


def test_product_comments_and_docstrings_quote_no_timings() -> None:
    hits = []
    for folder in ("mlpair", "services"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            for line, text in comments_and_docstrings(path):
                for match in TIMING.finditer(text):
                    hits.append(f"{path.relative_to(ROOT)}:{line}: {match[0]}")
    assert not hits, "measured timings belong in docs/performance.md or a decision record:\n" + "\n".join(hits)
