"""``mlpair outcomes-import`` and ``mlpair outcomes-report``: realised outcomes into the ledger
database from a file, and the realised figures beside each version's holdout figures.

Both connect to the ledger database directly, as ``mlpair migrate`` does (``--ledger-url``, or
``PREDICTION_LEDGER_URL``), and read the families' class names, policies and holdout figures from
``--config-dir`` and ``--model-repository``, as PredictionService does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``mlpair outcomes-import`` and ``mlpair outcomes-report``."""
    imports = sub.add_parser(
        "outcomes-import",
        help="store realised outcomes from a CSV or Parquet file beside the decisions (idempotent)",
    )
    imports.add_argument("file", help="outcomes: .csv or .parquet with request_id, label, observed_at (model_name)")
    imports.add_argument("--chunk-rows", type=int, default=5000, help="rows per transaction [default: 5000]")
    report = sub.add_parser(
        "outcomes-report", help="realised ROC AUC, precision, recall, ECE, Brier per family, version and window"
    )
    report.add_argument(
        "--windows-h",
        type=float,
        nargs="*",
        default=[0.0],
        help="windows of decision time in hours back from now (0: all on record) [default: 0]",
    )
    report.add_argument("--min-joined", type=int, default=1, help="fewest joined decisions to report [default: 1]")
    report.add_argument("--picture", help="also draw ROC and reliability curves into this PNG")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for command in (imports, report):
        command.add_argument(
            "--ledger-url", default=None, help="decision ledger URL [env PREDICTION_LEDGER_URL; default as serving]"
        )
        command.add_argument("--model-repository", default=None, help="model repository [default as serving]")
        command.add_argument("--config-dir", default=None, help="families' schemas and policies [default as serving]")
        command.add_argument("--model-name", default=None, help="family of rows naming none [default as serving]")
    imports.set_defaults(func=outcomes_import)
    report.set_defaults(func=outcomes_report)


def _context(args: argparse.Namespace) -> tuple[Any, dict]:
    """The outcome store of the arguments' ledger and the served families (by name).

    Raises:
        StartupError: a family has no trained model, or its files disagree.
    """
    from mlpair.prediction.families import ModelFamily
    from mlpair.prediction.feedback.items import FamilyLabels
    from mlpair.prediction.feedback.store import OutcomeStore
    from mlpair.prediction.settings import PredictionSettings

    defaults = PredictionSettings()
    config_dir = Path(args.config_dir) if args.config_dir else defaults.config_dir
    repository = Path(args.model_repository) if args.model_repository else defaults.model_repository
    names = sorted(p.parent.name for p in config_dir.glob("*/policy.toml") if (repository / p.parent.name).is_dir())
    if not names:
        from mlpair.startup import StartupError

        raise StartupError(
            f"no model family has both a policy under {config_dir} and trained versions under {repository}: "
            "pass --config-dir and --model-repository (or PREDICTION_CONFIG_DIR, PREDICTION_MODEL_REPOSITORY) "
            "as PredictionService has them"
        )
    families = {name: ModelFamily.load(name, config_dir, repository) for name in names}
    labels = {name: FamilyLabels.of_manifest(f.entry.manifest) for name, f in families.items()}
    store = OutcomeStore(
        args.ledger_url or defaults.ledger_url, labels, args.model_name or defaults.model_name, timeout_s=30.0
    )
    return store, families


def outcomes_import(args: argparse.Namespace) -> int:
    """``mlpair outcomes-import FILE``: every valid row stored (once), every bad row named on stderr.

    Returns:
        0 when every row was stored (or was on record already); 1 when any row was refused (the
        valid ones are stored) or the file cannot be read.
    """
    from mlpair.prediction.feedback.importing import UnreadableFile, import_file

    store, _ = _context(args)

    async def run():
        try:
            return await import_file(Path(args.file), store, chunk_rows=max(args.chunk_rows, 1))
        finally:
            await store.close()

    try:
        report = asyncio.run(run())
    except UnreadableFile as exc:
        print(f"mlpair outcomes-import: {exc}", file=sys.stderr)
        return 1
    for error in report.refused[:100]:
        print(f"{error.code} {error.message}", file=sys.stderr)
    if len(report.refused) > 100:
        print(f"… and {len(report.refused) - 100} more refused rows", file=sys.stderr)
    print(
        f"{report.rows} rows: {report.stored} stored ({report.unmatched} awaiting their decision), "
        f"{report.duplicates} on record already, {len(report.refused)} refused"
    )
    return 1 if report.refused else 0


