"""A batch-scoring job's state: one JSON file per job (``<state dir>/<job id>/state.json``), written
atomically (a temporary file renamed over it) after every finished chunk, beside the chunks' part
files (``parts/chunk-<n>.parquet``).

What a rerun reads from it: which chunks are done (skipped), their counts (kept), the chunk size
and the deadline. What ``mlpair score --status`` prints from it: rows done, failed and replayed,
rows per second, when the job started, its estimated completion against its deadline, finished or
not.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mlpair.startup import StartupError

OUTCOMES = ("decided", "replayed", "failed")
"""How a row ended: decided by this job, replayed (on record already: decided by an earlier run of
it), failed (its own error, in the output's error columns)."""


@dataclass
class ChunkRecord:
    """One finished chunk: its rows, their outcomes and its first and last key (checked on a rerun,
    so a changed input is refused rather than mixed in)."""

    rows: int
    decided: int
    replayed: int
    failed: int
    first_key: str
    last_key: str


@dataclass
class JobState:
    """Everything a rerun and ``--status`` need about one job (times are UNIX seconds, UTC).

    Attributes:
        total_rows: rows of the input (an estimate for a CSV file: ``total_exact`` false).
        chunks: finished chunks by number (as text, JSON's keys).
        run_started_at, run_rows: when this run started and the rows it has finished; the rate
            and the estimate are this run's.
        run_ended_at: when this run ended (finished or stopped), or None while it runs (or was
            killed); the rate and the duration count to it, not to now.
        deadline: when the job must be finished, or None.
        finished_at: when the output was assembled; None while the job runs or was stopped.
        stopped: why the last run stopped before the end (a refused chunk, a failed stream), or "".
        warnings: each distinct warning the service gave about the job's columns (e.g. an
            ``UNKNOWN_ATTRIBUTE``), in the order first seen, printed once.
    """

    job_id: str
    source: str
    model: str
    key_column: str
    entity_column: str | None
    chunk_rows: int
    total_rows: int
    total_exact: bool
    output: str
    started_at: float
    run_started_at: float = 0.0
    run_rows: int = 0
    run_ended_at: float | None = None
    runs: int = 0
    deadline: float | None = None
    updated_at: float = 0.0
    finished_at: float | None = None
    stopped: str = ""
    chunks: dict[str, ChunkRecord] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    # -- counts --------------------------------------------------------------------------------------

    def rows(self, outcome: str | None = None) -> int:
        """Rows of the finished chunks, all or of one ``outcome`` (:data:`OUTCOMES`)."""
        return sum(c.rows if outcome is None else getattr(c, outcome) for c in self.chunks.values())

    def _end(self, now: float | None) -> float:
        """Where the clock stops: the run's end once it finished or stopped, else now."""
        if self.run_ended_at is not None:
            return self.run_ended_at
        return self.finished_at or now or time.time()

    def rate(self, now: float | None = None) -> float:
        """This run's rows per second, from its start to its end (or to now while it runs); 0
        before its first chunk."""
        elapsed = self._end(now) - self.run_started_at
        return self.run_rows / elapsed if self.run_rows and elapsed > 0 else 0.0

    def duration(self, now: float | None = None) -> float:
        """Seconds from the job's first start to the end of its last run (or to now while it runs)."""
        return self._end(now) - self.started_at

    def estimated_completion(self, now: float | None = None) -> float | None:
        """When the job will be done at this run's rate (UNIX seconds); when it finished, once
        finished; None before a rate is known, or once the run stopped (nothing runs to finish it)."""
        if self.finished_at is not None:
            return self.finished_at
        if self.stopped or self.run_ended_at is not None:
            return None
        now = now or time.time()
        rate = self.rate(now)
        if rate <= 0:
            return None
        return now + max(self.total_rows - self.rows(), 0) / rate

    def late(self, now: float | None = None) -> bool:
        """Whether the estimate (or, past the deadline, now) falls after the deadline, unfinished."""
        if self.deadline is None or self.finished_at is not None:
            return False
        estimate = self.estimated_completion(now)
        return (now or time.time()) > self.deadline or (estimate is not None and estimate > self.deadline)

    # -- files ---------------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Writes the state to ``path`` atomically (temporary file, fsync, rename)."""
        self.updated_at = time.time()
        write_atomically(path, json.dumps(asdict(self), indent=1).encode())

    @classmethod
    def load(cls, path: Path) -> JobState:
        """The state at ``path``.

        Raises:
            StartupError: no such job (no file), or a file that is not a job's state.
        """
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            data["chunks"] = {n: ChunkRecord(**c) for n, c in data.get("chunks", {}).items()}
            data.setdefault("warnings", [])
            return cls(**data)
        except FileNotFoundError as exc:
            raise StartupError(f"no job {path.parent.name!r} under {path.parent.parent}") from exc
        except (ValueError, TypeError) as exc:
            raise StartupError(f"{path}: not a job state file ({exc})") from exc

    # -- status --------------------------------------------------------------------------------------

    def status_lines(self, now: float | None = None) -> list[str]:
        """``mlpair score --status``: one ``name: value`` line per fact."""
        now = now or time.time()
        about = "" if self.total_exact else " (estimated)"
        estimate = self.estimated_completion(now)
        lines = [
            f"job: {self.job_id}",
            f"state: {self._phase()}",
            f"input: {self.source}",
            f"model: {self.model}   key: {self.key_column}   output: {self.output}",
            f"rows: {self.rows():,} of {self.total_rows:,}{about} in {len(self.chunks)} chunks of {self.chunk_rows:,}",
            "outcomes: " + ", ".join(f"{self.rows(o):,} {o}" for o in OUTCOMES),
            f"rows/s: {self.rate(now):,.0f} (run {self.runs})",
            f"started: {iso(self.started_at)}   duration: {self.duration(now):,.0f} s",
            f"estimated completion: {iso(estimate) if estimate is not None else self._no_estimate()}",
            f"deadline: {iso(self.deadline) if self.deadline is not None else 'none'}",
        ]
        if self.late(now):
            lines.append("warning: the estimated completion is past the deadline")
        if self.stopped:
            lines.append(f"stopped: {self.stopped}")
        lines.extend(f"warning: {text}" for text in self.warnings)
        return lines

    def _no_estimate(self) -> str:
        return "none (stopped: rerun the same command to resume)" if self.stopped else "unknown (no rate yet)"

    def _phase(self) -> str:
        if self.finished_at is not None:
            return f"finished at {iso(self.finished_at)}"
        return "stopped (rerun the same command to resume)" if self.stopped else "running or interrupted"


def iso(stamp: float | None) -> str:
    """UNIX seconds as ISO 8601 UTC to the second (``-`` for None)."""
    if stamp is None:
        return "-"
    return datetime.fromtimestamp(stamp, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_deadline(text: str, now: datetime | None = None) -> float:
    """``--deadline``: an ISO 8601 timestamp (UTC unless it names an offset) or ``HH:MM``, UTC: the
    next time the clock reads it (today if still ahead, else tomorrow: ``06:00`` given at 22:00 is
    tomorrow morning).

    Returns:
        UNIX seconds.

    Raises:
        StartupError: neither form.
    """
    now = now or datetime.now(UTC)
    try:
        if len(text) <= 5 and ":" in text:
            hours, minutes = (int(p) for p in text.split(":"))
            at = now.replace(hour=hours, minute=minutes, second=0, microsecond=0)
            return (at if at > now else at + timedelta(days=1)).timestamp()
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise StartupError(
            f"--deadline {text!r}: expected an ISO timestamp or HH:MM (its next occurrence, UTC)"
        ) from exc
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file in the same folder, fsynced, then renamed: a
    reader (or a crash) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
