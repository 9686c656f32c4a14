"""``mlpair train``, ``mlpair import-model``, ``mlpair publish`` and ``mlpair migrate``: what runs before a
deploy (models into the repository and on to where the services read them, the decision ledger and
CRM schemas up to date); the services do none of it at start-up."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

DEFAULT_SCHEMAS = [Path("config/credit-risk/feature-schema.toml"), Path("config/churn/feature-schema.toml")]


def train(args: argparse.Namespace) -> int:
    """``mlpair train``: trains (or reuses, when up to date) each schema's family into
    ``--model-repository`` and logs its holdout metrics.

    Returns:
        0; 2 when a feature schema file is missing (the line says where it was looked for) or its
        data is refused (:class:`~mlpair.training.data.DataError`: one line naming the problem).
    """
    import dataclasses
    import logging

    from mlpair.logs import configure_logging
    from mlpair.training.data import DataError
    from mlpair.training.pipeline import load_train_config, train_family

    configure_logging("training", "INFO")
    schemas = [Path(s) for s in args.schema or DEFAULT_SCHEMAS]
    if missing := [str(s) for s in schemas if not s.is_file()]:
        print(
            f"mlpair: no feature schema at {', '.join(missing)} (paths are relative to {Path.cwd()}); "
            "run from the repository root or pass --schema",
            file=sys.stderr,
        )
        return 2
    for schema in schemas:
        config = load_train_config(Path(schema))
        if args.seed is not None:
            config = dataclasses.replace(config, seed=args.seed)
        try:
            entry, fresh = train_family(Path(schema), Path(args.model_repository), config, force=args.force)
        except DataError as exc:
            print(f"mlpair train: {schema}: {exc}", file=sys.stderr)
            return 2
        m = entry.manifest
        cal = m.metrics["holdout_calibrated"]
        logging.getLogger("mlpair").info(
            "%s version %s %s: holdout ROC AUC %.4f, Brier %.4f, ECE %.4f (calibration %s)",
            m.model_name,
            m.model_version,
            "trained" if fresh else "reused (up to date)",
            cal["roc_auc"],
            cal["brier"],
            cal["ece_15"],
            m.calibration.method,
        )
        if args.publish:
            _publish_one(entry.path, args.publish)
    return 0


def import_model(args: argparse.Namespace) -> int:
    """``mlpair import-model``: an ONNX model trained elsewhere, with its schema, preprocessing and a
    calibration set, written as the family's next version (:mod:`mlpair.training.importing`); prints
    one summary line.

    Returns:
        0; 2 when the model, its files or the calibration set are refused (one line naming the problem).
    """
    from mlpair.training.data import DataError
    from mlpair.training.importing import ImportRefused
    from mlpair.training.importing import import_model as run_import

    paths = {
        "--model": args.model,
        "--schema": args.schema,
        "--preprocessing": args.preprocessing,
        "--calibration-data": args.calibration_data,
    }
    if missing := [f"{flag} {path}" for flag, path in paths.items() if not Path(path).is_file()]:
        print(f"mlpair import-model: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        entry = run_import(
            Path(args.model),
            Path(args.schema),
            Path(args.preprocessing),
            Path(args.calibration_data),
            Path(args.model_repository),
            output=args.output,
        )
    except (ImportRefused, DataError) as exc:
        print(f"mlpair import-model: {args.model}: {exc}", file=sys.stderr)
        return 2
    m = entry.manifest
    fitted = m.metrics["calibration_set_calibrated"]
    print(
        f"{m.model_name} version {m.model_version} imported from {args.model} into {entry.path}: calibration set "
        f"ROC AUC {fitted['roc_auc']:.4f}, Brier {fitted['brier']:.4f}, ECE {fitted['ece_15']:.4f} "
        f"(calibration {m.calibration.method}, {m.calibration.n_samples} rows)"
    )
    return 0


def publish(args: argparse.Namespace) -> int:
    """``mlpair publish``: publishes the latest (or ``--version``) version of each model to ``--to``,
    one line per version with its content digest.

    Returns:
        0; 2 when a model or version is not in the repository (one line on stderr).

    Raises:
        ManifestError: a version is inconsistent; PublishError: the target holds that version with
            other content (``mlpair`` prints either as one line, exit 1).
    """
    from mlpair.contracts.manifest import list_versions

    root = Path(args.model_repository)
    names = args.model or (
        sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    )
    if not names:
        print(f"mlpair publish: no model under {root}; run mlpair train first", file=sys.stderr)
        return 2
    for name in names:
        versions = list_versions(root, name)
        version = args.version or (str(versions[-1]) if versions else "")
        if not version.isdigit() or int(version) not in versions:
            available = ", ".join(map(str, versions)) or "none"
            print(
                f"mlpair publish: no version {version or '(any)'} of {name!r} under {root}; available: {available}",
                file=sys.stderr,
            )
            return 2
        _publish_one(root / name / str(int(version)), args.to)
    return 0


def _publish_one(folder: Path, uri: str) -> None:
    from mlpair.sources import redact
    from mlpair.sources.publish import publish as publish_version

    digest = publish_version(folder, uri)
    print(f"published {folder.parent.name} version {folder.name} to {redact(uri)} ({digest})")


def migrate(args: argparse.Namespace) -> int:
    """``mlpair migrate``: creates or upgrades the ledger and CRM schemas as their owner, prints one
    summary line.

    Returns:
        0; 2 for a bad argument or a missing outbox file; 1 when a database refused or is unreachable
        (one line on stderr, the traceback too with ``--debug``).
    """
    import logging

    from mlpair.cli import debug_enabled
    from mlpair.logs import configure_logging
    from mlpair.prediction.recording.admin import migrate
    from mlpair.prediction.settings import PredictionSettings

    configure_logging("prediction", "WARNING")
    defaults = PredictionSettings()  # PREDICTION_LEDGER_URL and PREDICTION_CRM_URL, as the services read them
    ledger_url, crm_url = args.ledger_url or defaults.ledger_url, args.crm_url or defaults.crm_url
    try:
        report = asyncio.run(
            migrate(
                ledger_url,
                crm_url,
                serving_role=args.serving_role,
                import_outboxes=[Path(p) for p in args.import_outbox or []],
                backfill_from_crm=args.backfill_from_crm,
                hand_back_outbox=args.hand_back_outbox,
            )
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlpair migrate: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001  (a database refused or is unreachable: one line, detail with --debug)
        if debug_enabled():
            logging.getLogger("mlpair").error("migration failed", exc_info=True)
        print(
            f"mlpair migrate: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'failed'}",
            file=sys.stderr,
        )
        return 1
    print(
        f"ledger at {report.revisions['ledger']}, CRM at {report.revisions['crm']}"
        + (f"; serving role {report.granted_to} granted" if report.granted_to else "")
        + (f"; {report.imported_from_outboxes} decision(s) imported from outboxes" if args.import_outbox else "")
        + (f"; {report.backfilled_from_crm} decision(s) backfilled from the CRM" if args.backfill_from_crm else "")
        + (f"; {report.handed_back} decision(s) handed back from the outbox" if args.hand_back_outbox else "")
    )
    return 0
