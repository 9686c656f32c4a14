"""A job's progress on the terminal: a rich progress bar when the output is a terminal, else a plain
line at most every few seconds (a log file, CI)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, TextIO

from mlpair.jobs.state import JobState, iso

PLAIN_EVERY_S = 5.0
"""Seconds between two plain progress lines."""


class Progress:
    """Rows finished of the job's total (context manager; :meth:`update` after each chunk)."""

    def __init__(self, job_id: str, state: JobState, out: TextIO) -> None:
        self.job_id, self.state, self.out = job_id, state, out
        self.bar: Any = None
        self.task: Any = None
        self.last_line = 0.0

    def __enter__(self) -> Progress:
        if self.out.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows  {task.fields[rate]:,.0f} rows/s  {task.fields[failed]:,} failed"),
                TimeRemainingColumn(),
                console=Console(file=self.out),
            )
            self.bar.start()
            self.task = self.bar.add_task(
                self.job_id, total=self.state.total_rows, completed=self.state.rows(), rate=0.0, failed=0
            )
        else:
            done = self.state.rows()
            if done:
                print(
                    f"job {self.job_id}: resuming, {done:,} rows in {len(self.state.chunks)} chunks done", file=self.out
                )
        return self

    def update(self) -> None:
        """Shows the state's current counts."""
        state = self.state
        if self.bar is not None:
            total = max(state.total_rows, state.rows())
            self.bar.update(
                self.task, completed=state.rows(), total=total, rate=state.rate(), failed=state.rows("failed")
            )
            return
        now = time.time()
        if now - self.last_line < PLAIN_EVERY_S:
            return
        self.last_line = now
        share = f" ({state.rows() / state.total_rows:.0%})" if state.total_rows else ""
        about = "" if state.total_exact else "~"
        estimate = state.estimated_completion(now)
        print(
            f"job {self.job_id}: {state.rows():,}/{about}{state.total_rows:,} rows{share}, {state.rate(now):,.0f} rows/s, "
            f"{state.rows('failed'):,} failed, estimated completion {iso(estimate)}",
            file=self.out,
            flush=True,
        )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.bar is not None:
            self.bar.stop()
