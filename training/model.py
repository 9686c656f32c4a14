"""The PyTorch classifier and its deterministic CPU training loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters; all of them enter the training fingerprint."""

    seed: int = 20241130
    hidden: tuple[int, ...] = (32, 16)
    epochs: int = 20
    batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4


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
        return self.net(features)


def train_classifier(x: np.ndarray, y: np.ndarray, config: TrainConfig, progress=None) -> MLPClassifier:
    """Trains deterministically on CPU: fixed seeds, deterministic kernels, one thread.

    Args:
        x: ``[n, n_features] float32`` training features.
        y: ``[n]`` 0/1 labels.
        config: hyper-parameters.
        progress: optional callable ``(epoch, loss)`` called after each epoch.

    Returns:
        The trained model in eval mode. Same inputs and config → bit-identical weights.
    """
    torch.manual_seed(config.seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reduction order, hence the weights, must not depend on cores
    try:
        model = MLPClassifier(x.shape[1], config.hidden)
        optimiser = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                      weight_decay=config.weight_decay)
        loss_fn = nn.CrossEntropyLoss()
        features, labels = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
        order = torch.Generator().manual_seed(config.seed)
        for epoch in range(config.epochs):
            model.train()
            perm = torch.randperm(len(features), generator=order)
            total = 0.0
            for start in range(0, len(features), config.batch_size):
                batch = perm[start:start + config.batch_size]
                optimiser.zero_grad()
                loss = loss_fn(model(features[batch]), labels[batch])
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(batch)
            if progress is not None:
                progress(epoch, total / len(features))
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def predict_logits(model: MLPClassifier, x: np.ndarray) -> np.ndarray:
    """Logits ``[n, n_classes] float32`` for ``[n, n_features] float32`` features."""
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()
