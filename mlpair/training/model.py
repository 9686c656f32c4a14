"""The PyTorch classifier and its deterministic CPU training loop."""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

CALIBRATION_METHODS = ("temperature", "platt", "isotonic")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one model family; all of them enter the training fingerprint.

    A family may keep its own in ``config/<model_name>/training.toml`` (same field names).
    ``seed`` drives weight initialisation and batch order; ``split_seed`` the data split, kept
    apart so versions trained with different seeds (an ensemble) share one holdout.
    """

    seed: int = 20241130
    split_seed: int = 20241130
    hidden: tuple[int, ...] = (32, 16)
    epochs: int = 20
    batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    label_smoothing: float = 0.0
    """Epsilon of cross-entropy label smoothing (0 = none); recorded for calibration to undo."""
    calibration: Literal["temperature", "platt", "isotonic"] = "temperature"
    """Calibration method PredictionService applies; every applicable one is fitted and reported."""
    early_stopping_patience: int = 0
    """0 = train all ``epochs``; n > 0 = stop after n epochs without a lower validation loss and
    keep the weights of the best epoch (validation = the calibration split)."""

    def __post_init__(self) -> None:
        if self.calibration not in CALIBRATION_METHODS:
            raise ValueError(f"calibration must be one of {', '.join(CALIBRATION_METHODS)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError("label_smoothing must be in [0, 1)")
        if self.early_stopping_patience < 0:
            raise ValueError("early_stopping_patience must be >= 0")

    @classmethod
    def from_toml(cls, path: Path) -> TrainConfig:
        """Reads a family's ``training.toml``; missing keys keep their defaults. Its optional
        ``[targets]`` table (see :func:`quality_targets`) is not a hyper-parameter and is skipped.

        Raises:
            OSError: unreadable. ValueError: unknown keys or invalid values.
        """
        with open(path, "rb") as f:
            data = tomllib.load(f)
        data.pop("targets", None)
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(data) - known:
            raise ValueError(f"{path}: unknown training settings {', '.join(sorted(unknown))}")
        if "hidden" in data:
            data["hidden"] = tuple(data["hidden"])
        return cls(**data)


def quality_targets(path: Path) -> dict[str, float]:
    """The ``[targets]`` table of a ``training.toml`` (e.g. ``min_roc_auc``, ``max_ece``): the
    holdout quality a family's model is expected to reach; empty when the file has none."""
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        return {k: float(v) for k, v in tomllib.load(f).get("targets", {}).items()}


@dataclass(frozen=True)
class TrainingRun:
    """How a training run ended (epochs counted from 1)."""

    epochs_run: int
    best_epoch: int
    """The epoch whose weights were kept: the lowest validation loss with early stopping, else the last."""
    max_epochs: int

    @property
    def stopped_early(self) -> bool:
        """Whether early stopping ended the run before ``max_epochs``."""
        return self.epochs_run < self.max_epochs

    def describe(self) -> str:
        """``"stopped early at epoch 18 of 40 (best epoch 13)"`` or ``"all 40 epochs"``."""
        if self.stopped_early:
            return f"stopped early at epoch {self.epochs_run} of {self.max_epochs} (best epoch {self.best_epoch})"
        return f"all {self.max_epochs} epochs" + (
            f" (best epoch {self.best_epoch})" if self.best_epoch != self.epochs_run else ""
        )


class MLPClassifier(nn.Module):
    """``[batch, n_features] float32`` → logits ``[batch, n_classes] float32``."""

    def __init__(self, n_features: int, hidden: tuple[int, ...], n_classes: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = n_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, n_classes] float32`` for standardised features ``[batch, n_features] float32``."""
        return self.net(features)


def train_classifier(
    x: np.ndarray,
    y: np.ndarray,
    config: TrainConfig,
    progress=None,
    validation: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[MLPClassifier, TrainingRun]:
    """Trains deterministically on CPU: fixed seeds, deterministic kernels, one thread.

    Args:
        x: ``[n, n_features] float32`` training features.
        y: ``[n]`` 0/1 labels.
        config: hyper-parameters.
        progress: optional callable ``(epoch, loss)`` called after each epoch.
        validation: ``(x, y)`` for early stopping; required when
            ``config.early_stopping_patience`` > 0. Its loss is plain cross-entropy.

    Returns:
        The trained model in eval mode (with early stopping: the best validation epoch's
        weights) and how the run ended. Same inputs and config → bit-identical weights.

    Raises:
        ValueError: early stopping is configured but no validation data is given.
    """
    if config.early_stopping_patience and validation is None:
        raise ValueError("early stopping needs validation data")
    torch.manual_seed(config.seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reduction order, hence the weights, must not depend on cores
    try:
        model = MLPClassifier(x.shape[1], config.hidden)
        optimiser = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        loss_fn = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
        features, labels = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
        order = torch.Generator().manual_seed(config.seed)
        best_loss, best_state, best_epoch, epoch = float("inf"), None, 0, -1
        for epoch in range(config.epochs):
            model.train()
            perm = torch.randperm(len(features), generator=order)
            total = 0.0
            for start in range(0, len(features), config.batch_size):
                batch = perm[start : start + config.batch_size]
                optimiser.zero_grad()
                loss = loss_fn(model(features[batch]), labels[batch])
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(batch)
            if progress is not None:
                progress(epoch, total / len(features))
            if config.early_stopping_patience and validation is not None:
                val_loss = _validation_loss(model, *validation)
                if val_loss < best_loss:
                    best_loss, best_state, best_epoch = val_loss, copy.deepcopy(model.state_dict()), epoch
                elif epoch - best_epoch >= config.early_stopping_patience:
                    break
        if best_state is not None:
            model.load_state_dict(best_state)
        else:
            best_epoch = epoch
        return model.eval(), TrainingRun(epoch + 1, best_epoch + 1, config.epochs)
    finally:
        torch.set_num_threads(threads)


def _validation_loss(model: MLPClassifier, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with torch.inference_mode():
        return float(nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y.astype(np.int64))))


def predict_logits(model: MLPClassifier, x: np.ndarray) -> np.ndarray:
    """Logits ``[n, n_classes] float32`` for ``[n, n_features] float32`` features."""
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()
