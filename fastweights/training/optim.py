"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from ..models import LM
from .config import TrainConfig

__all__ = ["learning_rate", "make_optimizer"]


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``lr · min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: LM, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norm weights, conv kernels' biases, A_log, dt_bias) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), foreach=False)
