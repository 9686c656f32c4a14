"""``mlpair score``'s flags as the README and docs/batch-scoring.md show them, and its deadline forms."""

from __future__ import annotations

import re
import shlex
from datetime import UTC, datetime

import pytest

from mlpair.cli import build_parser
from mlpair.commands.score import score_command
from mlpair.jobs.state import ChunkRecord, JobState, parse_deadline
from mlpair.startup import StartupError
from tests.support import REPO_ROOT


@pytest.mark.parametrize("doc", ["README.md", "docs/batch-scoring.md"])
def test_the_documented_score_commands_parse(doc):
    text = (REPO_ROOT / doc).read_text()
    lines = [m for m in re.findall(r"^\.venv/bin/mlpair score .*?(?<!\\)$", text.replace("\\\n", " "), re.M)]
    assert lines, f"{doc} shows no mlpair score command"
    for line in lines:
        args = build_parser().parse_args(shlex.split(line.split("#")[0])[1:])
        assert args.func is score_command
        assert args.status or (args.key and args.input and args.output)


def test_a_deadline_is_an_iso_timestamp_or_the_next_time_the_utc_clock_reads_hh_mm():
    now = datetime(2024, 5, 1, 3, 0, tzinfo=UTC)
    assert parse_deadline("06:00", now) == datetime(2024, 5, 1, 6, 0, tzinfo=UTC).timestamp()
    nightly = datetime(2024, 5, 1, 22, 0, tzinfo=UTC)  # a nightly run started at 22:00: tomorrow morning
    assert parse_deadline("06:00", nightly) == datetime(2024, 5, 2, 6, 0, tzinfo=UTC).timestamp()
    assert parse_deadline("22:00", nightly) == datetime(2024, 5, 2, 22, 0, tzinfo=UTC).timestamp()
    assert parse_deadline("23:30", nightly) == datetime(2024, 5, 1, 23, 30, tzinfo=UTC).timestamp()
    assert parse_deadline("2024-05-02T06:00:00Z", now) == datetime(2024, 5, 2, 6, 0, tzinfo=UTC).timestamp()
    assert parse_deadline("2024-05-02T08:00:00+02:00", now) == datetime(2024, 5, 2, 6, 0, tzinfo=UTC).timestamp()
    with pytest.raises(StartupError, match="--deadline"):
        parse_deadline("tomorrow", now)


def test_the_estimate_is_late_when_it_falls_past_the_deadline_or_the_deadline_passed_unfinished():
    state = JobState("j", "in", "credit-risk", "id", None, 10, 1_000, True, "out", started_at=0.0,
                     run_started_at=0.0, run_rows=100, deadline=50.0)
    state.chunks["0"] = ChunkRecord(rows=100, decided=100, replayed=0, failed=0, first_key="a", last_key="b")
    assert state.estimated_completion(now=10.0) == 100.0  # 900 rows left at 10 rows/s
    assert state.late(now=10.0)
    state.deadline = 200.0
    assert not state.late(now=10.0) and state.late(now=201.0)
    state.finished_at = 300.0
    assert not state.late(now=400.0) and state.estimated_completion(now=400.0) == 300.0


def test_without_an_address_ray_starts_a_local_cluster_rather_than_joining_one_recorded_here(monkeypatch, capsys):
    from mlpair.jobs.ray_engine import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(None) == "local"
    assert cluster_address("head:6379") == "head:6379"
    monkeypatch.setenv("RAY_ADDRESS", "ray-head:6379")  # as KubeRay sets it inside a RayJob
    assert cluster_address(None) == "ray-head:6379"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["score", "--help"])
    assert "or local (a new one on this machine)" in " ".join(capsys.readouterr().out.split())
