"""How to train: :class:`TrainConfig`, the checked dataclass of ``fastweights train``'s training flags."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..config import Config, check_int
from .precision import DTYPES, PRECISIONS

__all__ = ["TrainConfig", "load_config_file"]


@dataclass
class TrainConfig(Config):
    """How to train; checked on construction.

    Args:
        data: ``"recall"`` (the built-in associative recall with overwrites) or the path
            of a text file (byte-level tokens).
        seq_len: tokens per training window (text only; recall's length follows its sizes).
        recall_keys, recall_values, recall_pairs, recall_active_keys, recall_queries:
            the sizes of :class:`~fastweights.tasks.AssociativeRecall`.
        steps: optimizer steps in total (a resumed run continues up to this).
        batch_size: sequences per step, over all processes together.
        lr, min_lr_ratio, warmup_steps: linear warmup to ``lr``, then cosine decay to
            ``lr · min_lr_ratio`` at ``steps``.
        weight_decay: AdamW decay of the matrices (not of norms, biases, decay parameters).
        grad_clip: clip the global gradient norm (0: off).
        eval_every: evaluate every N steps (and at the end); 0: only at the end.
        eval_batches: (recall) how many batches each evaluation scores.
        eval_tokens: (text) how many held-out tokens each evaluation scores, in consecutive
            windows of ``seq_len`` from the start of the held-out text; 0: all of it.
        val_data: a text file to evaluate on; ``None``: the last 10% of ``data`` is held out.
        save_every: write a checkpoint every N steps (and at the end); 0: only at the end.
        keep_checkpoints: how many of the newest checkpoints to keep.
        seed: seeds the initialization, the data order and the evaluation data.
        dtype: ``"float32"`` or ``"float64"``: the weights' dtype.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: autocast of the forward pass (bf16 and
            fp16 need ``dtype="float32"``; fp16 needs a CUDA device and uses a gradient scaler).
        threads: torch intra-op threads (0: leave torch's default).
        ddp_timeout: seconds a data-parallel collective may wait for the other ranks
            before every rank gives up, naming the silent one.
        fsdp: shard the weights, gradients and optimizer moments over the processes with
            FSDP2 (``fully_shard`` per block and on the root); checkpoints are then sharded
            (``torch.distributed.checkpoint``) and resume on any number of processes.
        context_parallel: split every sequence's tokens over this many processes (a
            context-parallel group); the data-parallel size is processes / this. 1: off.
    """

    data: str = "recall"
    seq_len: int = 128
    recall_keys: int = 16
    recall_values: int = 16
    recall_pairs: int = 16
    recall_active_keys: int = 6
    recall_queries: int = 4
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    eval_tokens: int = 32768
    val_data: Optional[str] = None
    save_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    dtype: str = "float32"
    precision: str = "fp32"
    threads: int = 0
    ddp_timeout: float = 300.0
    fsdp: bool = False
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(f"TrainConfig: `data` must be 'recall' or a text file path, got {self.data!r}")
        for name in ("seq_len", "steps", "batch_size", "eval_batches", "keep_checkpoints",
                     "recall_keys", "recall_values", "recall_pairs", "recall_active_keys", "recall_queries"):
            check_int("TrainConfig", name, getattr(self, name))
        if not isinstance(self.fsdp, bool):
            raise TypeError(f"TrainConfig: `fsdp` (--fsdp) must be true or false, got {self.fsdp!r}")
        check_int("TrainConfig", "context_parallel", self.context_parallel, what="an int >= 1 (--context-parallel)")
        for name in ("warmup_steps", "eval_every", "eval_tokens", "save_every", "seed", "threads"):
            check_int("TrainConfig", name, getattr(self, name), minimum=0)
        if isinstance(self.ddp_timeout, bool) or not isinstance(self.ddp_timeout, (int, float)) \
                or not math.isfinite(self.ddp_timeout) or self.ddp_timeout <= 0:
            raise ValueError(f"TrainConfig: `ddp_timeout` must be a finite number of seconds > 0, got {self.ddp_timeout!r}")
        for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"TrainConfig: `{name}` must be a finite number >= 0, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig: unknown `dtype` {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig: unknown `precision` {self.precision!r} (--precision); expected one of {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and self.dtype != "float32":
            raise ValueError(
                f"TrainConfig: `precision`={self.precision!r} (--precision {self.precision}) autocasts float32 weights; "
                f"it cannot be combined with `dtype`={self.dtype!r} (autocast does not lower float64); use --dtype float32"
            )
        if self.val_data is not None and (not isinstance(self.val_data, str) or not self.val_data):
            raise ValueError(f"TrainConfig: `val_data` must be a text file path or None, got {self.val_data!r}")
        if self.val_data is not None and self.data == "recall":
            raise ValueError("TrainConfig: `val_data` (--val-data) is a held-out text file; the recall task makes its own held-out data")


def load_config_file(path: str) -> Tuple[Dict, Dict]:
    """The ``model`` and ``train`` sections of a JSON config file (unknown sections refused)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a JSON object with 'model' and 'train' sections")
    unknown = sorted(set(data) - {"model", "train"})
    if unknown:
        raise ValueError(f"--config {path}: unknown section(s) {unknown}; expected 'model' and 'train'")
    return dict(data.get("model", {})), dict(data.get("train", {}))
