"""``mlpair train``: one model family from its schema file to a verified repository entry.

Any model family: its schema file names the data source, target and features; its optional
``training.toml`` beside the schema holds the hyper-parameters (:class:`TrainConfig`).
Steps: load the real data → seeded stratified split → fit the preprocessing on the train
split → assemble features with the serving code path → train → export ONNX and check parity
→ fit the calibrations on the calibration split → evaluate on the holdout → write
``<root>/<model_name>/<version>/`` atomically. If the latest entry was trained from the same
data, schema and config (same fingerprint), it is reused instead; ``force`` always writes a
new version (e.g. another seed for an ensemble).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mlpair.contracts import calibration, metrics
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import (
    PREPROCESSING_FILE,
    SCORE_BASELINE,
    Calibration,
    IsotonicParams,
    Manifest,
    ManifestError,
    ModelEntry,
    PlattParams,
    TensorSpec,
    VersionTriple,
    file_sha256,
    list_versions,
    load_entry,
    write_manifest,
)
from mlpair.contracts.preprocessing import Preprocessing
from mlpair.contracts.schema import FeatureSchema
from mlpair.training.data import SPLIT_FRACTIONS, Dataset, load_dataset, public_source, stratified_split
from mlpair.training.export import INPUT_NAME, OUTPUT_NAME, check_parity, export_onnx, export_torch_program
from mlpair.training.model import MLPClassifier, TrainConfig, TrainingRun, predict_logits, train_classifier

logger = logging.getLogger(__name__)

# Bump when a change to this package changes the trained model for the same inputs.
TRAINING_CODE_VERSION = "4"  # 2: per-family training config; 3: model.pt2 (torch.export); 4: score baseline
TRAINING_CONFIG_FILE = "training.toml"  # beside the feature schema, optional
BASELINE_QUANTILES = 101
TORCH_PROGRAM_FILE = "model.pt2"


def fingerprint(schema: FeatureSchema, data_sha256: str, config: TrainConfig) -> str:
    """Hash of everything that determines the trained model; equal → the entry can be reused."""
    payload = json.dumps(
        {
            "schema": schema.model_dump(mode="json"),
            "data": data_sha256,
            "config": dataclasses.asdict(config),
            "code": TRAINING_CODE_VERSION,
        },
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def find_reusable(root: Path, model_name: str, print_: str) -> ModelEntry | None:
    """The latest verified entry of ``model_name`` whose training fingerprint is ``print_``."""
    versions = list_versions(root, model_name)
    if not versions:
        return None
    try:
        entry = load_entry(root / model_name / str(versions[-1]))
    except ManifestError as exc:
        logger.warning("latest entry is not reusable: %s", exc)
        return None
    return entry if entry.manifest.training.get("fingerprint") == print_ else None


def baselines(preprocessing: Preprocessing, train: Dataset) -> dict[str, dict]:
    """Training distribution per feature for drift checks: quantiles of guarded numeric
    values, category frequencies (unknown and missing folded into the default)."""
    assembler = FeatureAssembler(preprocessing)
    x = assembler.assemble_many(train.records)
    out: dict[str, dict] = {}
    qs = np.linspace(0, 1, BASELINE_QUANTILES)
    for i, feat in enumerate(preprocessing.feature_schema.numeric):
        out[feat.name] = {
            "kind": "numeric",
            "space": "standardised",
            "quantiles": np.quantile(x[:, i], qs).round(6).tolist(),
        }
    names = preprocessing.feature_names
    for category in preprocessing.feature_schema.categorical:
        cols = [j for j, n in enumerate(names) if n.startswith(category.name + "=")]
        freq = x[:, cols].mean(axis=0)
        out[category.name] = {
            "kind": "categorical",
            "frequencies": {names[j].split("=", 1)[1]: round(float(f), 6) for j, f in zip(cols, freq)},
        }
    return out


def score_baseline(probabilities: np.ndarray) -> dict:
    """Quantiles of calibrated probabilities (``[n]`` in [0, 1]) for score drift checks."""
    qs = np.linspace(0, 1, BASELINE_QUANTILES)
    return {
        "kind": "score",
        "space": "calibrated probability",
        "n": int(len(probabilities)),
        "quantiles": np.quantile(probabilities, qs).round(6).tolist(),
    }


def load_train_config(schema_path: Path) -> TrainConfig:
    """The family's ``training.toml`` beside its schema, or the defaults when there is none.

    Raises:
        ValueError: the file holds unknown keys or invalid values.
    """
    path = schema_path.parent / TRAINING_CONFIG_FILE
    return TrainConfig.from_toml(path) if path.is_file() else TrainConfig()


def fit_calibration(logits: np.ndarray, labels: np.ndarray, positive: int, config: TrainConfig) -> Calibration:
    """Fits every applicable calibration on the calibration split; ``config.calibration`` is served.

    Temperature and Platt are always fitted; isotonic only with at least
    ``MIN_ISOTONIC_SAMPLES`` samples.

    Raises:
        ValueError: the configured method cannot be fitted (e.g. isotonic on too few samples).
    """
    margins = calibration.margin(logits, positive)
    temperature = calibration.fit_temperature(logits, labels, positive, config.label_smoothing)
    a, b = calibration.fit_platt(margins, labels)
    isotonic = None
    if len(labels) >= calibration.MIN_ISOTONIC_SAMPLES or config.calibration == "isotonic":
        knots, values = calibration.fit_isotonic(margins, labels)  # refuses too few samples
        isotonic = IsotonicParams(knots=knots, values=values)
    return Calibration(
        method=config.calibration,
        temperature=temperature,
        label_smoothing=config.label_smoothing,
        platt=PlattParams(a=a, b=b),
        isotonic=isotonic,
        n_samples=len(labels),
    )


def holdout_metrics(cal: Calibration, logits: np.ndarray, labels: np.ndarray, positive: int) -> dict[str, dict]:
    """ROC AUC, Brier and ECE on the holdout: uncalibrated, as served, and per fitted method."""
    out = {
        "holdout_uncalibrated": metrics.summary(labels, cal.probabilities(logits, positive, "none")),
        "holdout_calibrated": metrics.summary(labels, cal.probabilities(logits, positive)),
    }
    for method in ("temperature", "platt", "isotonic"):
        if method == "temperature" or getattr(cal, method) is not None:
            out[f"holdout_{method}"] = metrics.summary(labels, cal.probabilities(logits, positive, method))
    return out


def train_family(
    schema_path: Path, root: Path, config: TrainConfig | None = None, *, force: bool = False, show_progress: bool = True
) -> tuple[ModelEntry, bool]:
    """Trains (or reuses) the model family described by ``schema_path`` into ``root``.

    Args:
        config: hyper-parameters; None reads the family's ``training.toml`` (or the defaults).

    Returns:
        The verified entry and whether it was newly trained (False = reused).

    Raises:
        ExportParityError: ONNX Runtime and PyTorch disagree by more than 1e-4 on the holdout.
        ValueError: the schema or data set is unusable.
    """
    schema = FeatureSchema.from_toml(schema_path)
    config = config or load_train_config(schema_path)
    data = load_dataset(schema, schema_path.parent)
    print_ = fingerprint(schema, data.sha256, config)
    if not force and (entry := find_reusable(root, schema.name, print_)) is not None:
        logger.info("reusing %s version %s (same fingerprint)", schema.name, entry.manifest.model_version)
        return entry, False

    splits = {name: data.subset(idx) for name, idx in stratified_split(data.labels, config.split_seed).items()}
    preprocessing = Preprocessing.fit(schema, splits["train"].records)
    assembler = FeatureAssembler(preprocessing)
    x = {name: assembler.assemble_many(s.records) for name, s in splits.items()}

    model, run = _train_with_progress(
        x["train"],
        splits["train"].labels,
        config,
        show_progress,
        validation=(x["calibration"], splits["calibration"].labels),
    )
    target = next_version_dir(root, schema.name)
    version = target.name
    with staged_version(target) as staging:
        export_onnx(model, preprocessing.n_features, staging / "model.onnx")
        parity = check_parity(model, staging / "model.onnx", x["holdout"])
        export_torch_program(model, preprocessing.n_features, staging / TORCH_PROGRAM_FILE)
        preprocessing.save(staging / PREPROCESSING_FILE)

        positive = 1
        calibration_logits = predict_logits(model, x["calibration"])
        cal = fit_calibration(calibration_logits, splits["calibration"].labels, positive, config)
        manifest = Manifest(
            model_name=schema.name,
            versions=VersionTriple(
                model_version=version, feature_schema_version=schema.version, preprocessing_hash=preprocessing.hash
            ),
            model_sha256=file_sha256(staging / "model.onnx"),
            torch_program=TORCH_PROGRAM_FILE,
            torch_program_sha256=file_sha256(staging / TORCH_PROGRAM_FILE),
            inputs=[TensorSpec(name=INPUT_NAME, shape=[-1, preprocessing.n_features])],
            outputs=[TensorSpec(name=OUTPUT_NAME, shape=[-1, 2])],
            class_names=[f"not {schema.target.positive}", schema.target.positive],
            positive_index=positive,
            calibration=cal,
            baselines={
                **baselines(preprocessing, splits["train"]),
                SCORE_BASELINE: score_baseline(cal.probabilities(calibration_logits, positive)),
            },
            metrics=holdout_metrics(cal, predict_logits(model, x["holdout"]), splits["holdout"].labels, positive),
            data_source={
                "source": public_source(schema.source),
                "sha256": data.sha256,
                "rows": len(data.records),
                "target": f"{schema.target.column} == {schema.target.positive!r}",
                "split": {
                    **{k: len(v.records) for k, v in splits.items()},
                    "fractions": SPLIT_FRACTIONS,
                    "seed": config.split_seed,
                },
            },
            training={
                "fingerprint": print_,
                "config": dataclasses.asdict(config),
                "onnx_parity_max_abs_diff": parity,
                "epochs_run": run.epochs_run,
                "best_epoch": run.best_epoch,
            },
        )
        write_manifest(staging, manifest)
    entry = load_entry(target)
    logger.info("wrote %s version %s to %s", schema.name, version, target)
    return entry, True


def next_version_dir(root: Path, model_name: str) -> Path:
    """The folder the family's next version goes to under ``root``, named by its number (the latest
    version's + 1, or 1); the family's folder is made, the version's is left to :func:`staged_version`."""
    target = root / model_name / str((list_versions(root, model_name) or [0])[-1] + 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


@contextlib.contextmanager
def staged_version(target: Path) -> Iterator[Path]:
    """A staging folder beside ``target`` (a version's folder) for the version's files: on a normal
    exit made readable by all and renamed to ``target`` in one step, so a reader never sees half a
    version; on an exception removed."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        yield staging
        readable_by_all(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def readable_by_all(folder: Path) -> None:
    """Folders 0755, files 0644: the services may run as another user than training (the images
    run as uid 10001), and ``tempfile.mkdtemp`` creates the staging folder 0700."""
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _train_with_progress(
    x: np.ndarray, y: np.ndarray, config: TrainConfig, show: bool, validation
) -> tuple[MLPClassifier, TrainingRun]:
    """Trains with a progress bar that ends by saying how training ended (early stopping included)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("training"),
        BarColumn(bar_width=20),
        TextColumn("epoch {task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[ended]}"),
        TimeElapsedColumn(),
        disable=not show,
    ) as bar:
        task = bar.add_task("train", total=config.epochs, loss=float("nan"), ended="")
        model, run = train_classifier(
            x, y, config, validation=validation, progress=lambda epoch, loss: bar.update(task, advance=1, loss=loss)
        )
        bar.update(task, total=run.epochs_run, ended=run.describe())  # a full bar, not one frozen at 18/40
    logger.info("training %s", run.describe())
    return model, run
