"""The demo's summary: one table per model family (quality against its targets, calibration before
and after, realised figures on the fed-back outcomes beside the holdout ones, decisions, latency,
idempotency, an explained decision), the CRM row count, the
services' exit codes, and the report picture (:mod:`mlpair.report`).

It reads what :mod:`mlpair.demo` measured (:class:`mlpair.demo.FamilyRun`) and decides whether the
demo passed: every decision returned, every retry the same decision, every target met, one CRM
row per request id, both services stopped cleanly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlpair.contracts.metrics import brier_score, expected_calibration_error, roc_auc

if TYPE_CHECKING:
    from rich.console import Console

    from mlpair.demo import FamilyRun
    from mlpair.report import FamilyReport


def training_end(training: Mapping[str, Any]) -> str:
    """How the entry's training ended (``"stopped early at epoch 18 of 40 (best epoch 13)"``); empty for
    entries written before training recorded it."""
    from mlpair.training.model import TrainingRun

    if "epochs_run" not in training:
        return ""
    return TrainingRun(training["epochs_run"], training["best_epoch"], training["config"]["epochs"]).describe()


def _uncalibrated(run: FamilyRun) -> np.ndarray:
    """The family's uncalibrated holdout probabilities ``[n holdout]``.

    Raises:
        ValueError: they were never read from InferenceService.
    """
    if run.uncalibrated is None:
        raise ValueError(f"{run.name}: no raw logits were read, so there is nothing to compare calibration with")
    return run.uncalibrated


def family_rows(run: FamilyRun, retry_sample: int) -> tuple[list[tuple[str, str]], bool]:
    """The summary lines of one family and whether everything in them is as it must be
    (``retry_sample``: how many of its first request ids were sent again).

    Raises:
        ValueError: the family's raw logits were never read.
    """
    result = run.result
    ids = [r[0] for r in run.requests if r[0] in result.probabilities]
    labels = np.array([run.holdout.labels[i] for i, r in enumerate(run.requests) if r[0] in result.probabilities])
    after = np.array([result.probabilities[i] for i in ids])
    before = np.array([p for p, r in zip(_uncalibrated(run), run.requests) if r[0] in result.probabilities])
    lat = np.array(result.latencies_ms or [float("nan")])
    both_classes = bool(ids) and 0 < labels.sum() < len(labels)
    auc = roc_auc(labels, after) if both_classes else float("nan")
    baseline = np.array([p for p, r in zip(run.baseline, run.requests) if r[0] in result.probabilities])
    baseline_auc = roc_auc(labels, baseline) if both_classes else float("nan")
    ece_before, ece_after = expected_calibration_error(labels, before), expected_calibration_error(labels, after)
    min_auc, max_ece = run.targets.get("min_roc_auc", 0.0), run.targets.get("max_ece", 1.0)
    auc_ok, ece_ok = auc >= min_auc, ece_after <= max_ece
    same_ids = all(
        run.retry.decision_ids.get(r[0]) == result.decision_ids.get(r[0]) for r in run.requests[:retry_sample]
    )
    mark = {True: "[green]met[/]", False: "[bold red]MISSED[/]"}
    realised, held = run.realised, run.entry.manifest.metrics.get("holdout_calibrated", {})
    # the service's realised ROC AUC on the fed-back labels is the client's on the same decisions
    realised_ok = (
        run.outcomes_refused == 0
        and realised.get("outcomes") == len(ids)
        and abs(realised.get("roc_auc", float("nan")) - auc) < 1e-9
    )
    example = run.explained[0] if run.explained else None
    lines = [
        ("holdout records", str(len(run.requests))),
        (
            "decisions returned",
            f"{len(ids)} ({sum(result.failures.values())} failed"
            + (f": {dict(result.failures)})" if result.failures else ")"),
        ),
        ("holdout ROC AUC (returned probabilities)", f"{auc:.4f}  (target ≥ {min_auc:.2f}: {mark[auc_ok]})"),
        (
            "holdout ROC AUC, logistic regression",
            f"{baseline_auc:.4f}  (same split and features; served model {auc - baseline_auc:+.4f})",
        ),
        ("training", training_end(run.entry.manifest.training) or "-"),
        (
            "outcomes fed back (RecordOutcomes)",
            f"{run.outcomes_stored} stored, {run.outcomes_refused} refused; joined by the service: "
            f"{realised.get('outcomes', 0):.0f} ({mark[realised_ok]})",
        ),
        (
            "realised ROC AUC / ECE / Brier (service)",
            " / ".join(f"{realised.get(k, float('nan')):.4f}" for k in ("roc_auc", "ece", "brier"))
            + "  (manifest's holdout: "
            + " / ".join(f"{held.get(k, float('nan')):.4f}" for k in ("roc_auc", "ece_15", "brier"))
            + ")",
        ),
        (
            "Brier score before → after calibration",
            f"{brier_score(labels, before):.4f} → {brier_score(labels, after):.4f}",
        ),
        (
            "ECE (15 bins) before → after calibration",
            f"{ece_before:.4f} → {ece_after:.4f}  (target ≤ {max_ece:.2f}: {mark[ece_ok]})",
        ),
        (
            "calibration",
            f"{run.entry.manifest.calibration.method} (fitted on {run.entry.manifest.calibration.n_samples} "
            "calibration-split rows)",
        ),
        ("decisions", ", ".join(f"{d} {n}" for d, n in Counter(result.decisions.values()).most_common())),
        ("top reason codes", ", ".join(f"{c} {n}" for c, n in result.reasons.most_common(4))),
        (
            f"client latency p50 / p99 at {result.concurrency} in flight",
            f"{np.percentile(lat, 50):.1f} ms / {np.percentile(lat, 99):.1f} ms",
        ),
        (
            f"throughput at {result.concurrency} in flight",
            f"{len(ids) / result.wall_s:.0f} predictions/s" if result.wall_s else "-",
        ),
        (
            f"retried {retry_sample} request ids",
            f"same decision ids: {'yes' if same_ids else 'NO'}; {sum(run.retry.failures.values())} failed",
        ),
        (
            f"explained (entity {example.request_id.rsplit('-', 1)[-1]})" if example else "explained",
            f"{example.decision_label} p={example.probability:.3f}: " + "; ".join(example.top_reasons)
            if example
            else "FAILED",
        ),
    ]
    ok = (
        not result.failures
        and not run.retry.failures
        and len(ids) == len(run.requests)
        and same_ids
        and auc_ok
        and ece_ok
        and run.explain_failures == 0
        and realised_ok
    )
    return lines, ok


def summarise(
    console: Console,
    runs: list[FamilyRun],
    rows: int,
    codes: Mapping[str, int | None],
    workdir: Path,
    *,
    retry_sample: int,
    explain_sample: int,
) -> int:
    """Prints the summary, writes ``workdir/report.png``; returns the demo's exit code: 0 only when
    every family passed (:func:`family_rows`), the CRM holds exactly one row per request id
    (``rows``) and every service exited with 0 (``codes``: role → exit code, None if never started).
    """
    from rich.table import Table

    from mlpair.report import write_report

    console.rule("[bold]4. Summary")
    all_ok = True
    for run in runs:
        table = Table(
            title=f"{run.name} (model version {run.entry.manifest.model_version})",
            show_header=False,
            title_justify="left",
        )
        lines, ok = family_rows(run, retry_sample)
        for key, value in lines:
            table.add_row(key, value)
        console.print(table)
        all_ok &= ok
    holdout, explained = sum(len(r.requests) for r in runs), sum(len(r.explained) for r in runs)
    expected_rows = holdout + explained
    console.print(
        f"CRM rows written: {rows} = {holdout} holdout decisions + {explained} explain calls (BatchPredict, "
        f"{explain_sample} per family, own request ids); the {sum(len(r.retry.decision_ids) for r in runs)} "
        f"retries reused request ids and added none (one row per request id: "
        f"{'yes' if rows == expected_rows else 'NO'})"
    )
    console.print(f"service exit codes: {', '.join(f'{k} {v}' for k, v in codes.items())}")
    if all(run.result.probabilities for run in runs):
        report = write_report([family_report(run) for run in runs], workdir / "report.png")
        console.print(f"report: {report}")
    failed = not all_ok or rows != expected_rows or any(c != 0 for c in codes.values())
    console.print("[bold red]demo FAILED[/]" if failed else "[bold green]demo OK[/]")
    return 1 if failed else 0


def family_report(run: FamilyRun) -> FamilyReport:
    """One family's row of the report picture: the holdout entities that got a decision, aligned.

    Raises:
        ValueError: the family's raw logits were never read.
    """
    from mlpair.report import FamilyReport

    answered = [i for i, r in enumerate(run.requests) if r[0] in run.result.probabilities]
    return FamilyReport(
        run.name,
        np.array([run.holdout.labels[i] for i in answered]),
        _uncalibrated(run)[answered],
        np.array([run.result.probabilities[run.requests[i][0]] for i in answered]),
        dict(Counter(run.result.decisions.values()).most_common()),
        np.array(run.result.latencies_ms),
        run.baseline[answered],
        run.result.concurrency,
    )
