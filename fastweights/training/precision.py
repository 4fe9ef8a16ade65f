"""Precision of a training run: the weights' dtype, the forward pass's autocast, fp16's gradient scaler."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DTYPES", "PRECISIONS", "autocast", "check_precision", "make_scaler"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# --precision: the autocast dtype of the forward pass (None: plain fp32). The weights, the
# optimizer and the memories' states stay fp32; fp16 adds a gradient scaler.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

def make_scaler(config, device: torch.device) -> torch.amp.GradScaler:
    """The gradient scaler of ``config.precision``: torch's defaults for fp16, disabled otherwise
    (a disabled scaler passes the loss and the step through unchanged)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=config.precision == "fp16")


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 autocast is a CUDA feature here (on a CPU, bf16 is the low precision to use)."""
    if precision == "fp16" and torch.device(device).type != "cuda":
        raise ValueError(
            f"`precision`='fp16' (--precision fp16) needs a CUDA device (fp16 autocast with a gradient scaler); "
            f"this run is on {torch.device(device).type}: use --precision bf16 or fp32"
        )


def autocast(precision: str, device: torch.device):
    """The forward pass's context for ``precision``: nothing for fp32, else ``torch.autocast``."""
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)