def outcomes_report(args: argparse.Namespace) -> int:
    """``mlpair outcomes-report``: per family, model version and window, the realised figures beside
    the version's holdout figures (its manifest); with ``--picture``, the curves as a PNG.

    Returns:
        0 (also when no outcome joins a decision yet: the table says so).
    """
    from mlpair.contracts.manifest import ManifestError, load_entry
    from mlpair.prediction.feedback.performance import thresholds_of
    from mlpair.prediction.feedback.refresh import FamilyPolicy, measure

    store, families = _context(args)
    policies = {n: FamilyPolicy(thresholds_of(f.policy), f.policy.decisions) for n, f in families.items()}
    repository = Path(args.model_repository) if args.model_repository else None

    async def run():
        try:
            figures = await measure(store, args.windows_h, policies, min_joined=args.min_joined)
            joined = await store.joined() if args.picture else None
            return figures, joined
        finally:
            await store.close()

    figures, joined = asyncio.run(run())
    holdout: dict[tuple[str, str], dict[str, float]] = {}
    for r in figures:
        root = repository or families[r.family].entry.path.parent.parent
        try:
            holdout[(r.family, r.model_version)] = load_entry(root / r.family / r.model_version).manifest.metrics.get(
                "holdout_calibrated", {}
            )
        except ManifestError:
            holdout[(r.family, r.model_version)] = {}
    if args.json:
        rows = [{**vars(r), "holdout": holdout[(r.family, r.model_version)]} for r in figures]
        print(json.dumps(rows, indent=2))
    else:
        print(render(figures, holdout))
    if args.picture and joined is not None:
        if _picture(joined, holdout, policies, Path(args.picture)):
            print(f"picture: {args.picture}")
        else:
            print("no picture: no family and version has outcomes of both classes yet", file=sys.stderr)
    return 0


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def render(figures: list, holdout: dict) -> str:
    """The report as text: one block per family, version and window."""
    if not figures:
        return "no outcome joins a recorded decision yet"
    lines = []
    for r in figures:
        h = holdout.get((r.family, r.model_version), {})
        lines.append(f"{r.family} version {r.model_version}, window {r.window}: {r.n} decisions with outcomes")
        lines.append(f"  {'':<22}{'realised':>10}{'holdout':>10}")
        lines.append(f"  {'ROC AUC':<22}{_num(r.roc_auc):>10}{_num(h.get('roc_auc')):>10}")
        lines.append(f"  {'ECE (15 bins)':<22}{_num(r.ece):>10}{_num(h.get('ece_15')):>10}")
        lines.append(f"  {'Brier':<22}{_num(r.brier):>10}{_num(h.get('brier')):>10}")
        lines.append(f"  {'positive rate':<22}{_num(r.positive_rate):>10}")
        for band in r.precision:
            lines.append(f"  at {band:<12} precision {_num(r.precision[band])}, recall {_num(r.recall[band])}")
        rates = ", ".join(f"{d} {v:.1%}" for d, v in r.decision_rates.items())
        lines.append(f"  decisions: {rates}")
    return "\n".join(lines)


def _picture(joined, holdout: dict, policies: dict, path: Path) -> bool:
    """Draws the curves of every family and version with outcomes of both classes; whether any had them."""
    from mlpair.report import OutcomeRow, write_outcomes_report

    rows = []
    for family, version, idx in joined.groups():
        if family not in policies or not 0 < joined.positive[idx].sum() < idx.size:
            continue
        h = holdout.get((family, version), {})
        rows.append(
            OutcomeRow(
                family,
                version,
                joined.positive[idx],
                joined.probability[idx],
                h.get("roc_auc"),
                h.get("ece_15"),
                tuple(t.threshold for t in policies[family].thresholds),
            )
        )
    if rows:
        write_outcomes_report(rows, path)
    return bool(rows)
